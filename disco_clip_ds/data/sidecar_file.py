"""One sidecar (data/embeddings.py) open for reading by rows: its safetensors header parsed and checked at open, its
tensors' rows read by `os.pread` from the data section, a block of rows verified against its checksum (format 3,
data/reinforced.py `block_digest`) when it is first read, before any of its rows is handed out.

The rows are read with `pread` into buffers of the reader's own rather than through a memory map (safetensors'
`safe_open`): the pages of a map stay resident, counted against the worker, for as long as the file is open, so that
a worker reading several sidecars through would hold all of them; here a worker holds only what its store keeps.
`pread` also leaves the descriptor's offset alone, so a store forked into DataLoader workers with a file open reads it
from every worker safely.

At open: the header's length and JSON, every tensor's dtype, shape and byte range (each of the bytes its shape
needs, the file exactly as long as the header says: a truncated file is refused here), the rows of every tensor one
per sample key, and for format 3 the header's sha256 ("sha256": `header_digest`, which covers the block checksums
"block_xxh3" and "block_rows") and one block checksum per block."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from disco_clip_ds.data.reinforced import (
    FORMAT,
    NORM_TOLERANCE,
    block_digest,
    header_digest,
    layout_problem,
    settings_problem,
)
from disco_clip_ds.errors import DataError

DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
AGAIN = "run `disco-clip data embed` for its shard again"


@dataclass
class ReadStats:
    """What a store has read, for benchmarks: sidecars opened, blocks verified (a whole older-format file counts as
    one), single rows read again from a verified block no longer kept, and bytes read from the files."""

    opens: int = 0
    blocks: int = 0
    rows: int = 0
    bytes: int = 0


@dataclass
class _Tensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in the file
    row_bytes: int
    code: str  # its safetensors dtype ("F16", ...)


@dataclass
class SidecarFile:
    """A sidecar open for reading (`open_sidecar`): `meta` its metadata (without "keys" and the block checksums),
    `rows` {sample key: row}, `block_rows` rows per block (all rows for an older format: one block, verified whole by
    the caller), `verified` the blocks verified so far."""

    path: Path
    fd: int
    meta: dict
    rows: dict[str, int]
    tensors: dict[str, _Tensor]
    block_rows: int
    digests: list[str] | None
    stats: ReadStats
    identity: tuple
    keys: list[str]
    verified: set[int] = field(default_factory=set)

    @property
    def blockwise(self) -> bool:
        """Whether each block has a checksum of its own (format 3); else the caller verifies the whole file."""
        return self.digests is not None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_block(self, block: int, names: list[str]) -> dict[str, torch.Tensor]:
        """The rows of block `block` of the tensors `names`, in the stored dtype, once the block's rows of every tensor
        match its checksum; else a DataError naming the file and the rows."""
        start = block * self.block_rows
        stop = min(len(self.rows), start + self.block_rows)
        buffers = {name: self._read(name, start, stop) for name in sorted(self.tensors)}
        self._check(block, buffers, start, stop)
        return {name: self._tensor(name, buffers[name], stop - start) for name in names}

    def read_all(self, matches: Callable[[dict[str, torch.Tensor]], bool] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor whole, each block verified (as `read_block`); an older format's file (one checksum of the
        whole file): `matches(tensors)` says whether that checksum matches, asked before its values are checked."""
        n, names = len(self.rows), sorted(self.tensors)
        buffers = {name: self._read(name, 0, n) for name in names}
        tensors = {name: self._tensor(name, buffers[name], n) for name in names}
        if not self.blockwise and matches is not None and not matches(tensors):
            raise DataError(f"{self.path}: its checksum does not match its contents: {AGAIN}")
        for block, start in enumerate(range(0, n, self.block_rows)):
            stop = min(n, start + self.block_rows)
            self._check(block, {name: self._rows_of(name, buffers[name], start, stop) for name in names}, start, stop)
        return tensors

    def _rows_of(self, name: str, buffer: bytearray, start: int, stop: int) -> memoryview:
        width = self.tensors[name].row_bytes
        return memoryview(buffer)[start * width : stop * width]

    def read_row(self, row: int, names: list[str]) -> dict[str, torch.Tensor]:
        """Row `row` of the tensors `names`, of a block already verified from this open file."""
        assert row // self.block_rows in self.verified, "a row is read only from a verified block"
        self.stats.rows += 1
        return {name: self._tensor(name, self._read(name, row, row + 1), 1)[0] for name in names}

    def unchanged(self) -> bool:
        """Whether the file at `path` is still the one open (a whole-file check reads it by its path)."""
        try:
            return _identity(os.stat(self.path)) == self.identity
        except OSError:
            return False

    def _check(self, block: int, buffers: dict, start: int, stop: int) -> None:
        """Block `block` (rows `start` to `stop` - 1; `buffers` {name: its rows' bytes}) matches its checksum (format
        3) and every embedding in it is finite and of unit length (within NORM_TOLERANCE)."""
        if self.digests is not None and block_digest(buffers[n] for n in sorted(buffers)) != self.digests[block]:
            raise DataError(
                f"{self.path}: its checksum does not match its contents (rows {start} to {stop - 1}, torn or "
                f"altered): {AGAIN}"
            )
        for name, buffer in buffers.items():
            self._check_values(name, buffer, start)
        self.verified.add(block)
        self.stats.blocks += 1

    def _check_values(self, name: str, buffer, start: int) -> None:
        """The embeddings of tensor `name` in `buffer` (its rows from `start` on) finite and of unit length: what a
        teacher's L2-normalised output is; a row scaled, garbled or not a number is refused, naming its sample."""
        tensor = self.tensors[name]
        if not tensor.dtype.is_floating_point:  # the crop boxes
            return
        values = torch.frombuffer(buffer, dtype=tensor.dtype).view(-1, tensor.shape[-1])
        norms = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
        least, most = (float(v) for v in torch.aminmax(norms))  # NaN propagates, and compares False below
        if not (1 - NORM_TOLERANCE <= least and most <= 1 + NORM_TOLERANCE):  # (the common case: few ops a tensor)
            index = int(torch.nonzero(~((norms - 1).abs() <= NORM_TOLERANCE))[0])
            row = start + index // (len(values) // (len(buffer) // tensor.row_bytes))
            norm = float(norms[index])
            what = "a value that is not finite" if not torch.isfinite(values[index]).all() else f"norm {norm:.4g}"
            raise DataError(
                f"{self.path}: the embedding {name[:80]} of sample {self.keys[row][:80]} is not a unit-length "
                f"teacher embedding ({what}; within {NORM_TOLERANCE} of 1 expected): {AGAIN}"
            )

    def _read(self, name: str, start: int, stop: int) -> bytearray:
        tensor = self.tensors[name]
        buffer = bytearray((stop - start) * tensor.row_bytes)
        got = os.preadv(self.fd, [buffer], tensor.start + start * tensor.row_bytes)
        self.stats.bytes += got
        if got != len(buffer):
            raise DataError(f"{self.path}: shorter than its header says (cut short while read?): {AGAIN}")
        return buffer

    def _tensor(self, name: str, buffer: bytearray, rows: int) -> torch.Tensor:
        tensor = self.tensors[name]
        if not buffer:  # no rows (an empty shard's sidecar): frombuffer refuses an empty buffer
            return torch.empty(0, *tensor.shape[1:], dtype=tensor.dtype)
        return torch.frombuffer(buffer, dtype=tensor.dtype).view(rows, *tensor.shape[1:])


