"""`data filter`'s copy path: a shard's samples located by their tar headers alone (where each member's bytes lie),
and the kept members written into a new tar byte for byte, with the headers Python's tarfile writes for them. `data
embed`'s decoding workers locate samples the same way, each reading only the bytes of its own batches.

Python's tarfile spends most of a score-only filter's time: it parses each header field by field (twice per member,
as webdataset's shards give each member a pax header) and builds each output header the same way, about 100 us a
member on a loaded 2-core machine. Here the common case goes fast, with tarfile's results:

- `sample_members` reads a local shard through a memory map and walks its headers: plain ustar/pax regular files,
  directories and pax headers of a path or size, checksums checked, ending at the end-of-archive marker as
  data/streams/tar_samples.py requires. It groups members into samples as `raw_samples` does (the same
  `base_plus_ext`, `is_metadata`). Anything else (another member type, a base-256 number, a damaged or cut shard)
  returns None, and the caller reads the shard with `raw_samples`, whose errors name what is wrong.
- `TarWriter` writes each member's header from a template of tarfile's own header for (mtime 0, mode 0644, uid/gid 0,
  no owner names), falling back to `TarInfo.tobuf` for a name that is not ASCII or longer than 100 bytes (those get
  a pax header), and closes the archive as tarfile closes it; it computes the file's sha256 as it writes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tarfile
from pathlib import Path

import numpy as np
from webdataset.tariterators import base_plus_ext

from disco_clip_ds.data.streams.tar_samples import is_metadata
from disco_clip_ds.errors import DataError

BLOCK = tarfile.BLOCKSIZE
_ZERO = bytes(BLOCK)


class _NotPlain(Exception):
    """A shard this module leaves to tarfile (`raw_samples`)."""


class Members:
    """Where a shard's samples lie: sample i's members are `exts[ext[j]]`, `offsets[j]`, `sizes[j]` for j in
    starts[i] .. starts[i + 1] - 1 (extension, data offset, size, in member order), its key `keys[i]`. Arrays (8 + 8 + 1
    bytes a member), so that a scan can keep them for the write step (`arrays`, `from_arrays`)."""

    def __init__(self, keys, starts, offsets, sizes, ext, exts):
        self.keys, self.starts, self.offsets, self.sizes, self.ext, self.exts = keys, starts, offsets, sizes, ext, exts

    def __len__(self) -> int:
        return len(self.keys)

    def members(self, index: int) -> list[tuple[str, int, int]]:
        """(extension, data offset, size) of sample `index`'s members."""
        span = range(int(self.starts[index]), int(self.starts[index + 1]))
        return [(self.exts[self.ext[j]], int(self.offsets[j]), int(self.sizes[j])) for j in span]

    def arrays(self) -> dict[str, np.ndarray]:
        names = np.frombuffer("\0".join(self.exts).encode(), np.uint8)
        return {"m_starts": self.starts, "m_offsets": self.offsets, "m_sizes": self.sizes, "m_ext": self.ext} | {
            "m_exts": names
        }

    @classmethod
    def from_arrays(cls, keys: list[str], saved) -> Members | None:
        """The table a scan saved (`arrays`), None when it saved none."""
        if "m_starts" not in saved:
            return None
        exts = saved["m_exts"].tobytes().decode().split("\0")
        return cls(keys, saved["m_starts"], saved["m_offsets"], saved["m_sizes"], saved["m_ext"], exts)


def sample_members(url: str) -> Members | None:
    """The samples of local shard `url`, as `raw_samples` groups them, located by their headers; None when the shard
    is not a plain one (see the module docstring)."""
    with open(url, "rb") as f:
        if not f.seek(0, 2):
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                members, headers = _members(mm)
                _check_sums(mm, headers)
                return _grouped(members)
            except _NotPlain:
                return None


def _members(mm) -> tuple[list[tuple[str, int, int]], list[tuple[int, int]]]:
    """(name, data offset, size) of every regular member, in order, and (offset, stored checksum) of every header;
    _NotPlain for anything unusual."""
    members, headers, offset, end, pax = [], [], 0, len(mm), None
    while True:
        if offset + BLOCK > end:
            raise _NotPlain
        block = mm[offset : offset + BLOCK]
        if block == _ZERO:
            if end - offset < 2 * BLOCK or mm[offset:end].strip(b"\0"):  # _check_end's rule
                raise _NotPlain
            return members, headers
        kind, name, size, checksum = _header(block)
        headers.append((offset, checksum))
        data = offset + BLOCK
        if data + size > end:
            raise _NotPlain
        if kind == tarfile.XHDTYPE:
            if pax is not None:
                raise _NotPlain
            pax = _pax_records(mm[data : data + size])
            offset = data + _padded(size)
            continue
        is_dir = kind == tarfile.DIRTYPE or (kind == tarfile.AREGTYPE and name.endswith("/"))  # as frombuf reads it
        if pax is not None:
            name, size = pax.get("path", name), int(pax.get("size", size))
            if data + size > end:
                raise _NotPlain
            pax = None
        if is_dir:  # tarfile does not pass over a directory's data (only a regular member's)
            offset = data
        elif kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
            members.append((name, data, size))
            offset = data + _padded(size)
        else:
            raise _NotPlain


def _header(block: bytes) -> tuple[bytes, str, int, int]:
    """(type, name, size, stored checksum) of a ustar header block, as tarfile's `TarInfo.frombuf` reads them."""
    if block[124] in (0o200, 0o377):  # a base-256 size: left to tarfile
        raise _NotPlain
    stored, size = _octal(block, 148, 156), _octal(block, 124, 136)
    kind = block[156:157]
    if kind == tarfile.XHDTYPE:  # its own name is not used
        return kind, "", size, stored
    name = _text(block[0:100])
    if block[345] and kind not in tarfile.GNU_TYPES:  # a ustar prefix
        name = _text(block[345:500]) + "/" + name
    return kind, name, size, stored


