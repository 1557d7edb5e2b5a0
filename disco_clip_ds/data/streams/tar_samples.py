"""The raw (undecoded) samples of one webdataset tar shard, from any sample on.

webdataset's tar iterator opens every shard as a stream and reads every member's bytes; it has no way to start in
the middle of a shard. Resuming a stream at sample k of a shard must not read, let alone decode, the k samples
before it, so this reader opens local shards for random access (members before the start are passed over by their
headers alone: a seek per member) and streams only remote ones (`scheme://`, `pipe:`), which cannot seek.
Samples are grouped by key as webdataset groups them (`base_plus_ext`).

A `pipe:` source is a shell command that may hold a credential (`curl -H 'Authorization: Bearer ...'`): what this
reader says of one (a sample's `__url__`, an error, the command's exit status) names it by its public description
(data/redact.py), never by the command.
"""

from __future__ import annotations

import logging
import re
import tarfile
from collections.abc import Iterator

from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext

from disco_clip_ds.data.redact import describe_source, redact_text
from disco_clip_ds.data.shards import is_url

logger = logging.getLogger("disco_clip_ds.data.streams.tar_samples")


def raw_samples(url: str, start: int = 0) -> Iterator[dict]:
    """The samples of shard `url` from sample index `start` on: dicts with `__key__`, `__url__` and one bytes value
    per extension (lower case). Errors (missing file, not a tar, truncated data) propagate, after the samples
    before them. For a remote or `pipe:` source, `__url__` and the errors name it by its public description."""
    if not is_url(url):
        yield from _samples(tarfile.open(url, mode="r:*"), url, start)
        return
    public, stream = describe_source(url), None
    try:
        stream = gopen(url)
        tar = tarfile.open(fileobj=stream, mode="r|*")
    except Exception as error:  # webdataset's messages quote the command
        said = _public(error, url, public)
        ended = _close_pipe(stream, url, public) if stream is not None else None
        raise OSError(f"cannot read {public}: {said}" + (f"; {ended}" if ended and ended != said else "")) from None
    try:
        yield from _samples(tar, public, start)
    except Exception as error:  # a failed command or a truncated stream: the message, without the command
        raise OSError(f"reading {public}: {_public(error, url, public)}") from None
    finally:
        ended = _close_pipe(stream, url, public)
        if ended:
            logger.warning("%s: the reading command ended after the reader stopped: %s", public, ended)


def _samples(tar: tarfile.TarFile, name: str, start: int) -> Iterator[dict]:
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
                index, sample = index + 1, {"__key__": prefix, "__url__": name}
            if index >= start:  # the members before `start` are skipped unread
                sample[suffix.lower()] = tar.extractfile(info).read()
        if sample is not None and index >= start:
            yield sample
    finally:
        tar.close()


def _close_pipe(stream, url: str, public: str) -> str | None:
    """Close a remote stream; what its command's end says when non-zero (curl exits 23 when the reader stops before
    the shard's end), without the command. webdataset raises that from the close, or from its __del__ as an
    "Exception ignored" message quoting the command, credential included."""
    try:
        stream.close()
    except Exception as error:
        return _public(error, url, public)
    return None


_EXIT = re.compile(r": exit (-?\d+) \(read\)")  # webdataset's Pipe: "{args}: exit {status} (read) {info}"


def _public(error: BaseException, url: str, public: str) -> str:
    """An error's message without the command or URL it quotes: a command's exit status as 'the command exited N',
    anything else with the source replaced by its public description and secrets hidden."""
    text = str(error)
    status = _EXIT.search(text)
    if status:
        return f"the command exited {status.group(1)}"
    for quoted in (url, url[len("pipe:") :] if url.startswith("pipe:") else url):
        text = text.replace(quoted, public)
    return redact_text(" ".join(text.split()))
