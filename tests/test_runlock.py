"""runlock.py: one writer per run folder. (A second run refused while the first holds the lock, through
`disco-clip train`, is in test_checkpoints.py.)"""

import os

from disco_clip_ds import checkpoints, runlock


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
    runlock.acquire_run_lock(out)
    runlock.release_run_lock()
    assert not (out / checkpoints.STAGING).exists()
    assert "partial checkpoints of an interrupted save" in caplog.text
