"""A teacher's fingerprint: what a sidecar of `data embed` records of the teacher that made it, and what training
(`--teacher_embeddings`) and curation (`data filter --teacher`) compare it with.

- A folder: 16 hex digits of the sha256 of its config.json and weight files (*.safetensors, *.bin; each file's name,
  then its bytes, in name order). Reading every weight byte is paid once: the fingerprint is then kept in a small
  JSON file in the user's cache (`cache_folder`), keyed by the folder's path and each of those files' name, size,
  mtime_ns, ctime_ns, inode and device (git's index keys its files so), and taken from there, with no weight byte
  read, while none of them changed. Writing a file changes its ctime, which no program can set back, so a file
  changed in place is hashed again. `verify=True` hashes the files whatever the cache holds (and stores the result).
- A hub id: 16 hex digits of the sha256 of "hub:ID@COMMIT", COMMIT the commit its main revision resolves to, as
  `huggingface_hub` resolves it for the config.json transformers loads (online: the hub's answer; offline: the
  cache's refs/main). No weight file is fetched. A hub id and a folder holding the same weights have two
  fingerprints: embed and train with the same --teacher.

Each fingerprint made by reading the weights is logged with the bytes read (`disco_clip_ds.data.teacher_id`, INFO).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from disco_clip_ds.data.shards import write_json
from disco_clip_ds.errors import UsageError

logger = logging.getLogger("disco_clip_ds.data.teacher_id")

WEIGHT_SUFFIXES = (".safetensors", ".bin")
CACHE_ENV = "DISCO_CLIP_CACHE"  # the cache's folder; default $XDG_CACHE_HOME/disco-clip, else ~/.cache/disco-clip
BLOCK = 1 << 24
_COMMIT = re.compile(r"[0-9a-f]{40}")


def teacher_fingerprint(name_or_path: str, verify: bool = False) -> str:
    """The fingerprint of a teacher folder (read once, then cached; `verify`: read again) or of a hub id (from its
    resolved commit, no weights fetched). A UsageError in one line for a folder without config.json, or a name that is
    neither a folder nor a model on the hub (or, offline, in its cache)."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return folder_fingerprint(folder, verify)
    return hub_fingerprint(name_or_path)


def teacher_files(folder: Path) -> list[Path]:
    """The files a folder's fingerprint covers: config.json and the weight files, in name order."""
    return sorted(
        p for p in folder.iterdir() if (p.name == "config.json" or p.suffix in WEIGHT_SUFFIXES) and p.is_file()
    )


def folder_fingerprint(folder: Path, verify: bool = False) -> str:
    """sha256 of the folder's config.json and weight files (`teacher_files`), 16 hex digits: from the cache while
    none of the files changed, else (or with `verify`) read and hashed, then cached."""
    files = teacher_files(folder)
    if not any(p.name == "config.json" for p in files):
        raise UsageError(f"{folder}: no config.json: not a model folder")
    key, entry = _stat_key(files), cache_entry(folder)
    cached = None if verify else _cached(entry, folder, key)
    if cached is not None:
        logger.info("teacher %s: fingerprint %s from %s (its files unchanged): no weights read", folder, cached, entry)
        return cached
    fingerprint, read = _hash_files(files)
    logger.info("teacher %s: fingerprint %s, %d bytes of weights read to make it", folder, fingerprint, read)
    if _stat_key(files) == key:  # not changed while read: the fingerprint is of these very files
        _store(entry, folder, key, fingerprint)
    return fingerprint


def hub_fingerprint(repo_id: str) -> str:
    """sha256 of "hub:ID@COMMIT", 16 hex digits, COMMIT the one ID's main revision resolves to for its config.json
    (fetched, or found in the cache offline: the one file transformers reads to check the teacher); no weight file is
    fetched."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        config = Path(hf_hub_download(repo_id, "config.json"))
    except (OSError, ValueError, EntryNotFoundError) as error:  # the hub's messages run over several lines
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(
            f"--teacher {repo_id}: no such folder, nor a model on the hub (or, offline, in its cache): {first}"
        ) from error
    commit = config.parent.name  # huggingface_hub's cache layout: models--ORG--NAME/snapshots/COMMIT/config.json
    if not _COMMIT.fullmatch(commit):
        raise UsageError(f"--teacher {repo_id}: its config.json is not in a snapshot of the hub's cache ({config})")
    return hashlib.sha256(f"hub:{repo_id}@{commit}".encode()).hexdigest()[:16]


def cache_folder() -> Path:
    """Where fingerprints are cached: $DISCO_CLIP_CACHE, else $XDG_CACHE_HOME/disco-clip, else ~/.cache/disco-clip.
    Never the teacher's folder, which may be read-only."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disco-clip"


def cache_entry(folder: Path) -> Path:
    """The cache file of one teacher folder (one file per folder: two runs caching two teachers never write one
    file)."""
    name = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return cache_folder() / "teacher_fingerprints" / f"{name}.json"


def _stat_key(files: list[Path]) -> list:
    key = []
    for path in files:
        st = path.stat()
        key.append([path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    return key


def _cached(entry: Path, folder: Path, key: list) -> str | None:
    """The fingerprint the cache holds for `folder` with files of stat `key`; None when it holds none (an unreadable
    or foreign entry is no entry: the files are hashed again)."""
    try:
        held = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(held, dict) or held.get("folder") != str(folder.resolve()) or held.get("files") != key:
        return None
    fingerprint = held.get("fingerprint")
    return fingerprint if isinstance(fingerprint, str) and re.fullmatch(r"[0-9a-f]{16}", fingerprint) else None


def _store(entry: Path, folder: Path, key: list, fingerprint: str) -> None:
    try:
        write_json(entry, {"folder": str(folder.resolve()), "files": key, "fingerprint": fingerprint})
    except OSError as error:  # a cache that cannot be written costs the next run a read, nothing else
        logger.info("teacher fingerprint not cached (%s)", error)


def _hash_files(files: list[Path]) -> tuple[str, int]:
    """(the fingerprint of `files`, the bytes of weights read)."""
    digest, read = hashlib.sha256(), 0
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                digest.update(block)
                read += len(block) if path.name != "config.json" else 0
    return digest.hexdigest()[:16], read
