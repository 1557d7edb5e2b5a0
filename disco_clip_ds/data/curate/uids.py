"""DataComp's subset files, read (`--keep_uids`) and written (OUTPUT/kept_uids.npy): a .npy of a structured array of
dtype `np.dtype("u8,u8")`, one (upper 64 bits, lower 64 bits) pair per sample's 128-bit uid, sorted, as DataComp's
baselines save it (`np.array([(int(uid[:16], 16), int(uid[16:32], 16)) ...], np.dtype("u8,u8"))`, `np.sort`,
`np.save`) and its resharder loads it. A sample's uid is the 32 hexadecimal digits under key `uid` of its `.json`
member, as DataComp's shards carry it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from disco_clip_ds.atomic import write_bytes
from disco_clip_ds.errors import DataError, UsageError

UID_DTYPE = np.dtype("u8,u8")
KEPT_UIDS = "kept_uids.npy"  # beside filter.parquet


def uid_of(meta: bytes | None) -> tuple[int, int] | None:
    """A sample's uid as DataComp's pair of integers, from its `.json` bytes; None without a 32-hex-digit `uid`."""
    if not meta:
        return None
    try:
        parsed = json.loads(meta)
    except ValueError:
        return None
    return uid_in(parsed) if isinstance(parsed, dict) else None


def uid_in(meta: dict) -> tuple[int, int] | None:
    """The uid pair of a parsed `.json` (`uid_of`)."""
    uid = meta.get("uid")
    if not isinstance(uid, str) or len(uid) != 32:
        return None
    try:
        return int(uid[:16], 16), int(uid[16:], 16)
    except ValueError:
        return None


def uid_arrays(pairs: list[tuple[int, int] | None]) -> dict[str, np.ndarray]:
    """A scan's uid arrays: `uid` (n,) of UID_DTYPE (zeros where none) and `has_uid` (n,) bool."""
    uids = np.zeros(len(pairs), UID_DTYPE)
    has = np.array([p is not None for p in pairs], bool)
    if has.any():
        uids[has] = np.array([p for p in pairs if p is not None], UID_DTYPE)
    return {"uid": uids, "has_uid": has}


def check_uid_file(path: str) -> None:
    """A UsageError in one line unless `path` is a .npy of one dimension of UID_DTYPE; reads its header alone."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = header(f)
    except FileNotFoundError:
        raise UsageError(f"--keep_uids {path}: no such file") from None
    except (ValueError, OSError) as error:
        raise UsageError(f"--keep_uids {path}: not a .npy file numpy reads ({error})") from None
    if dtype != UID_DTYPE or len(shape) != 1:
        raise UsageError(
            f"--keep_uids {path}: holds an array of dtype {dtype} and shape {shape}, not DataComp's uid list (one "
            "dimension of np.dtype('u8,u8'): the upper and lower 64 bits of each 128-bit uid): save it as DataComp's "
            "baselines do"
        )


def read_uid_file(path: str) -> np.ndarray:
    """The uids of a DataComp subset file (checked by `check_uid_file`), sorted: mapped as they are when already
    sorted (DataComp saves them sorted), else sorted in memory."""
    check_uid_file(path)
    uids = np.load(path, mmap_mode="r", allow_pickle=False)
    high, low = uids["f0"], uids["f1"]
    rising = (high[1:] > high[:-1]) | ((high[1:] == high[:-1]) & (low[1:] >= low[:-1]))
    return uids if rising.all() else np.sort(uids)


def kept_by_file(path: str, urls: list[str], scans: list) -> np.ndarray:
    """Mask of the samples, every shard's in order, whose uid is in the subset file `path`; a DataError naming the
    first shard with a sample without a uid."""
    wanted, masks = read_uid_file(path), []
    for url, scan in zip(urls, scans):
        with np.load(scan) as saved:
            check_uids(url, saved["has_uid"])
            masks.append(kept_by_list(saved["uid"], saved["has_uid"], wanted))
    return np.concatenate(masks) if masks else np.zeros(0, bool)


def write_kept(path: Path, scans: list, kept: np.ndarray) -> None:
    """Write the kept samples' uids to `path` when every sample of the input carries one (else no file: a subset
    file names every sample it keeps)."""
    chosen, start = [], 0
    for scan in scans:
        with np.load(scan) as saved:
            has, uids = saved["has_uid"], saved["uid"]
        if not has.all():
            return
        chosen.append(uids[kept[start : start + len(has)]])
        start += len(has)
    if start:
        write_uid_file(path, np.concatenate(chosen))


def kept_by_list(uids: np.ndarray, has_uid: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Mask of the samples whose uid is in `wanted` (sorted UID_DTYPE); a sample without a uid is not."""
    found = np.zeros(len(uids), bool)
    if len(wanted):
        at = np.minimum(np.searchsorted(wanted, uids), len(wanted) - 1)  # structured arrays compare field by field
        found = wanted[at] == uids
    return found & has_uid


def check_uids(shard: str, has_uid: np.ndarray) -> None:
    """--keep_uids needs every sample's uid: a DataError naming the shard whose samples lack one."""
    if not has_uid.all():
        raise DataError(
            f"--keep_uids: shard {shard} has {int((~has_uid).sum())} of {len(has_uid)} samples without a uid (key "
            "'uid', 32 hexadecimal digits, in the sample's .json, as DataComp's shards carry it): select its samples "
            "by another rule"
        )


def write_uid_file(path: Path, uids: np.ndarray) -> None:
    """Save `uids` (UID_DTYPE) sorted, as DataComp's `save_uids` does, atomically."""
    buffer = io.BytesIO()
    np.save(buffer, np.sort(np.asarray(uids, UID_DTYPE)))
    write_bytes(path, buffer.getvalue())
