"""testing/launch.py: a launch runs in a session of its own, and whatever ends it (its end, a failure, the time
limit) leaves no process of that session behind, so that no rank outlives the test that started it."""

import os
import signal
import subprocess
import time

import pytest

from disco_clip_ds.testing.launch import run_training
from disco_clip_ds.testing.processes import alive


@pytest.mark.slow  # a real launch held past its time limit
@pytest.mark.parametrize("start", ["sleep 30", "setsid sleep 30"], ids=["in_its_group", "in_a_session_of_its_own"])
def test_a_launch_past_its_time_limit_leaves_no_process_of_its_session(tmp_path, start):
    """A "launcher" that starts a "rank" (sleep), writes its pid down, and waits for it; the rank in the launcher's
    process group, or in a session of its own as torch elastic starts ranks (torchrun, accelerate), where killing
    the group alone would leave it running."""
    pid_file = tmp_path / "rank.pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_training(["sh", "-c", f"{start} & echo $! > {pid_file}; wait"], log=tmp_path / "run.log", timeout=2)
    assert time.monotonic() - started < 15  # not held until the rank ends by itself
    rank = int(pid_file.read_text())
    try:
        assert alive([rank]) == []
    finally:
        if alive([rank]):
            os.kill(rank, signal.SIGKILL)


def test_a_failed_launch_is_an_assertion_with_its_log(tmp_path):
    with pytest.raises(AssertionError, match=r"sh run failed:\nlast words"):
        run_training(["sh", "-c", "echo last words >&2; exit 3"], timeout=60)
    log = tmp_path / "run.log"
    log.write_text("an earlier launch\n")
    assert run_training(["sh", "-c", "echo done"], log=log, timeout=60) == "done\n"
    assert log.read_text() == "done\n"  # written afresh, as before
