"""One writer per folder: rank 0 holds an exclusive lock on OUTPUT_DIR/run.lock for as long as it trains, and each
verb that writes a folder (`data filter`, `data embed`, `eval --output`, `export`) holds one on it while it writes
(`writer_lock`). A second writer is refused in one line naming the holder (host, pid); a lock left by a killed holder
is taken over with a warning.

A POSIX record lock (lockf), not a pid file: the kernel releases it when its holder dies, however it dies. Not
flock either: a flock is shared with every child forked while it is held, so a DataLoader worker that outlives a
killed rank 0 by its few seconds would hold the run's lock against the rank that torchrun restarts at once. Taking
the lock also removes what an interrupted save left in the staging folder (named by the caller: checkpoint.layout's
STAGING, a room above this one), which no other run can be writing then.

A stop signal during start-up ends rank 0 with `os._exit` (`startup.py`), past every `finally`: while the lock is held,
start-up's watch releases it first, and removes run.lock when this run created it, since nothing was written there.

A verb's lock is FOLDER/.disco-clip.lock, or, for what appears whole by a rename (export's folder, eval's JSON file),
.NAME.lock beside it; it is removed when the verb ends, so that only a killed writer leaves one (its holder named in
it). While a verb holds a folder's lock no other writer is at work there, so it also removes the temporary files that
killed writers left in it (atomic.py's).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from disco_clip_ds import atomic
from disco_clip_ds.distributed import startup
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import DiscoClipError, UsageError

logger = logging.getLogger("disco_clip_ds.distributed.runlock")

LOCK_FILE = "run.lock"
WRITER_LOCK = ".disco-clip.lock"  # a verb's, in the folder it writes
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
    fd, created, holder = _taken(
        path,
        lambda holder: (
            f"{output_dir} is in use by another run ({holder}): wait for it to end, or choose another --output_dir"
        ),
    )
    _lock_fd, _created = fd, path if created else None
    startup.clean_up_on_stop(_abandon_run_lock)
    if holder:  # the previous holder died without releasing it (a clean exit empties the file)
        logger.warning("taking over the lock of a run that is no longer running (%s) in %s", holder, output_dir)
    _sign(fd, "")
    if staging:
        _clean_staging(output_dir / staging)


def _taken(path: Path, refusal) -> tuple[int, bool, str]:
    """`_locked(path, refusal)`, on the file named `path` when the lock is held (not on one removed meanwhile: a
    start-up stop or a verb's end removes the file it held; see above)."""
    fd, created, holder = _locked(path, refusal)
    while not _still_named(fd, path):
        os.close(fd)
        fd, created, holder = _locked(path, refusal)
    return fd, created, holder


def _sign(fd: int, by: str) -> None:
    """Name this process as the lock's holder in its file (`by`: the verb, if any)."""
    os.ftruncate(fd, 0)
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"{by + ': ' if by else ''}host {socket.gethostname()}, pid {os.getpid()}, since {since}".encode(), 0)


def _locked(path: Path, refusal) -> tuple[int, bool, str]:
    """(fd, whether this call created the file, the holder it names) of `path`, locked; a UsageError if held:
    `refusal(the holder it names)`."""
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False
    holder = " ".join(os.read(fd, 4096).decode(errors="replace").split())  # one line, whatever the file holds
    try:
        # held by this process alone; closing any fd of the file would drop it (this one stays open)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise UsageError(refusal(holder or "holder unknown")) from None
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


@contextlib.contextmanager
def writer_lock(
    target: str | os.PathLike,
    flag: str,
    by: str,
    *,
    beside: bool = False,
    every_rank: bool = False,
    instead: str | None = None,
):
    """Hold a lock on `target`, the folder a verb writes, for the block (`beside`: a file or folder that appears whole
    by a rename, locked by .NAME.lock beside it). A second writer is refused: a UsageError naming the holder, "FLAG
    TARGET: being written by another process (BY: host H, pid P, since T): wait for it to end, or INSTEAD" (default
    INSTEAD: give another FLAG); a lock left by a killed writer is
    taken over with a warning. The lock file is removed at the end (and a folder the lock created, if still empty).
    `every_rank`: the block runs on every rank of a process group: rank 0 holds the lock, and a refusal is raised on
    every rank; else this process holds it."""
    target = Path(target)
    lock = _WriterLock(target, flag, by, beside, instead or f"give another {flag}")
    if every_rank:
        decided_on_rank0(lock.take)
    else:
        lock.take()
    try:
        yield
    finally:
        lock.release()


class _WriterLock:
    def __init__(self, target: Path, flag: str, by: str, beside: bool, instead: str):
        self.target, self.flag, self.by, self.beside, self.instead = target, flag, by, beside, instead
        self.path = target.parent / f".{target.name}.lock" if beside else target / WRITER_LOCK
        self.fd: int | None = None
        self.made_folder = False

    def take(self) -> None:
        folder = self.path.parent
        if not self.beside and folder.exists() and not folder.is_dir():
            raise UsageError(f"{self.flag} {folder} is a file: give a folder")
        self.made_folder = not folder.exists()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.fd, _, holder = _taken(self.path, self._refusal)
        except OSError as error:  # a read-only or full disk: one line (and on every rank, see decided_on_rank0)
            reason = error.strerror or error
            raise DiscoClipError(f"cannot write '{self.target}': {reason}: choose a writable folder") from error
        if holder:  # its holder was killed (a writer that ends removes its lock file)
            logger.warning(
                "%s %s: taking over the lock of a writer that is no longer running (%s)", self.flag, self.target, holder
            )
        _sign(self.fd, self.by)
        if not self.beside:
            atomic.remove_leftovers(folder)

    def _refusal(self, holder: str) -> str:
        return (
            f"{self.flag} {self.target}: being written by another process ({holder}): wait for it to end, or "
            f"{self.instead}"
        )

    def release(self) -> None:
        if self.fd is None:
            return
        if _still_named(self.fd, self.path):
            self.path.unlink()  # before the unlock: a writer that locks the removed file meanwhile sees it is gone
        os.close(self.fd)
        self.fd = None
        if self.made_folder:
            with contextlib.suppress(OSError):  # left as found: a folder that only the lock was made for
                self.path.parent.rmdir()
