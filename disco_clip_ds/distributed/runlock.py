"""One writer per run folder: rank 0 holds an exclusive lock on OUTPUT_DIR/run.lock for as long as it trains.

A POSIX record lock (lockf), not a pid file: the kernel releases it when its holder dies, however it dies. Not
flock either: a flock is shared with every child forked while it is held, so a DataLoader worker that outlives a
killed rank 0 by its few seconds would hold the run's lock against the rank that torchrun restarts at once. Taking
the lock also removes what an interrupted save left in the staging folder (named by the caller: checkpoint.layout's
STAGING, a room above this one), which no other run can be writing then.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import UsageError

logger = logging.getLogger("disco_clip_ds.distributed.runlock")

LOCK_FILE = "run.lock"
_lock_fd: int | None = None


def acquire_run_lock(output_dir: str | os.PathLike, staging: str | None = None) -> None:
    """Rank 0 holds the lock until `release_run_lock` or the end of the process. A second run is refused (UsageError
    on every rank, before it writes anything); a lock left by a dead run is taken over with a warning. `staging`:
    the folder under output_dir where saves are written before they are published, emptied once the lock is held
    (None: nothing to empty)."""
    decided_on_rank0(lambda: _take_lock(Path(output_dir), staging))


def _take_lock(output_dir: Path, staging: str | None) -> None:
    global _lock_fd
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output_dir {output_dir} is a file: give a folder")
    output_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    holder = os.read(fd, 4096).decode(errors="replace").strip()
    try:
        # held by this process alone; closing any fd of the file would drop it (this one stays open)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        os.close(fd)
        raise UsageError(
            f"{output_dir} is in use by another run ({holder or 'holder unknown'}): wait for it to end, "
            "or choose another --output_dir"
        ) from None
    if holder:  # the previous holder died without releasing it (a clean exit empties the file)
        logger.warning("taking over the lock of a run that is no longer running (%s) in %s", holder, output_dir)
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0
    )
    _lock_fd = fd
    if staging:
        _clean_staging(output_dir / staging)


def release_run_lock() -> None:
    """Empty and unlock run.lock (a lock file with content means its holder died)."""
    global _lock_fd
    if _lock_fd is not None:
        os.ftruncate(_lock_fd, 0)
        os.close(_lock_fd)
        _lock_fd = None


def _clean_staging(staging: Path) -> None:
    if staging.exists() and any(staging.iterdir()):
        logger.warning("removing %s: partial checkpoints of an interrupted save", [p.name for p in staging.iterdir()])
    shutil.rmtree(staging, ignore_errors=True)
