"""Disk space: a run refused at start on a full disk, and one line for a save that runs out of space on any rank."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from disco_clip_ds import faults
from disco_clip_ds.checkpoint.layout import newest_complete
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import CheckpointError


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def free_bytes(output_dir: Path, step: int) -> int:
    forced = faults.forced_free_bytes(step)
    return forced if forced is not None else shutil.disk_usage(output_dir).free


START_BYTES = 2**20  # run.lock, run.json, the logs: with less free, a run cannot even start


def check_space_at_start(output_dir: str | os.PathLike) -> None:
    """Refuse (CheckpointError, on every rank, decided on rank 0) to start a run in a folder whose disk is full."""

    def check() -> None:
        folder = Path(output_dir).absolute()
        while not folder.exists():
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        if free < START_BYTES:
            raise CheckpointError(
                f"no space left in {output_dir} ({_size(free)} free, a run needs at least {_size(START_BYTES)} to "
                "start and room for its checkpoints): free space or choose another --output_dir"
            )

    decided_on_rank0(check)


def disk_full_message(output_dir: Path, needed: int | None, what: str, free: int | None = None) -> str:
    """One line: where space ran out (free and needed), what is still intact, and how to go on. `free`: what a
    free-space check saw (default: what is free now)."""
    last = newest_complete(output_dir, checksums=False, warn=False)
    need = f"needs ~{_size(needed)}, " if needed else ""
    free = shutil.disk_usage(output_dir).free if free is None else free
    return (
        f"no space left in {output_dir} ({need}{_size(free)} free) while saving {what}; "
        f"{'the last complete checkpoint ' + last.name + ' is intact' if last else 'no checkpoint was saved'}: "
        "free space, then resume with --resume_from_checkpoint latest"
    )


def is_disk_full(error: BaseException | None) -> bool:
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    # the writers that lose the errno: torch.save's C++ writer ("basic_ios::clear: iostream error", "file write
    # failed", "unexpected pos"), safetensors ("I/O error: No space left on device (os error 28)")
    text = str(error)
    return error is not None and any(
        s in text for s in ("iostream error", "write failed", "No space left", "unexpected pos", "os error 28")
    )
