"""How launched runs end, as the user and the machine see it: a clean stop exits 75 with its checkpoint every time
(10 stops in a row), and no run (finished, stopped, failed or killed) leaves a file in /dev/shm.

Each run gets a /dev/shm of its own (a folder bind-mounted there in a private mount namespace, `unshare --mount`),
so that what it leaves is told apart from other processes' files, exactly; this needs root.
2 CPU ranks under the deepspeed launcher (the one that makes DeepSpeed create its shared-memory buffers), ZeRO-2,
2-step runs of the tiny model from one shared initial model.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, train_command, train_env
from disco_clip_ds.testing.processes import kill_group, wait_group
from disco_clip_ds.testing.runs import complete_checkpoints, save_initial_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None, reason="a private /dev/shm needs root and unshare"
    ),
]

# (signal, where), stopped in a row: each signal, to the rank that must tell rank 0, and to both
STOPS = [("SIGTERM", "rank=1"), ("SIGUSR1", "")]


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    root = tmp_path_factory.mktemp("exits")
    write_shards(root / "shards", num_shards=2, per_shard=16, seed=1)
    return {"model": save_initial_model(root / "tiny", 7), "shards": f"{root}/shards/{{00000..00001}}.tar"}


def _start(init: dict, out: Path, fault: str = "", steps: int = 2) -> tuple[subprocess.Popen, Path]:
    """Start a 2-rank run in a session of its own whose /dev/shm is a fresh folder (returned); log in OUT.log."""
    shm = out.parent / f"{out.name}.shm"
    shm.mkdir(parents=True)
    args = ["--output_dir", str(out), "--model_name_or_path", str(init["model"]), "--train_shards", init["shards"],
            *LAUNCH_COMMON, "--train_num_samples", "32", "--per_device_train_batch_size", "4", "--save_steps", "1",
            *SGD, "--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"), "--max_steps", str(steps)]  # fmt: skip
    private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"']
    proc = subprocess.Popen(
        [*private, str(shm), *train_command("deepspeed", 2), *args],
        cwd=REPO,
        env=train_env(DISCO_FAULT=fault),
        stdout=open(f"{out}.log", "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, shm


def _run(init: dict, out: Path, fault: str = "") -> tuple[int, str, list[str]]:
    """(exit code, log, what is left in the run's /dev/shm) of a run to its end."""
    proc, shm = _start(init, out, fault)
    try:
        proc.wait(timeout=600)
        wait_group(proc.pid, timeout=120)
    finally:
        kill_group(proc.pid)
    return proc.returncode, Path(f"{out}.log").read_text(), sorted(os.listdir(shm))


def _message_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("disco-clip train: ")]


def test_a_finished_run_leaves_nothing_in_dev_shm(init, tmp_path):
    rc, log, left = _run(init, tmp_path / "run")
    assert rc == 0, log[-3000:]
    assert left == [], left  # DeepSpeed alone leaves deepspeed_allreduce_buffer_* (tests/test_compat.py)


def test_a_failed_run_leaves_nothing_in_dev_shm(init, tmp_path):
    rc, log, left = _run(init, tmp_path / "run", fault="enospc_in_save:step=1,rank=1")
    assert rc == 1 and len(_message_lines(log)) >= 1, log[-3000:]
    assert left == [], left


def test_a_clean_stop_exits_75_with_its_checkpoint_every_time(init, tmp_path):
    """STOPS stops in a row, the signal to rank 0, to rank 1 or to both, SIGTERM or SIGUSR1: every one exits 75
    with one line per rank, checkpoint-1 complete, no abort, nothing left in /dev/shm."""
    for i, (sig, where) in enumerate(STOPS):
        fault = f"signal_at_step={sig}:step=1" + (f",{where}" if where else "")
        out = tmp_path / f"stop{i}"
        rc, log, left = _run(init, out, fault)
        assert rc == 75, f"stop {i} ({fault}): exit {rc}\n{log[-3000:]}"
        assert len(_message_lines(log)) == 2 and "terminate called" not in log, f"stop {i}: {log[-3000:]}"
        assert complete_checkpoints(out) == ["checkpoint-1"], f"stop {i}"
        assert left == [], f"stop {i}: {left}"


