"""A second writer, in another process, started at a point the test chooses: a forked child of the test's process
(milliseconds, where a new interpreter would pay the package's imports). Folder locks are POSIX record locks, held per
process, so the second writer must be another process; forking at a named point (a fault point the test hooks, or
while a `held_elsewhere` child holds a lock) makes the interleaving deterministic. The children run the package's
checks and lock code only (no torch kernels), which is safe after a fork."""

from __future__ import annotations

import contextlib
import os
import signal

from disco_clip_ds.errors import DiscoClipError


def in_another_process(fn) -> str:
    """Run `fn()` in a forked child and wait for it; '' when it returned, else what it raised: the one line of a
    DiscoClipError ("UsageError: ..."), or "unexpected TYPE: ..." for anything else."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no atexit, no pytest teardown in this copy)
        os.close(read)
        try:
            fn()
            said = ""
        except DiscoClipError as error:
            said = f"{type(error).__name__}: {error}"
        except BaseException as error:  # noqa: BLE001  (reported to the test, which fails on it)
            said = f"unexpected {type(error).__name__}: {error}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    return said


@contextlib.contextmanager
def held_elsewhere(lock):
    """For the block, a forked child holds `lock` (a context manager, e.g. `runlock.writer_lock(...)`) and waits;
    yields the child's pid. Killing it (SIGKILL) in the block leaves the lock as a killed writer does."""
    held_r, held_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            with lock:
                os.write(held_w, b"1")
                os.read(go_r, 1)  # until the block ends (or the test kills this child)
        finally:
            os._exit(0)
    os.close(held_w)
    os.close(go_r)
    try:
        if os.read(held_r, 1) != b"1":
            raise RuntimeError("the child did not take the lock")
        yield pid
    finally:
        with contextlib.suppress(OSError):  # a child killed in the block reads no more
            os.write(go_w, b"1")
        for fd in (held_r, go_w):
            os.close(fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def kill(pid: int) -> None:
    """SIGKILL `pid` and reap it (a writer killed outright: no `finally` runs)."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