def open_sidecar(path: Path, stats: ReadStats | None = None) -> SidecarFile:
    """PATH open for reading rows, its header checked (module docstring); a DataError naming it when it cannot be
    read, is cut short, its header is not of the format's types and layout (a tensor per teacher and caption key,
    one row per sample key, each key once, one width per teacher), or (format 3) its header does not match its
    checksum."""
    stats = stats if stats is not None else ReadStats()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        raise DataError(f"{path}: cannot be opened: {error}") from error
    try:
        stats.opens += 1
        return _parsed(Path(path), fd, stats)
    except BaseException:
        os.close(fd)
        raise


def _parsed(path: Path, fd: int, stats: ReadStats) -> SidecarFile:
    info = os.fstat(fd)
    head = os.pread(fd, 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(MAX_HEADER, info.st_size - 8):
        raise DataError(f"{path}: not a teacher embeddings file, or cut short (holds {info.st_size} bytes): {AGAIN}")
    raw = os.pread(fd, length, 8)
    stats.bytes += 8 + len(raw)
    header, meta, keys = _header(path, raw)
    if meta.get("format") == FORMAT and header_digest(header) != meta.get("sha256"):
        raise DataError(f"{path}: its header does not match its checksum (altered or torn): {AGAIN}")
    tensors = _tensors(header, 8 + length, info.st_size)
    problem = _keys_problem(meta, keys) or (tensors if isinstance(tensors, str) else _rows_problem(meta, tensors, keys))
    if problem:
        raise DataError(f"{path}: {problem}: {AGAIN}")
    block, digests = len(keys), None
    if meta.get("format") == FORMAT:
        block, digests = _blocks(path, meta, len(keys))
    meta = {k: v for k, v in meta.items() if k not in ("keys", "block_xxh3")}
    rows = {k: i for i, k in enumerate(keys)}
    return SidecarFile(path, fd, meta, rows, tensors, max(1, block), digests, stats, _identity(info), keys)


def _header(path: Path, raw: bytes) -> tuple[dict, dict, object]:
    """(the header, its metadata, the sample keys as parsed) once the header is a JSON object whose metadata holds the
    sample keys as JSON."""
    try:
        header = json.loads(raw, object_pairs_hook=_unique_pairs)
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        keys = json.loads(meta["keys"]) if isinstance(meta, dict) and isinstance(meta.get("keys"), str) else None
    except ValueError as error:  # not UTF-8, not JSON, or a name twice in one object
        raise DataError(f"{path}: not a readable teacher embeddings file: {str(error)[:200]}: {AGAIN}") from None
    if keys is None:
        raise DataError(f"{path}: not a teacher embeddings file (no metadata with the sample keys): {AGAIN}")
    return header, meta, keys


def _keys_problem(meta: dict, keys) -> str | None:
    """Why the metadata's settings do not read (`settings_problem`), or the keys do not name each row once."""
    problem = settings_problem(meta)
    if problem is None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        problem = "its sample keys are not a list of names"
    if problem is None and len(set(keys)) != len(keys):
        twice = next(k for k, n in Counter(keys).items() if n > 1)
        problem = f"its sample keys name {twice[:80]!r} twice"
    return problem


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"a name twice in one JSON object ({next(n for n in names if names.count(n) > 1)[:80]!r})")
    return dict(pairs)


