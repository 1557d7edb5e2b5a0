"""faults.py: DISCO_FAULT entries fire at their named point only, and the points do what the catalogue says.
(Their use in training and downloads: launched/test_faults_and_preemption.py,
launched/test_integrity_and_full_disk.py, test_prep.py, test_spark.py.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from disco_clip_ds import faults
from disco_clip_ds.faults import Fault


def test_entries_parse_into_action_value_and_conditions():
    assert faults.parse("kill_in_save:step=4; signal_at_step=SIGUSR1:step=3,rank=1;hold_after=/tmp/h:shard=0;") == [
        Fault("kill_in_save", "", {"step": 4}),
        Fault("signal_at_step", "SIGUSR1", {"step": 3, "rank": 1}),
        Fault("hold_after", "/tmp/h", {"shard": 0}),
    ]
    assert faults.parse("") == []


def test_attempt_is_a_spark_tasks_attempt_number_inside_one(monkeypatch):
    import types

    monkeypatch.setenv(faults.ENV, "kill_in_write:shard=1,attempt=0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert faults.fault("kill_in_write", shard=1)  # outside Spark and torchrun: attempt 0
    task = types.SimpleNamespace(attemptNumber=lambda: 1)  # Spark's second attempt of a task
    fake = types.SimpleNamespace(TaskContext=types.SimpleNamespace(get=lambda: task))
    monkeypatch.setitem(sys.modules, "pyspark", fake)
    assert faults.fault("kill_in_write", shard=1) is None
    task.attemptNumber = lambda: 0
    assert faults.fault("kill_in_write", shard=1)
    faults.in_output_write(2)  # another shard: nothing


def test_an_entry_fires_where_all_its_conditions_hold(monkeypatch):
    monkeypatch.setenv(faults.ENV, "disk_free_mib=3:step=4;kill_in_save:step=2,rank=1;enospc_in_save:step=2,rank=0")
    assert faults.forced_free_bytes(4) == 3 * 2**20
    assert faults.forced_free_bytes(5) is None
    assert faults.fault("kill_in_save", step=2) is None  # one process is rank 0
    assert faults.fault("enospc_in_save", step=2) == Fault("enospc_in_save", "", {"step": 2, "rank": 0})
    assert faults.fault("enospc_in_save", shard=2) is None  # a condition the point does not know never holds
    with pytest.raises(OSError, match="No space left"):
        faults.in_deepspeed_write(2)
    faults.in_deepspeed_write(3)
    faults.in_save(2)  # kill_in_save holds for rank 1 only
    faults.in_final_save(2)
    monkeypatch.delenv(faults.ENV)
    assert faults.fault("enospc_in_save", step=2) is None


def _point(code: str, fault: str) -> subprocess.Popen:
    """A fresh interpreter that reaches the point `code` with DISCO_FAULT set."""
    env = {**os.environ, faults.ENV: fault}
    return subprocess.Popen([sys.executable, "-c", f"from disco_clip_ds import faults; {code}; print('past')"], env=env)


@pytest.mark.slow  # two interpreters started: the fast tier keeps the in-process points
def test_kill_in_final_save_kills_at_its_point_only():
    assert _point("faults.in_save(3)", "kill_in_final_save").wait(timeout=60) == 0
    assert _point("faults.in_final_save(3)", "kill_in_final_save").wait(timeout=60) == -signal.SIGKILL


def test_exit_before_ends_the_worker_and_only_at_its_shard():
    assert _point("faults.before_shard(1)", "exit_before:shard=2").wait(timeout=60) == 0
    assert _point("faults.before_shard(2)", "exit_before:shard=2").wait(timeout=60) == 3


def test_hold_after_writes_the_pid_and_stops_the_worker(tmp_path):
    hold = tmp_path / "held.pid"
    proc = _point("faults.after_shard(1)", f"hold_after={hold}:shard=1")
    try:
        deadline = time.monotonic() + 60
        while not hold.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hold.read_text() == str(proc.pid)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # two interpreters started
def test_kill_after_output_kills_the_filter_and_its_workers_at_its_shard_only(tmp_path):
    worker = "import multiprocessing, time; w = multiprocessing.Process(target=time.sleep, args=(60,)); w.start()"
    worker += f"; open({str(tmp_path / 'worker.pid')!r}, 'w').write(str(w.pid))"
    assert _point(f"{worker}; faults.after_output_shard(0); w.terminate()", "kill_after_output:shard=1").wait(60) == 0
    killed = _point(f"{worker}; faults.after_output_shard(1)", "kill_after_output:shard=1")
    assert killed.wait(timeout=60) == -signal.SIGKILL
    pid, deadline = int((tmp_path / "worker.pid").read_text()), time.monotonic() + 10
    while time.monotonic() < deadline:  # the orphaned worker, killed too, is reaped by init
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the worker outlived the filter")
