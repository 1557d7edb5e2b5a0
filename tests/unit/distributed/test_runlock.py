"""runlock.py: one writer per run folder. (A second run refused while the first holds the lock, through
`disco-clip train`, is in test_checkpoints.py.)"""

import os

import pytest

from disco_clip_ds.checkpoint import layout as checkpoints
from disco_clip_ds.distributed import runlock
from disco_clip_ds.errors import UsageError


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_warning(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / runlock.LOCK_FILE).write_text("host gone, pid 999999, since 2026-01-01 00:00:00")  # holder killed -9
    runlock.acquire_run_lock(out)
    try:
        assert "taking over the lock of a run that is no longer running (host gone, pid 999999" in caplog.text
        assert f"pid {os.getpid()}" in (out / runlock.LOCK_FILE).read_text()
    finally:
        runlock.release_run_lock()
    assert (out / runlock.LOCK_FILE).read_text() == ""  # a clean exit leaves no holder behind


def test_taking_the_lock_removes_what_an_interrupted_save_left(tmp_path, caplog):
    out = tmp_path / "run"
    (out / checkpoints.STAGING / "checkpoint-4").mkdir(parents=True)
    runlock.acquire_run_lock(out, staging=checkpoints.STAGING)
    runlock.release_run_lock()
    assert not (out / checkpoints.STAGING).exists()
    assert "partial checkpoints of an interrupted save" in caplog.text


def test_without_a_staging_folder_named_nothing_is_removed(tmp_path, caplog):
    out = tmp_path / "run"
    (out / checkpoints.STAGING / "checkpoint-4").mkdir(parents=True)
    runlock.acquire_run_lock(out)
    runlock.release_run_lock()
    assert (out / checkpoints.STAGING / "checkpoint-4").is_dir() and "interrupted save" not in caplog.text


def test_an_output_dir_that_is_a_file_is_refused_before_the_lock(tmp_path):
    out = tmp_path / "run"
    out.write_text("")
    with pytest.raises(UsageError, match=f"--output_dir {out} is a file: give a folder"):
        runlock.acquire_run_lock(out)


@pytest.mark.slow  # a forked interpreter
def test_a_child_forked_by_the_holder_does_not_keep_its_lock(tmp_path, caplog):
    """A DataLoader worker is forked while rank 0 holds the lock and may outlive a killed rank 0 by seconds: the
    rank that torchrun restarts at once takes the lock over all the same."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    holder = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys, time; from disco_clip_ds.distributed.runlock import acquire_run_lock; "
            "acquire_run_lock(sys.argv[1]); child = os.fork()\n"
            "if child == 0: os.closerange(0, 3); time.sleep(60); os._exit(0)\n"
            "print(child, flush=True); os.kill(os.getpid(), signal.SIGKILL)",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    child = int(holder.stdout)
    try:
        assert holder.returncode == -signal.SIGKILL and os.path.exists(f"/proc/{child}")  # the worker lives on
        runlock.acquire_run_lock(out)
        runlock.release_run_lock()
        assert "taking over the lock of a run that is no longer running" in caplog.text
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_stop_during_startup_removes_the_lock_file_this_run_created(tmp_path):
    """What start-up's watch runs before it ends rank 0 (startup.clean_up_on_stop): the folder as the run found it.
    The stop itself, through a launched run at each start-up stage, is tests/launched/test_exits.py."""
    from disco_clip_ds.distributed import startup

    out = tmp_path / "run"
    runlock.acquire_run_lock(out)
    assert runlock._abandon_run_lock in startup._cleanups
    runlock._abandon_run_lock()
    assert sorted(out.iterdir()) == [] and runlock._abandon_run_lock not in startup._cleanups
    runlock.acquire_run_lock(out)  # released: taken again without a warning of a dead holder
    runlock.release_run_lock()
    assert (out / runlock.LOCK_FILE).read_text() == "" and runlock._abandon_run_lock not in startup._cleanups


def test_a_stop_during_startup_empties_a_lock_file_an_earlier_run_left(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / runlock.LOCK_FILE).write_text("")  # an earlier run's, released
    runlock.acquire_run_lock(out)
    runlock._abandon_run_lock()
    assert (out / runlock.LOCK_FILE).read_text() == ""


def test_a_lock_taken_on_a_file_removed_meanwhile_is_taken_again_on_the_new_one(tmp_path, monkeypatch):
    """A run that opened run.lock just before a stopped run removed it would lock a file no one else sees: it
    locks the one named run.lock instead."""
    out = tmp_path / "run"
    out.mkdir()
    locked = runlock._locked
    calls = []

    def removed_after_locking(path):
        fd, created, holder = locked(path)
        calls.append(created)
        if len(calls) == 1:  # the stopped run's removal, between our open and our check
            path.unlink()
        return fd, created, holder

    monkeypatch.setattr(runlock, "_locked", removed_after_locking)
    runlock.acquire_run_lock(out)
    try:
        assert calls == [True, True] and os.fstat(runlock._lock_fd).st_ino == (out / runlock.LOCK_FILE).stat().st_ino
    finally:
        runlock.release_run_lock()
