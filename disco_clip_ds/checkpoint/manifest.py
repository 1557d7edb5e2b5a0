"""manifest.json: the size and xxh3-128 checksum of every file of a checkpoint or final model, written last, so
that a folder cut short or damaged later shows against it."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from disco_clip_ds.atomic import write_text

MANIFEST = "manifest.json"


def _checksum(path: Path) -> str:
    # xxh3-128 (xxhash, a dependency of datasets): it catches truncation, bit rot and partial copies as surely as a
    # cryptographic hash (nobody forges checkpoints here) at memory speed, several GB/s per core, where sha256 or
    # blake2b manage a few hundred MB/s: checksumming a multi-GB checkpoint costs about what reading it costs.
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_checksums(folder: Path, names: list[str]) -> list[str]:
    # one thread per file: the hash releases the GIL, and a ZeRO checkpoint has one large shard per rank
    with ThreadPoolExecutor(max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda name: _checksum(folder / name), names))


def write_manifest(folder: str | os.PathLike, names: list[str] | None = None) -> None:
    """Record the size and checksum of every file under `folder` (or of `names`, paths relative to it) in
    folder/manifest.json, written atomically."""
    folder = Path(folder)
    if names is None:
        names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    sizes = [(folder / name).stat().st_size for name in names]
    files = {
        name: {"size": size, "xxh3_128": digest}
        for name, size, digest in zip(names, sizes, file_checksums(folder, names), strict=True)
    }
    write_text(folder / MANIFEST, json.dumps({"files": files}, indent=1), durable=True)  # the mark of a whole folder


def manifest_problem(folder: str | os.PathLike, checksums: bool = True) -> str | None:
    """What in `folder` does not match its manifest.json (None: every file it lists is there with its size and, with
    `checksums`, its checksum). Call only where a manifest exists.

    Sizes are always compared (one stat per file). Checksums are compared by default: a flipped or zeroed block
    keeps the size, and resuming from it fails deep inside DeepSpeed or trains on damaged weights; at xxh3 speed the
    cost is about that of the reads the resume does anyway (the files are then in the page cache)."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    try:
        return _files_problem(folder, files, checksums)
    except FileNotFoundError as error:  # deleted while being checked: the Trainer's rotation removes old checkpoints
        return f"{Path(error.filename).name} vanished while it was checked"


def _files_problem(folder: Path, files: dict, checksums: bool) -> str | None:
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing (the manifest lists it)"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} is {size} bytes, the manifest says {entry['size']}"
    if checksums:
        names = list(files)
        for name, digest in zip(names, file_checksums(folder, names), strict=True):
            if digest != files[name]["xxh3_128"]:
                return f"{name} does not match its checksum in the manifest"
    return None
