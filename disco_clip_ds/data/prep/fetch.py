"""The HTTP side of a download: a wall-clock deadline per image (img2dataset's `timeout` bounds single socket
operations, so a server that trickles bytes would hold a worker for as long as it trickles), the fetch that
img2dataset's workers run in its place, and the process environment the workers inherit (proxies).

The metadata is untrusted input. Only http(s) URLs are fetched (urllib's default opener would read a `file://` URL
from the local disk into shards that may be published, and follow a redirect to `ftp://`); a body is read up to a
byte limit per image (`--max_image_bytes`: a 2 GiB Content-Length or an endless body is not held in memory); and an
image whose header declares more pixels than training reads (`--max_image_pixels`, data/decode.py) is not decoded
by img2dataset's resizer (OpenCV's own cap is 2^30 pixels); with a resize mode that scales the short side
(keep_ratio, center_crop), neither is an image more than data/decode.py's MAX_ASPECT times as long as wide, whose
resized long side would be unbounded. Each is a failure reason of its own in summary.json."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import urllib.parse
import urllib.request

from disco_clip_ds.data.decode import MAX_IMAGE_PIXELS, AboveCap, BadImage, EncodedImage

SCHEMES = ("http", "https")
MAX_IMAGE_BYTES = 16 * 2**20  # far above a web image; x threads x processes bounds a download's memory for bodies


class _RecordingHandlerMixin:
    """Remembers the socket of each HTTP(S) connection urllib opens, so that a watchdog can shut it down.

    The socket is taken at connect time: urllib drops the connection's reference to it once the
    headers are in, while the body is still read through it.
    """

    def __init__(self, sockets: list, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sockets = sockets

    def do_open(self, http_class, req, **kwargs):
        sockets = self._sockets

        def make_connection(*a, **kw):
            conn = http_class(*a, **kw)
            connect = conn.connect

            def connect_and_record():
                connect()
                sockets.append(conn.sock)

            conn.connect = connect_and_record
            return conn

        return super().do_open(make_connection, req, **kwargs)


class _RecordingHTTPHandler(_RecordingHandlerMixin, urllib.request.HTTPHandler):
    pass


class _RecordingHTTPSHandler(_RecordingHandlerMixin, urllib.request.HTTPSHandler):
    pass


def _shutdown_sockets(sockets: list) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def check_url(url) -> None:
    """A ValueError (its text the failure reason) for a URL that is not http(s): `file://`, `ftp://`, `data:`, a
    bare path, or no text at all."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if scheme not in SCHEMES:
        raise ValueError(f"not an http(s) URL (scheme {scheme or 'none'!r}): only http and https are fetched")


def _opener(sockets: list) -> urllib.request.OpenerDirector:
    """urllib's opener with the http(s) handlers alone (build_opener adds file, ftp and data ones): a redirect to
    another scheme ends as 'unknown url type'."""
    opener = urllib.request.OpenerDirector()
    handlers = (
        urllib.request.ProxyHandler(),
        urllib.request.UnknownHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
    )
    handlers += (urllib.request.HTTPRedirectHandler(), urllib.request.HTTPErrorProcessor())
    for handler in (*handlers, _RecordingHTTPHandler(sockets), _RecordingHTTPSHandler(sockets)):
        opener.add_handler(handler)
    return opener


def _read_body(response, max_bytes: int) -> bytes:
    """The body, refused (ValueError) past `max_bytes`: at once when the Content-Length says so, else after reading
    `max_bytes + 1` bytes at most (an endless or chunked body)."""
    too_large = f"image above --max_image_bytes {max_bytes}"
    length = (response.headers.get("Content-Length") or "").strip()
    if length.isdigit() and int(length) > max_bytes:
        raise ValueError(too_large)
    body = response.read(max_bytes + 1)
    if len(body) > max_bytes:
        raise ValueError(too_large)
    return body