def _rows_problem(meta: dict, tensors: dict[str, _Tensor], keys: list[str]) -> str | None:
    """Why the tensors do not hold one row per sample key in the format's layout (`layout_problem`)."""
    if any(t.shape[0] != len(keys) for t in tensors.values()):
        rows = sorted({t.shape[0] for t in tensors.values()})
        return f"its tensors hold {rows[0]} rows for its {len(keys)} sample keys (one row per sample key)"
    return layout_problem(meta, {name: (t.code, t.shape) for name, t in tensors.items()})


def _blocks(path: Path, meta: dict, rows: int) -> tuple[int, list[str]]:
    """(rows per block, the block checksums) of a format-3 header (its own checksum matched)."""
    try:
        block, digests = int(meta["block_rows"]), json.loads(meta["block_xxh3"])
    except (KeyError, ValueError):
        block, digests = 0, None
    if block < 1 or not isinstance(digests, list) or len(digests) != -(-rows // block):
        raise DataError(f"{path}: its block checksums do not cover its {rows} rows: {AGAIN}")
    return block, digests


def _tensors(header: dict, data_start: int, size: int) -> dict[str, _Tensor] | str:
    """The tensor table, or why it does not describe a whole file of `size` bytes: every tensor of rows of a known
    dtype, the tensors' bytes one after another from the data's start to the file's end."""
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensor = _tensor_entry(entry)
        if tensor is None:
            return f"its tensor {name[:80]} is not described as rows of a known dtype"
        (first, last), tensors[name] = tensor
        spans.append((first, last))
    if not tensors:
        return "it holds no tensor"
    spans.sort()
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or spans[0][0] != 0:
        return "its tensors' bytes overlap or leave gaps"
    if data_start + spans[-1][1] != size:
        return f"holds {size} bytes where its header describes {data_start + spans[-1][1]} (cut short or extended)"
    for tensor in tensors.values():
        tensor.start += data_start
    return tensors


def _tensor_entry(entry) -> tuple[tuple[int, int], _Tensor] | None:
    """((first, last) byte offsets, the tensor) of one entry of the tensor table, or None when it is malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
        return None
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (_naturals(shape) and shape and _naturals(offsets) and len(offsets) == 2):
        return None
    dtype, (first, last) = DTYPES[entry["dtype"]], offsets
    if last - first != prod(shape) * dtype.itemsize:
        return None  # (an empty shard's sidecar has tensors of no rows: 0 bytes each)
    return (first, last), _Tensor(dtype, tuple(shape), first, prod(shape[1:]) * dtype.itemsize, entry["dtype"])


def _naturals(value) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _identity(info: os.stat_result) -> tuple:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
