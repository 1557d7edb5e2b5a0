"""data/prep/fetch.py: the per-image deadline cuts a trickling body and trickling headers."""

from __future__ import annotations

import time

import pytest

from disco_clip_ds.data.prep.fetch import fetch_with_deadline


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
