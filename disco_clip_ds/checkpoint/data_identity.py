"""What identifies the data a run reads, for a resume to compare: the list of shards, and the sizes and modification
times of the local data files (checkpoint/resume.py compares them; docs/faults.md says what is compared)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def shards_digest(urls: list[str]) -> str:
    """A short fingerprint of the shard list: a long list is not stored, and respelling it (a folder for its
    tars, a brace range for a list) keeps it."""
    return hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]


def data_stat_digest(urls: list[str], data_args=None) -> str | None:
    """A short fingerprint of the sizes and modification times of the run's local data files: its local shards, or
    the files of a local `datasets` source (`data_args.train_file` / `dataset_name`); None when none is local. Data
    rewritten under its names (a shard's samples reordered, a dataset shrunk) changes it, and a billion samples in
    100,000 shards cost 100,000 stat calls, not a read. Remote shards (URLs, `pipe:`) and hub datasets are not
    compared."""
    from disco_clip_ds.data.shards import is_url

    files = [url for url in urls if not is_url(url) and os.path.isfile(url)]
    source = None if urls or data_args is None else (data_args.train_file or data_args.dataset_name)
    if source and os.path.exists(source):
        files = [str(p) for p in sorted(Path(source).rglob("*")) if p.is_file()] if os.path.isdir(source) else [source]
    digest = hashlib.sha256()
    for path in files:
        stat = os.stat(path)
        digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16] if files else None
