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
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from disco_clip_ds.data.reinforced import FORMAT, block_digest, header_digest
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
        self._check(block, [buffers[name] for name in sorted(self.tensors)], start, stop)
        return {name: self._tensor(name, buffers[name], stop - start) for name in names}

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor whole, each block verified (as `read_block`; a format-3 file: the caller verifies an older
        one whole)."""
        n, names = len(self.rows), sorted(self.tensors)
        buffers = {name: self._read(name, 0, n) for name in names}
        for block, start in enumerate(range(0, n, self.block_rows)):
            stop = min(n, start + self.block_rows)
            self._check(block, [self._rows_of(name, buffers[name], start, stop) for name in names], start, stop)
        return {name: self._tensor(name, buffers[name], n) for name in names}

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

    def _check(self, block: int, buffers: list, start: int, stop: int) -> None:
        if self.digests is not None and block_digest(buffers) != self.digests[block]:
            raise DataError(
                f"{self.path}: its checksum does not match its contents (rows {start} to {stop - 1}, torn or "
                f"altered): {AGAIN}"
            )
        self.verified.add(block)
        self.stats.blocks += 1

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
        return torch.frombuffer(buffer, dtype=tensor.dtype).view(rows, *tensor.shape[1:])


def open_sidecar(path: Path, stats: ReadStats | None = None) -> SidecarFile:
    """PATH open for reading rows, its header checked (module docstring); a DataError naming it when it cannot be
    read, is cut short, or (format 3) its header does not match its checksum."""
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
    try:
        header = json.loads(raw)
        meta = dict(header.get("__metadata__") or {})
        tensors = _tensors(header, 8 + length, info.st_size)
        keys = json.loads(meta.pop("keys"))
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error!r}: {AGAIN}") from error
    if isinstance(tensors, str):
        raise DataError(f"{path}: {tensors}: {AGAIN}")
    if any(t.shape[0] != len(keys) for t in tensors.values()):
        raise DataError(f"{path}: its tensors' rows are not one per sample key: {AGAIN}")
    rows, digests = {k: i for i, k in enumerate(keys)}, None
    block = len(keys)
    if meta.get("format") == FORMAT:
        if header_digest(header) != meta.get("sha256"):
            raise DataError(f"{path}: its header does not match its checksum (altered or torn): {AGAIN}")
        block, digests = int(meta["block_rows"]), json.loads(meta.pop("block_xxh3"))
        if block < 1 or len(digests) != -(-len(keys) // block):
            raise DataError(f"{path}: its block checksums do not cover its {len(keys)} rows: {AGAIN}")
    return SidecarFile(path, fd, meta, rows, tensors, max(1, block), digests, stats, _identity(info))


def _tensors(header: dict, data_start: int, size: int) -> dict[str, _Tensor] | str:
    """The tensor table, or why it does not describe a whole file of `size` bytes."""
    tensors, end = {}, data_start
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        first, last = (int(v) for v in entry["data_offsets"])
        if dtype is None or not shape or shape[0] < 1:
            return f"its tensor {name} is not of rows of a known dtype ({entry['dtype']}, shape {list(shape)})"
        if last - first != prod(shape) * dtype.itemsize:
            return f"its tensor {name}'s bytes do not fit its shape"
        tensors[name] = _Tensor(dtype, shape, data_start + first, (last - first) // shape[0])
        end = max(end, data_start + last)
    if end != size:
        return f"holds {size} bytes where its header describes {end} (cut short or extended)"
    return tensors


def _identity(info: os.stat_result) -> tuple:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