def _octal(block: bytes, start: int, stop: int) -> int:
    """A number field as tarfile's `nti` reads it (up to the first NUL, spaces stripped, octal); tarfile writes its
    digits and a NUL (and a space after a checksum's), read here without splitting the field first."""
    field = block[start:stop]
    try:
        if field[-1] == 0 and 0 not in field[:-1]:
            return int(field[:-1], 8)
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise _NotPlain from None


def _check_sums(mm, headers: list[tuple[int, int]]) -> None:
    """_NotPlain unless every header's stored checksum is its unsigned sum (tarfile's check, which also accepts a
    signed sum: such a shard is left to it), summed with numpy over all the headers at once."""
    if not headers:
        return
    offsets, stored = np.array(headers, np.int64).T
    whole = np.frombuffer(mm, np.uint8, count=len(mm) // BLOCK * BLOCK).reshape(-1, BLOCK)  # headers start at blocks
    blocks = whole[offsets // BLOCK]
    del whole  # the map's buffer is released before the map is closed
    sums = blocks.sum(axis=1, dtype=np.int64) - blocks[:, 148:156].sum(axis=1, dtype=np.int64) + 256
    if not np.array_equal(sums, stored):
        raise _NotPlain


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, str]:
    """A pax header's records; _NotPlain for one this module does not follow (sparse files, a binary charset)."""
    records, pos = {}, 0
    try:
        while pos < len(data) and data[pos] != 0:
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            key, value = data[space + 1 : pos + length - 1].split(b"=", 1)
            if data[pos + length - 1 : pos + length] != b"\n" or length <= 0:
                raise _NotPlain
            records[key.decode("utf-8")] = value.decode("utf-8")
            pos += length
    except (ValueError, UnicodeDecodeError):
        raise _NotPlain from None
    if any(k.startswith("GNU.") or k == "hdrcharset" for k in records):
        raise _NotPlain
    return records


def _grouped(members: list[tuple[str, int, int]]) -> Members:
    keys, starts, offsets, sizes, ext, exts, current = [], [], [], [], [], {}, set()
    for name, offset, size in members:
        if is_metadata(name):
            continue
        prefix, suffix = base_plus_ext(name)
        if prefix is None:
            continue
        suffix = suffix.lower()
        if not keys or prefix != keys[-1]:
            keys.append(prefix)
            starts.append(len(offsets))
            current = set()
        if suffix in current:  # raw_samples raises: let it say so
            raise _NotPlain
        current.add(suffix)
        offsets.append(offset)
        sizes.append(size)
        ext.append(exts.setdefault(suffix, len(exts)))
    if len(exts) > 255:
        raise _NotPlain
    starts.append(len(offsets))
    return Members(
        keys,
        np.array(starts, np.int64),
        np.array(offsets, np.int64),
        np.array(sizes, np.int64),
        np.array(ext, np.uint8),
        list(exts),
    )


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


class SharedBytes:
    """A local shard open for `read(offset, size)`: a member's data, read where it lies (one pread: cheaper than
    faulting a memory map's pages in)."""

    def __init__(self, url: str):
        self.url, self._fd = url, os.open(url, os.O_RDONLY)

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise DataError(f"{self.url}: cut short since it was scanned: run the filter again (it scans it again)")
        return data

    def close(self) -> None:
        os.close(self._fd)


def _template() -> bytes:
    info = tarfile.TarInfo("")
    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
    return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


class TarWriter:
    """A tar of regular members (mtime 0, mode 0644, uid/gid 0, no owner names) written through a large buffer, the
    same bytes as tarfile's PAX_FORMAT writer gives them; `sha256` is the finished file's."""

    _TEMPLATE = _template()
    _SUM = sum(_TEMPLATE) - sum(_TEMPLATE[148:156]) + 256  # the template's checksum, its name and size fields empty

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._digest, self._offset = hashlib.sha256(), 0

    def add(self, name: str, data: bytes) -> None:
        """Add a regular member NAME holding `data`."""
        self._write([self._header(name, len(data)), data, _ZERO[: -len(data) % BLOCK]])

    def _header(self, name: str, size: int) -> bytes:
        encoded = name.encode("ascii", "replace")
        if not name.isascii() or len(encoded) > 100 or size >= 8**11:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
            return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
        size_field = b"%011o\0" % size
        checksum = self._SUM + sum(encoded) + sum(size_field) - sum(self._TEMPLATE[124:136])
        t = self._TEMPLATE
        return b"".join((encoded.ljust(100, b"\0"), t[100:124], size_field, t[136:148], b"%06o\0 " % checksum, t[156:]))

    def _write(self, pieces: list) -> None:
        """Write `pieces` with one call (a member's header, data and padding: no copy into a buffer), then hash them."""
        total = sum(len(p) for p in pieces)
        done = os.writev(self._fd, pieces)
        while done < total:  # a short write (rare, e.g. a signal): the rest, joined
            done += os.write(self._fd, b"".join(bytes(p) for p in pieces)[done:])
        for piece in pieces:
            self._digest.update(piece)
        self._offset += total

    def close(self) -> str:
        """End the archive as tarfile does (two zero blocks, then zeros to a 10240-byte record); its sha256."""
        end = bytes(2 * BLOCK) + bytes(-(self._offset + 2 * BLOCK) % tarfile.RECORDSIZE)
        self._write([end])
        os.close(self._fd)
        return self._digest.hexdigest()

    def abort(self) -> None:
        os.close(self._fd)
