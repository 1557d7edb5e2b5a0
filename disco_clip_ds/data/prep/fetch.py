"""The HTTP side of a download: a wall-clock deadline per image (img2dataset's `timeout` bounds single socket
operations, so a server that trickles bytes would hold a worker for as long as it trickles), the fetch that
img2dataset's workers run in its place, and the process environment the workers inherit (proxies)."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import urllib.request


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


def fetch_with_deadline(url: str, timeout: float, deadline_s: float, headers: dict | None = None):
    """GET `url` and return `(response_headers, body)`, raising TimeoutError after `deadline_s` in all.

    `timeout` still bounds each socket operation; a watchdog shuts the socket down at the deadline,
    which unblocks a read that the server keeps alive by trickling bytes (in headers or body).
    """
    sockets: list = []
    expired = threading.Event()
    opener = urllib.request.build_opener(_RecordingHTTPHandler(sockets), _RecordingHTTPSHandler(sockets))

    def expire():
        expired.set()
        _shutdown_sockets(sockets)

    watchdog = threading.Timer(deadline_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            body = response.read()
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


def download_image_with_deadline(row, timeout, user_agent_token, disallowed_header_directives, deadline_s):
    """img2dataset's `downloader.download_image`, same contract and headers, with a total deadline."""
    from img2dataset.downloader import is_disallowed

    key, url = row
    user_agent = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"
    if user_agent_token:
        user_agent += f" (compatible; {user_agent_token}; +https://github.com/rom1504/img2dataset)"
    try:
        headers, body = fetch_with_deadline(url, timeout, deadline_s, {"User-Agent": user_agent})
        if disallowed_header_directives and is_disallowed(headers, user_agent_token, disallowed_header_directives):
            return key, None, "Use of image disallowed by X-Robots-Tag directive"
        return key, io.BytesIO(body), None
    except Exception as err:  # img2dataset records str(err) as the failure reason
        return key, None, str(err)


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
