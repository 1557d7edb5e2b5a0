"""runlock.py: one writer per run folder. (A second run refused while the first holds the lock, through
`disco-clip train`, is in test_checkpoints.py.)"""

import os
import socket

import pytest

from disco_clip_ds.checkpoint import layout as checkpoints
from disco_clip_ds.distributed import runlock
from disco_clip_ds.errors import DiscoClipError, UsageError
from disco_clip_ds.testing.writers import held_elsewhere, kill


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

    def removed_after_locking(path, refusal):
        fd, created, holder = locked(path, refusal)
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


# --- a verb's lock on the folder it writes (writer_lock): data filter, data embed, eval --output, export ---


def _filter_lock(out, **kwargs):
    return runlock.writer_lock(out, "--output", "disco-clip data filter", **kwargs)


def test_a_second_writer_is_refused_in_one_line_naming_the_holders_host_and_pid(tmp_path):
    out = tmp_path / "out"
    with held_elsewhere(_filter_lock(out)) as pid:
        with pytest.raises(UsageError) as refused, _filter_lock(out):
            pass
        said = str(refused.value)
        holder = f"disco-clip data filter: host {socket.gethostname()}, pid {pid}, since "
        assert said.startswith(f"--output {out}: being written by another process ({holder}") and "\n" not in said
        assert said.endswith("): wait for it to end, or give another --output")
    assert not out.exists()  # the holder ended: its lock file went, and the folder made for it
    with _filter_lock(out):  # and the folder is free again, without a word of a dead holder
        assert (out / runlock.WRITER_LOCK).read_text().endswith(f"pid {os.getpid()}, since " + _since(out))


def _since(out) -> str:
    return (out / runlock.WRITER_LOCK).read_text().rsplit("since ", 1)[1]


def test_the_lock_of_a_killed_writer_is_taken_over_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    with held_elsewhere(_filter_lock(out)) as pid:
        kill(pid)  # kill -9: no `finally` ran, its lock file names it
        assert f"pid {pid}" in (out / runlock.WRITER_LOCK).read_text()
        with _filter_lock(out):
            assert f"pid {os.getpid()}" in (out / runlock.WRITER_LOCK).read_text()
    taken = f"--output {out}: taking over the lock of a writer that is no longer running (disco-clip data filter: host "
    assert taken in caplog.text and f"pid {pid}, since" in caplog.text
    assert not (out / runlock.WRITER_LOCK).exists()


def test_a_target_that_appears_whole_is_locked_beside_it_and_a_folder_made_for_the_lock_is_removed(tmp_path):
    """export's folder (new or empty until its rename) and eval's record file are locked by .NAME.lock beside them."""
    record = tmp_path / "new" / "record.json"
    lock = runlock.writer_lock(record, "--output", "disco-clip eval", beside=True)
    with held_elsewhere(lock) as pid:
        assert (tmp_path / "new" / ".record.json.lock").is_file() and not record.exists()
        with pytest.raises(UsageError, match=f"--output {record}: being written by another process .*pid {pid}"):
            with runlock.writer_lock(record, "--output", "disco-clip eval", beside=True):
                pass
    assert sorted(tmp_path.iterdir()) == []  # the folder the lock made, empty again: removed


def test_the_holder_of_a_folders_lock_removes_the_temporary_files_killed_writers_left(tmp_path):
    from disco_clip_ds.atomic import Stage

    out = tmp_path / "out"
    out.mkdir()
    torn = Stage(out / "00002.tar").tmp  # a writer killed before its rename
    (out / ".filter").mkdir()
    (out / "00001.tar").write_bytes(b"kept")
    with _filter_lock(out):
        assert sorted(p.name for p in out.iterdir()) == [runlock.WRITER_LOCK, ".filter", "00001.tar"]
    assert not torn.exists()


def test_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with (
        pytest.raises(UsageError, match=r"^--output .*file is a file: give a folder$"),
        _filter_lock(tmp_path / "file"),
    ):
        pass
    with pytest.raises(DiscoClipError, match=r"^cannot write '.*file/out': Not a directory: choose a writable folder$"):
        with _filter_lock(tmp_path / "file" / "out"):
            pass


def _refused_on_this_rank(rank: int, world: int, out: str) -> str:
    try:
        with runlock.writer_lock(out, "--output", "disco-clip data embed", every_rank=True):
            return "not refused"
    except UsageError as error:
        return str(error)


@pytest.mark.slow  # spawned ranks
def test_every_rank_is_refused_with_the_same_line_while_another_process_holds_the_folder(tmp_path):
    """`data embed` and `eval` under torchrun: rank 0 asks for the lock, every rank gets the refusal (no rank waits
    for the others in a collective)."""
    from disco_clip_ds.testing.ranks import run_ranks

    out = tmp_path / "sidecars"
    with held_elsewhere(runlock.writer_lock(out, "--output", "disco-clip data embed")) as pid:
        said = run_ranks(_refused_on_this_rank, 2, str(out), timeout=60)
    assert said[0] == said[1] and f"pid {pid}, since" in said[0] and said[0].startswith(f"--output {out}: being")
