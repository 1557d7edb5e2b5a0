"""The one reader of a webdataset tar shard's raw (undecoded) samples, from any sample on: training's stream,
`disco-clip data verify`, `disco-clip data embed` and evaluation all read a shard through `raw_samples`, so they agree
on what a sample is and on when a shard is damaged.

Samples are grouped as webdataset groups them: a member's key and extension are split at the first dot of its base
name (`base_plus_ext`: `a/b.c.jpg` is key `a/b`, extension `c.jpg`), consecutive members of one key are one sample, a
member without an extension and webdataset's `__...__` metadata members are passed over, and a repeated extension
within a sample is an error. A shard is complete only when its last member is followed by the end-of-archive marker
(two zero blocks, and nothing but zeros after them): tarfile itself ends quietly at a header cut short or garbled,
which is how a tar cut at a member boundary reads, so that is checked here, for every reader.

webdataset's tar iterator opens every shard as a stream and reads every member's bytes; it has no way to start in
the middle of a shard. Resuming a stream at sample k of a shard must not read, let alone decode, the k samples
before it, so this reader opens local shards for random access (members before the start are passed over by their
headers alone: a seek per member) and streams only remote ones (`scheme://`, `pipe:`), which cannot seek.

A `pipe:` source is a shell command that may hold a credential (`curl -H 'Authorization: Bearer ...'`): what this
reader says of one (a sample's `__url__`, an error, the command's exit status) names it by its public description
(data/redact.py), never by the command.
"""

from __future__ import annotations

import io
import logging
import lzma
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext

from disco_clip_ds.data.redact import describe_source, redact_text
from disco_clip_ds.data.shards import is_url

logger = logging.getLogger("disco_clip_ds.data.streams.tar_samples")


class TruncatedShard(tarfile.ReadError):
    """A shard whose last member is not followed by the end-of-archive marker: cut short, or garbage after it."""


@dataclass(frozen=True)
class Member:
    """A member of a local shard whose bytes were left in it (`raw_samples` with `read` a set of extensions): `read()`
    reads them when they are needed, by whichever process needs them."""

    path: str
    offset: int
    size: int

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.size)
        if len(data) != self.size:  # the shard changed since its headers were read
            raise OSError(f"{self.path}: {self.size} bytes at {self.offset} expected, {len(data)} there")
        return data


def raw_samples(url: str, start: int = 0, read: bool | frozenset = True) -> Iterator[dict]:
    """The samples of shard `url` from sample index `start` on: dicts with `__key__`, `__url__` and one bytes value
    per extension (lower case); with `read=False` the values are None and no member's bytes are read (a local shard's
    members are then passed over by their headers alone); with a set of extensions, those are read and, in a local
    shard, the others are left as `Member`s to read later (a stream, which cannot come back, reads them all). Errors
    (missing file, not a tar, truncated data: a `tarfile.ReadError`, `TruncatedShard` when the end-of-archive marker
    is missing) propagate, after the samples before them. For a remote or `pipe:` source, `__url__` and the errors
    name it by its public description."""
    if not is_url(url):
        try:
            tar = tarfile.open(url, mode="r:*", tarinfo=_Header)
        except tarfile.ReadError as error:  # its message lists each compression tried, one per line
            lines = str(error).splitlines()
            said = next((line.split(": ", 1)[1] for line in lines if line.startswith("- method tar: ")), lines[0])
            raise tarfile.ReadError(f"not a tar, or cut short in its first member: {said}") from None
        plain = isinstance(tar.fileobj, io.BufferedReader)  # a compressed shard's offsets are not its file's
        yield from _samples(tar, url, start, read, url if plain else None)
        return
    public, stream = describe_source(url), None
    try:
        stream = gopen(url)
        tar = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_Header)
    except Exception as error:  # webdataset's messages quote the command
        said = _public(error, url, public)
        ended = _close_pipe(stream, url, public) if stream is not None else None
        raise OSError(f"cannot read {public}: {said}" + (f"; {ended}" if ended and ended != said else "")) from None
    try:
        yield from _samples(tar, public, start, read if isinstance(read, bool) else True)
    except TruncatedShard:
        raise
    except Exception as error:  # a failed command or a truncated stream: the message, without the command
        raise OSError(f"reading {public}: {_public(error, url, public)}") from None
    finally:
        ended = _close_pipe(stream, url, public)
        if ended:
            logger.warning("%s: the reading command ended after the reader stopped: %s", public, ended)


