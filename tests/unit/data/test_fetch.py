"""data/prep/fetch.py: the per-image deadline cuts a trickling body and trickling headers; hostile metadata (another
scheme than http(s), a redirect to one, a huge or endless body, a decompression bomb's header) fails per image with a
reason of its own."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disco_clip_ds.data.decode import MAX_IMAGE_PIXELS
from disco_clip_ds.data.prep import fetch
from disco_clip_ds.data.prep.fetch import download_image_with_deadline, fetch_with_deadline
from disco_clip_ds.testing.images import declaring_size, image_bytes


@pytest.mark.slow  # waits out its deadline (2 s)
def test_fetch_with_deadline_cuts_a_trickle(image_server):
    url = image_server.add("/slow", body=b"x" * 1000, trickle=0.05)
    fast = image_server.add("/fast", body=b"y" * 1000)
    assert fetch_with_deadline(fast, timeout=2, deadline_s=5)[1] == b"y" * 1000
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        fetch_with_deadline(url, timeout=2, deadline_s=1)
    assert time.monotonic() - started < 25  # generous on a loaded machine; the whole body would take 50 s
    slow_head = image_server.add("/slow-head", body=b"z" * 10, trickle_headers=0.05)
    with pytest.raises(TimeoutError, match="deadline"):  # the status line and headers alone take ~2 s
        fetch_with_deadline(slow_head, timeout=2, deadline_s=1)


# --- hostile metadata: other schemes, unbounded bodies, decompression bombs (fast: loopback, no waiting) ---

ROW_KEY = "000000042"


def _fetch(url: str, **limits) -> tuple[str, object, str | None]:
    return download_image_with_deadline((ROW_KEY, url), 2, None, None, deadline_s=10, **limits)


@pytest.mark.parametrize(
    "url, scheme",
    [("file://{secret}", "'file'"), ("FILE://{secret}", "'file'"), ("{secret}", "'none'"), ("ftp://host/x", "'ftp'")]
    + [("data:image/png;base64,iVBORw0KGgo=", "'data'"), ("", "'none'")],
)
def test_only_http_and_https_urls_are_fetched(tmp_path, url, scheme):
    """urllib's default opener reads file:// from the local disk: hostile metadata would pull local files into
    shards that may be published. Each other scheme is a failure with its reason, and nothing is read."""
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(image_bytes())
    key, body, reason = _fetch(url.format(secret=secret))
    assert (key, body) == (ROW_KEY, None)
    assert reason == f"not an http(s) URL (scheme {scheme}): only http and https are fetched"


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("target", ["file:///etc/hostname", "ftp://127.0.0.1/x.jpg"])
def test_a_redirect_to_another_scheme_is_not_followed(image_server, target):
    url = image_server.add("/away.jpg", redirect=target)
    key, body, reason = _fetch(url)
    assert body is None and reason and ("not allowed" in reason or "unknown url type: ftp" in reason), reason
    assert image_server.hits["/away.jpg"] == 1


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_body_past_the_byte_limit_fails_as_its_own_reason_unread(image_server):
    """A 2 GiB Content-Length is refused on its header; an endless body after max_bytes + 1 bytes; the limit is
    inclusive. (Before: both were read whole into memory, and a MemoryError was recorded as an empty reason.)"""
    body = image_bytes("PNG", "L", (8, 8), 1)
    limit = len(body)
    huge = image_server.add("/huge.png", body=body, content_length=2**31)
    endless = image_server.add("/endless.png", body=body, endless=True)
    exact = image_server.add("/exact.png", body=body)
    over = image_server.add("/over.png", body=body + b"\0")
    for url in (huge, endless, over):
        assert _fetch(url, max_bytes=limit)[1:] == (None, f"image above --max_image_bytes {limit}"), url
    assert _fetch(exact, max_bytes=limit)[1].getvalue() == body


@pytest.mark.parametrize(
    "fmt, size, max_pixels, passes",
    [("PNG", (30000, 30000), MAX_IMAGE_PIXELS, False), ("JPEG", (8000, 8000), MAX_IMAGE_PIXELS, False)]
    + [("PNG", (100, 100), 100 * 100, True), ("JPEG", (101, 100), 100 * 100, False)],
)
@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_image_above_the_training_pixel_cap_fails_undecoded(image_server, fmt, size, max_pixels, passes):
    """A 70-byte PNG declaring 30000 x 30000 passed the download (OpenCV's cap is 2^30 pixels) and would be decoded
    to gigabytes; the cap is training's (data/decode.py), inclusive."""
    data = declaring_size(fmt, size)
    url = image_server.add(f"/bomb-{fmt}-{size[0]}.img", body=data)
    _, body, reason = _fetch(url, max_pixels=max_pixels)
    assert (
        (body is not None, reason) == (True, None)
        if passes
        else (False, f"image above --max_image_pixels {max_pixels}")
    )


def test_a_failure_without_text_still_has_a_reason(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(fetch, "fetch_with_deadline", out_of_memory)
    assert _fetch("http://127.0.0.1:9/x.jpg") == (ROW_KEY, None, "MemoryError")


_URLS = st.one_of(
    st.text(max_size=40),  # empty, whitespace, any Unicode
    st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=8),  # non-UTF-8 bytes
    st.builds(
        lambda s, rest: f"{s}:{rest}",
        st.sampled_from(["file", "FILE", "ftp", "data", "jar", "", " http"]),
        st.text(max_size=20),
    ),
    st.sampled_from(["/etc/passwd", "../../x.jpg", "C:\\x.jpg", "http://[::1", "\x00", "file:/etc/passwd"]),
    st.binary(max_size=20),
    st.none(),
    st.integers(),
)


@settings(max_examples=25, derandomize=True, deadline=None)
@given(url=_URLS)
def test_any_url_is_http_or_refused_in_one_line(url):
    """`check_url` of anything: None for an http(s) URL, else a one-line ValueError; nothing else raises."""
    try:
        fetch.check_url(url)
    except ValueError as error:
        assert str(error) and "\n" not in str(error)
        return
    assert isinstance(url, str) and url.split(":", 1)[0].strip().lower() in ("http", "https"), url