def _stopped_in_startup(init: dict, out: Path, fault: str) -> tuple[str, list[str]]:
    """(log, what is left in /dev/shm) of a run stopped during start-up by FAULT, once it is checked that each rank
    said so in one line and the run exited 75, with nothing trained or saved."""
    rc, log, left = _run(init, out, fault=fault)
    # searched, not split into lines: a line may follow another rank's progress bar, which ends in no newline
    ranks = re.findall(r"disco-clip train: \[rank (\d)\] SIGTERM during start-up, before training began", log)
    assert rc == 75 and sorted(ranks) == ["0", "1"], f"{fault}: exit {rc}\n{log[-3000:]}"
    assert "Traceback" not in log and complete_checkpoints(out) == [], f"{fault}\n{log[-3000:]}"
    return log, left


def test_a_stop_signal_during_startup_ends_every_rank_with_one_line_and_75(init, tmp_path):
    """SIGTERM to every rank once the process group is joined, before the trainer's handlers exist (the DISCO_FAULT
    point signal_at_startup, its first stage): each rank says so in one line and the run exits 75, with nothing
    trained, saved or left in /dev/shm. (Without the start-up watch the ranks died silently: exit -15 / 143.)"""
    out = tmp_path / "run"
    log, left = _stopped_in_startup(init, out, "signal_at_startup")
    assert left == [], left
    assert not (out / "run.lock").exists()  # stopped before the lock was taken


# The late stages, where a stop left things behind (startup.py's stage numbers): output_dir locked; DeepSpeed's
# /dev/shm buffers named, not yet unlinked; everything built but the trainer. The first stage is the test above; the
# validated one (1) holds nothing the end of the process would not undo, so it is not launched again (~30 s each).
LATE_STAGES = {2: "locked", 3: "deepspeed_buffers", 4: "built"}


@pytest.mark.parametrize("stage", LATE_STAGES, ids=LATE_STAGES.values())
def test_a_stop_late_in_startup_leaves_no_lock_and_nothing_in_dev_shm(init, tmp_path, stage):
    """SIGTERM to every rank at a late start-up stage (DISCO_FAULT signal_at_startup:stage=N): 75 and one line per
    rank as at the first stage, and the run leaves nothing behind: no run.lock in output_dir (a lock file naming a
    dead holder would warn the next run), none of DeepSpeed's buffers in /dev/shm."""
    out = tmp_path / "run"
    log, left = _stopped_in_startup(init, out, f"signal_at_startup:stage={stage}")
    assert left == [], f"stage {stage}: {left}"
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == [], f"stage {stage}: {list(out.iterdir())}"


def test_a_rank_stopped_alone_in_startup_leaves_its_peer_nothing_to_leak(init, tmp_path):
    """SIGTERM to rank 1 alone once output_dir is locked (signal_at_startup:stage=2,rank=1), as a group signal finds
    a rank a moment behind the other: rank 1 ends at once with its line; rank 0, which goes on into DeepSpeed's comm
    set-up, must not create its buffer and then wait forever for rank 1's (the launcher SIGKILLs it 30 s later, its
    buffer left in /dev/shm). It ends with one line, rank 1's stop (the launcher's SIGTERM) or the lost peer; the
    launcher's exit code is that of the rank it sees end first: 75 or 1. The lock is released."""
    out = tmp_path / "run"
    rc, log, left = _run(init, out, fault="signal_at_startup:stage=2,rank=1")
    rank0 = ("[rank 0] SIGTERM during start-up, before training", "disco-clip train: lost contact with another rank")
    assert "[rank 1] SIGTERM during start-up, before training began" in log, log[-3000:]
    assert rc in (75, 1) and any(line in log for line in rank0), f"exit {rc}\n{log[-3000:]}"
    assert "Traceback" not in log and "exits with return code = -9" not in log, log[-3000:]
    assert left == [], left
    assert not (out / "run.lock").exists() or (out / "run.lock").read_text() == ""  # released


def test_a_killed_run_leaves_nothing_in_dev_shm(init, tmp_path):
    """SIGKILL to the whole group once a checkpoint exists: nothing runs after it, so DeepSpeed's buffers must be
    gone by then (without compat's workaround, 132 MiB stay), and the data stream's shared counters must not hold
    named semaphores (sem.mp-*) that only a clean exit would unlink."""
    out = tmp_path / "run"
    proc, shm = _start(init, out, steps=1000)
    try:
        deadline = time.monotonic() + 600
        while not complete_checkpoints(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert complete_checkpoints(out), Path(f"{out}.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        wait_group(proc.pid, timeout=60)
    finally:
        kill_group(proc.pid)
    assert sorted(os.listdir(shm)) == []