def is_metadata(name: str) -> bool:
    """webdataset's metadata members (`__...__`), which its tar iterator passes over (tar_file_iterator's rule)."""
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(_META.match(name))


_META = re.compile(r"__[^/]*__($|/)")  # webdataset.tariterators.tar_file_iterator's default `skip_meta`


def _samples(tar: tarfile.TarFile, name: str, start: int, read, path: str | None = None) -> Iterator[dict]:
    try:
        yield from _grouped(tar, name, start, read, path)
    except (EOFError, zlib.error, lzma.LZMAError) as error:  # a compressed shard cut short or damaged (or a plain tar
        # so damaged that tarfile took it for a compressed one): tarfile's own errors for the same are ReadErrors
        raise tarfile.ReadError(f"damaged or cut-short compressed data: {error}") from None
    finally:
        tar.close()


def _grouped(tar: tarfile.TarFile, name: str, start: int, read, path: str | None) -> Iterator[dict]:
    index, sample = -1, None
    for info in tar:
        tar.members = []  # as webdataset does: the member list would grow with the shard
        if not info.isreg() or is_metadata(info.name):
            continue
        prefix, suffix = base_plus_ext(info.name)
        if prefix is None:  # no extension: webdataset's group_by_keys passes it over
            continue
        suffix = suffix.lower()
        if sample is None or prefix != sample["__key__"]:
            if sample is not None and index >= start:
                yield sample
            index, sample = index + 1, {"__key__": prefix, "__url__": name}
        if suffix in sample:  # webdataset refuses it as well
            raise ValueError(f"{info.name}: a second .{suffix} member in sample {prefix}")
        if index >= start:  # the members before `start` are skipped unread
            sample[suffix] = _value(tar, info, suffix, read, path)
    _check_end(tar)
    if sample is not None and index >= start:
        yield sample


def _value(tar: tarfile.TarFile, info: tarfile.TarInfo, suffix: str, read, path: str | None):
    """A member's bytes, None (`read` False), or its `Member` (`read` a set without its extension, in an
    uncompressed local shard: `path`)."""
    if read is True or (read is not False and (suffix in read or path is None)):
        return tar.extractfile(info).read()
    if read is False:
        return None
    return Member(path, info.offset_data, info.size)


class _Header(tarfile.TarInfo):
    """tarfile's TarInfo, noting on the TarFile the header error it stopped at: tarfile ends its iteration quietly on
    any of them, and only a zero block (`EOFHeaderError`) is the end-of-archive marker."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as error:
            tar.stopped_at = error
            raise


def _check_end(tar: tarfile.TarFile) -> None:
    """Raise TruncatedShard unless the members end at the end-of-archive marker: a zero block where the next header
    would be, at least one more, and only zeros to the end of the file or stream (which is read to its end, so that
    a `pipe:` command is not cut off either)."""
    where = f"no end-of-archive marker after byte {tar.offset}"
    if not isinstance(getattr(tar, "stopped_at", None), tarfile.EOFHeaderError):
        raise TruncatedShard(f"truncated: {where}")
    rest = 0
    while block := tar.fileobj.read(1 << 16):
        if block.strip(b"\0"):
            raise TruncatedShard(f"truncated or damaged: {where} (data after it)")
        rest += len(block)
    if rest < tarfile.BLOCKSIZE:
        raise TruncatedShard(f"truncated: {where} (one zero block of two)")


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
