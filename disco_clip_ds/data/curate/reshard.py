"""New shards from the kept samples, as DataComp's resharder writes them: members copied byte for byte (no decoding,
no re-encoding), in input order, `--samples_per_shard` a shard, each with its teacher sidecar (data/embeddings.py's
writer, its rows copied from the input sidecars) so that training can distil from the output without embedding again.

A shard is written to a temporary file of its own and renamed (atomic.py), then its sidecar, which records the
shard's size and sha256: the sidecar is the shard's completion mark, so a run killed anywhere leaves each output shard
complete (both files, matching) or to be written again. Tar headers carry no time, owner or mode of this machine
(mtime 0, uid/gid 0, no names, 0644), so that the same kept samples give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from disco_clip_ds import faults
from disco_clip_ds.atomic import staged
from disco_clip_ds.data.embeddings import read_metadata, read_reinforced, shard_facts, sidecar_path, write_reinforced
from disco_clip_ds.data.reinforced import joined_rows
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.tarcopy import Members, SharedBytes, TarWriter, sample_members
from disco_clip_ds.errors import DataError

# --samples_per_shard's default: img2dataset's and DataComp's shard size, cut smaller where the kept samples would
# otherwise make fewer shards than the readers of a training run on one 8-GPU node (8 ranks x training's default 2
# DataLoader workers): training needs a shard per reader (data/shards.shards_for_reader)
MAX_PER_SHARD = 10_000
MIN_SHARDS = 16


def shard_size(kept: int, given: int | None) -> int:
    """The samples per output shard: `given` (--samples_per_shard), else the most that still cut the `kept` samples
    into MIN_SHARDS shards or more (one a shard below MIN_SHARDS), at most MAX_PER_SHARD."""
    if given is not None:
        return given
    return max(1, min(MAX_PER_SHARD, kept // MIN_SHARDS))


def output_name(index: int) -> str:
    """The file name of output shard `index`: NNNNN.tar, as img2dataset and `data verify` name shards."""
    return f"{index:05d}.tar"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(path: Path, keys: list[str], fingerprint: str) -> bool:
    """Whether output shard `path` and its sidecar are both there, the sidecar this teacher's, holding `keys` in order
    and recording the shard's present size and sha256 (a shard renamed into place whose sidecar was not yet written,
    or a torn one, is not complete)."""
    sidecar = sidecar_path(path.parent, str(path))
    if not path.is_file() or not sidecar.is_file():
        return False
    try:
        meta = read_metadata(sidecar)
    except DataError:
        return False
    return (
        meta.get("teacher") == fingerprint
        and meta.get("shard_bytes") == str(path.stat().st_size)
        and json.loads(meta.get("keys", "null")) == keys
        and meta.get("shard_sha256") == file_sha256(path)
    )


def write_output_shard(path: Path, pieces: list[tuple]) -> int:
    """Write output shard `path` from `pieces`: (input shard, its sidecar, the sorted in-shard indices of its kept
    samples[, where its samples lie (`Members`), when the scan kept that]), in order; then its sidecar beside it
    (every teacher, augmentation and caption of the input sidecars' rows; a DataError when the inputs were embedded
    with other settings). The kept keys are unique (the filter checks them before any shard is written,
    pipeline.py). Returns the number of samples written."""
    written, chosen = 0, []
    with staged(path) as tmp:
        tar = TarWriter(tmp)
        try:
            for url, sidecar, wanted, *members in pieces:
                stored = read_reinforced(sidecar)
                rows, picked = stored.rows(), []
                for key, data in _kept_samples(url, wanted, members[0] if members else None):
                    written += 1
                    picked.append(rows[key])
                    for ext, member in data:
                        tar.add(f"{key}.{ext}", member)
                chosen.append((stored, picked))
        except BaseException:
            tar.abort()
            raise
        sha256 = tar.close()
        faults.in_output_write(int(path.stem))  # a test's kill here leaves the staged tar: a torn write
    try:
        joined = joined_rows(chosen, {**shard_facts(str(path)), "shard_sha256": sha256})
    except ValueError as error:
        raise DataError(f"output shard {path.name}: its input sidecars were {error}: embed them alike") from error
    write_reinforced(sidecar_path(path.parent, str(path)), joined)
    return written


def _kept_samples(url: str, wanted: list[int], members: Members | None):
    """(key, [(extension, bytes), ...]) of the samples of `url` at the in-shard indices `wanted` (sorted), their
    members in shard order: read where `members` (or the tar's headers, tarcopy.py) locate them, or by `raw_samples`
    from the first one on when the shard is not a plain one (a local shard passes the members before it by their
    headers alone)."""
    if not len(wanted):
        return
    members = sample_members(url) if members is None else members
    if members is None:
        yield from _read_samples(url, wanted)
        return
    source = SharedBytes(url)
    try:
        for index in np.asarray(wanted).tolist():
            if index >= len(members):
                raise DataError(f"{url}: fewer samples than when it was scanned: run the filter again (it scans again)")
            data = [
                (ext, source.read(at, size)) for ext, at, size in members.members(index) if not ext.startswith("__")
            ]
            yield members.keys[index], data
    finally:
        source.close()


def _read_samples(url: str, wanted: list[int]):
    want, first, last = set(np.asarray(wanted).tolist()), int(wanted[0]), int(wanted[-1])
    for index, sample in enumerate(raw_samples(url, start=first), start=first):
        if index in want:
            yield sample["__key__"], [(ext, data) for ext, data in sample.items() if not ext.startswith("__")]
        if index >= last:
            return


def first_repeated_key(urls: list[str], kept_keys) -> tuple[str, str, str] | None:
    """The first kept key, in input order, that an earlier kept sample also has, with the input shards of the two
    (key, first's shard, its shard); None when every kept key is unique. `kept_keys(i)`: the kept keys of input shard
    i, in order (called twice per shard at most). An output shard's sidecar finds a sample's rows by its key, and two
    output shards with one key would hand training one sample twice, so the whole output must have unique keys,
    whatever the shard size. Held in memory: a 64-bit hash per kept sample (their collisions are then compared as
    keys)."""
    hashes = np.concatenate([np.zeros(0, np.uint64), *(key_hashes(kept_keys(i)) for i in range(len(urls)))])
    hashes.sort()
    suspects = np.unique(hashes[1:][hashes[1:] == hashes[:-1]])
    del hashes
    first: dict[str, str] = {}
    for i, url in enumerate(urls if len(suspects) else []):
        keys = kept_keys(i)
        for j in np.flatnonzero(np.isin(key_hashes(keys), suspects)).tolist():
            if keys[j] in first:
                return keys[j], first[keys[j]], url
            first[keys[j]] = url
    return None


_PRIME = np.uint64(0x100000001B3)  # FNV's 64-bit prime: an odd multiplier that mixes each byte into the high bits


def key_hashes(keys: list[str]) -> np.ndarray:
    """A 64-bit hash of each key (uint64): the polynomial sum of its UTF-8 bytes times powers of _PRIME, modulo 2**64,
    vectorised over the keys (equal keys, equal hashes; unequal ones may collide, so equal hashes are only suspects)."""
    if not keys:
        return np.zeros(0, np.uint64)
    fixed = np.array([key.encode() for key in keys])  # zero-padded to the longest: a zero byte adds nothing
    codes = fixed.view(np.uint8).reshape(len(keys), fixed.dtype.itemsize).astype(np.uint64)
    powers = np.cumprod(np.full(fixed.dtype.itemsize, _PRIME, np.uint64))  # wraps modulo 2**64, as wanted
    return (codes * powers).sum(axis=1, dtype=np.uint64)


def plan_shards(kept: np.ndarray, offsets: np.ndarray, per_shard: int) -> list[list[tuple[int, np.ndarray]]]:
    """The output shards of the kept global rows `kept` (sorted): for each, its pieces (input shard index, in-shard
    indices as an int32 array: 4 bytes a kept sample, where lists of Python ints would take nine times that),
    `per_shard` samples a shard, the last one shorter. `offsets[i]` is input shard i's first global row."""
    shards = []
    for start in range(0, len(kept), per_shard):
        rows = kept[start : start + per_shard]
        owners = np.searchsorted(offsets, rows, side="right") - 1
        pieces = []
        for shard in np.unique(owners):
            pieces.append((int(shard), (rows[owners == shard] - offsets[shard]).astype(np.int32)))
        shards.append(pieces)
    return shards
