"""The raw (undecoded) samples of one webdataset tar shard, from any sample on.

webdataset's tar iterator opens every shard as a stream and reads every member's bytes; it has no way to start in
the middle of a shard. Resuming a stream at sample k of a shard must not read, let alone decode, the k samples
before it, so this reader opens local shards for random access (members before the start are passed over by their
headers alone: a seek per member) and streams only remote ones (`scheme://`, `pipe:`), which cannot seek.
Samples are grouped by key as webdataset groups them (`base_plus_ext`).
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext

from disco_clip_ds.data.shards import is_url


def raw_samples(url: str, start: int = 0) -> Iterator[dict]:
    """The samples of shard `url` from sample index `start` on: dicts with `__key__`, `__url__` and one bytes value
    per extension (lower case). Errors (missing file, not a tar, truncated data) propagate, after the samples
    before them."""
    if is_url(url):
        stream = gopen(url)
        tar = tarfile.open(fileobj=stream, mode="r|*")
    else:
        stream, tar = None, tarfile.open(url, mode="r:*")
    try:
        index, sample = -1, None
        for info in tar:
            tar.members = []  # as webdataset does: the member list would grow with the shard
            if not info.isreg():
                continue
            prefix, suffix = base_plus_ext(info.name)
            if prefix is None or prefix.startswith("__"):  # no extension, or webdataset's metadata members
                continue
            if sample is None or prefix != sample["__key__"]:
                if sample is not None and index >= start:
                    yield sample
                index, sample = index + 1, {"__key__": prefix, "__url__": url}
            if index >= start:  # the members before `start` are skipped unread
                sample[suffix.lower()] = tar.extractfile(info).read()
        if sample is not None and index >= start:
            yield sample
    finally:
        tar.close()
        if stream is not None:
            stream.close()