def fetch_with_deadline(
    url: str, timeout: float, deadline_s: float, headers: dict | None = None, max_bytes: int = MAX_IMAGE_BYTES
):
    """GET `url` (http or https only: `check_url`) and return `(response_headers, body)`, raising TimeoutError
    after `deadline_s` in all and ValueError for a body above `max_bytes`.

    `timeout` still bounds each socket operation; a watchdog shuts the socket down at the deadline,
    which unblocks a read that the server keeps alive by trickling bytes (in headers or body).
    """
    check_url(url)
    sockets: list = []
    expired = threading.Event()
    opener = _opener(sockets)

    def expire():
        expired.set()
        _shutdown_sockets(sockets)

    watchdog = threading.Timer(deadline_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            body = _read_body(response, max_bytes)
            response_headers = response.headers
    except Exception:
        if expired.is_set():
            raise TimeoutError(f"download exceeded the {deadline_s:g}s deadline") from None
        raise
    finally:
        watchdog.cancel()
    if expired.is_set():  # a shut-down socket can also end a body without an error
        raise TimeoutError(f"download exceeded the {deadline_s:g}s deadline")
    return response_headers, body


def check_image_pixels(body: bytes, max_pixels: int = MAX_IMAGE_PIXELS, max_aspect: float | None = None) -> None:
    """A ValueError (the failure reason) for an image whose header declares more than `max_pixels` pixels, as
    every reader refuses it (data/decode.py), and, with `max_aspect` (for a resize mode that scales the short side:
    its long side would be unbounded), for one more than `max_aspect` times as long as wide; a body whose header
    does not read is left to img2dataset's decoder, which says why."""
    try:
        width, height = EncodedImage(body, max_pixels).size
    except AboveCap:
        raise ValueError(f"image above --max_image_pixels {max_pixels}") from None
    except BadImage:  # not an image PIL knows: img2dataset says why
        return
    if max_aspect is not None and max(width, height) > max_aspect * min(width, height):
        raise ValueError(
            f"image of {width} x {height} pixels, more than {max_aspect:g} times as long as wide: its resize would "
            "be unbounded"
        )


def download_image_with_deadline(
    row,
    timeout,
    user_agent_token,
    disallowed_header_directives,
    deadline_s,
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
    max_aspect: float | None = None,
):
    """img2dataset's `downloader.download_image`, same contract and headers, with a total deadline, http(s) only,
    a byte limit, the training pixel cap and, with `max_aspect`, a bound on the aspect ratio."""
    key, url = row
    user_agent = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"
    if user_agent_token:
        user_agent += f" (compatible; {user_agent_token}; +https://github.com/rom1504/img2dataset)"
    try:
        headers, body = fetch_with_deadline(url, timeout, deadline_s, {"User-Agent": user_agent}, max_bytes)
        if disallowed_header_directives and _disallowed(headers, user_agent_token, disallowed_header_directives):
            return key, None, "Use of image disallowed by X-Robots-Tag directive"
        check_image_pixels(body, max_pixels, max_aspect)
        return key, io.BytesIO(body), None
    except Exception as err:  # img2dataset records str(err) as the failure reason: never an empty one
        return key, None, str(err) or type(err).__name__


def _disallowed(headers, user_agent_token, directives) -> bool:
    from img2dataset.downloader import is_disallowed  # imported where it is needed: img2dataset takes seconds

    return is_disallowed(headers, user_agent_token, directives)


def bypass_proxy_for_loopback() -> None:
    """Add the loopback addresses to no_proxy: an http_proxy variable would route 127.0.0.1 through the proxy."""
    for var in ("no_proxy", "NO_PROXY"):  # spawned workers inherit os.environ
        hosts = [h for h in os.environ.get(var, "").split(",") if h]
        os.environ[var] = ",".join(hosts + [h for h in ("127.0.0.1", "localhost", "::1") if h not in hosts])


@contextlib.contextmanager
def environ(**values: str):
    """Set environment variables for the block (and the processes it starts); restore the previous values after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
