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
