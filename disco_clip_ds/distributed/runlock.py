"""One writer per run folder: rank 0 holds an exclusive lock on OUTPUT_DIR/run.lock for as long as it trains.

A POSIX record lock (lockf), not a pid file: the kernel releases it when its holder dies, however it dies. Not
flock either: a flock is shared with every child forked while it is held, so a DataLoader worker that outlives a
killed rank 0 by its few seconds would hold the run's lock against the rank that torchrun restarts at once. Taking
the lock also removes what an interrupted save left in the staging folder (named by the caller: checkpoint.layout's
STAGING, a room above this one), which no other run can be writing then.

A stop signal during start-up ends rank 0 with `os._exit` (`startup.py`), past every `finally`: while the lock is held,
start-up's watch releases it first, and removes run.lock when this run created it, since nothing was written there.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from disco_clip_ds.distributed import startup
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import UsageError

logger = logging.getLogger("disco_clip_ds.distributed.runlock")

LOCK_FILE = "run.lock"
_lock_fd: int | None = None
_created: Path | None = None  # run.lock, when this run created it
_releasing = threading.Lock()  # the main thread's release and start-up's watch (its own thread) may race


def acquire_run_lock(output_dir: str | os.PathLike, staging: str | None = None) -> None:
    """Rank 0 holds the lock until `release_run_lock` or the end of the process. A second run is refused (UsageError
    on every rank, before it writes anything); a lock left by a dead run is taken over with a warning. `staging`:
    the folder under output_dir where saves are written before they are published, emptied once the lock is held
    (None: nothing to empty)."""
    decided_on_rank0(lambda: _take_lock(Path(output_dir), staging))


def _take_lock(output_dir: Path, staging: str | None) -> None:
    global _lock_fd, _created
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output_dir {output_dir} is a file: give a folder")
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    fd, created, holder = _locked(path)
    while not _still_named(fd, path):  # a start-up stop removed the file we locked (see above): lock the new one
        os.close(fd)
        fd, created, holder = _locked(path)
    _lock_fd, _created = fd, path if created else None
    startup.clean_up_on_stop(_abandon_run_lock)
    if holder:  # the previous holder died without releasing it (a clean exit empties the file)
        logger.warning("taking over the lock of a run that is no longer running (%s) in %s", holder, output_dir)
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0
    )
    if staging:
        _clean_staging(output_dir / staging)


def _locked(path: Path) -> tuple[int, bool, str]:
    """(fd, whether this call created the file, the holder it names) of `path`, locked; UsageError if held."""
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False
    holder = os.read(fd, 4096).decode(errors="replace").strip()
    try:
        # held by this process alone; closing any fd of the file would drop it (this one stays open)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise UsageError(
            f"{path.parent} is in use by another run ({holder or 'holder unknown'}): wait for it to end, "
            "or choose another --output_dir"
        ) from None
    return fd, created, holder


def _still_named(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def release_run_lock() -> None:
    """Empty and unlock run.lock (a lock file with content means its holder died)."""
    global _lock_fd
    startup.forget_cleanup(_abandon_run_lock)
    with _releasing:
        if _lock_fd is not None:
            os.ftruncate(_lock_fd, 0)
            os.close(_lock_fd)
            _lock_fd = None


def _abandon_run_lock() -> None:
    """A stop during start-up, run lock held: nothing was written, so the folder is left as the run found it: the
    lock file removed when this run created it (removed before the lock is dropped: a run that locks the removed
    file meanwhile sees it is gone, above), else emptied."""
    if _created is not None and _lock_fd is not None:
        _created.unlink(missing_ok=True)
    release_run_lock()


def _clean_staging(staging: Path) -> None:
    if staging.exists() and any(staging.iterdir()):
        logger.warning("removing %s: partial checkpoints of an interrupted save", [p.name for p in staging.iterdir()])
    shutil.rmtree(staging, ignore_errors=True)
