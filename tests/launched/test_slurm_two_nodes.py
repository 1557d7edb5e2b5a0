"""SLURM across nodes, launched: recipes/slurm_multinode.sbatch runs two nodes on this host through `disco-clip
slurm-launch` (its command from SLURM's variables: tests/unit/distributed/test_slurm.py).

Two nodes are two launchers on 127.0.0.1, each its own process group. SLURM itself is not installed here: the
sbatch test puts stand-ins for `srun` (one task per node, in its own session, SLURM_NODEID set, exit code the
highest of the tasks, as srun reports it), `scancel --signal` (to every process of those tasks) and `scontrol`
(records the requeue) first on PATH; everything they start is real."""

import os
import stat
from pathlib import Path

import pytest

from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, launch, train_env
from disco_clip_ds.testing.processes import kill_group, wait_group
from disco_clip_ds.testing.ranks import free_port
from disco_clip_ds.testing.runs import complete_checkpoints, same_weights, two_shards_and_init

STEPS = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return two_shards_and_init(tmp_path_factory.mktemp("nodes"))


def _train_args(data) -> list[str]:
    return [
        "--model_name_or_path", str(data["model"]), "--train_shards", data["shards"],
        "--train_num_samples", "64", "--per_device_train_batch_size", "8", "--max_steps", str(STEPS),
        *LAUNCH_COMMON, "--save_steps", "2", *SGD,
    ]  # fmt: skip


FAKE_SRUN = """#!/usr/bin/env bash
# stand-in for srun: one task per node of the job, each in its own session, SLURM_NODEID set; exit code the highest
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node setsid "$@" >> "$FAKE_SLURM_DIR/node$node.log" 2>&1 &
  pids+=($!)
  echo $! >> "$FAKE_SLURM_DIR/sessions"
done
rc=0
for pid in "${pids[@]}"; do wait "$pid"; r=$?; (( r > rc )) && rc=$r; done
exit $rc
"""


FAKE_SCONTROL = '#!/usr/bin/env bash\necho "$@" >> "$FAKE_SLURM_DIR/scontrol.log"\n'
# stand-in for `scancel --signal=SIG JOB`: SIG to every process of the job's steps (each node task's session)
FAKE_SCANCEL = """#!/usr/bin/env bash
sig=${1#--signal=}
while read -r sid; do kill -s "$sig" -- "-$sid" 2>/dev/null; done < "$FAKE_SLURM_DIR/sessions"
"""


def _start_sbatch(tmp_path: Path, output: Path, data: dict, *args: str, fault: str = "", launcher: str = "torchrun"):
    """Start recipes/slurm_multinode.sbatch as SLURM would on the first of two nodes (this host twice)."""
    import subprocess

    fake = tmp_path / "fake-slurm"
    fake.mkdir(exist_ok=True)
    (fake / "sessions").unlink(missing_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (fake / name).write_text(text)
        (fake / name).chmod((fake / name).stat().st_mode | stat.S_IEXEC)
    env = train_env(
        PATH=f"{fake}:{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(fake),
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NODELIST="localhost,127.0.0.1",
        SLURM_JOB_NUM_NODES="2",
        OUTPUT_DIR=str(output),
        NPROC="1",
        MASTER_PORT=str(free_port()),
        DS_CONFIG="ds_configs/cpu_zero2.json",
        DISCO_FAULT=fault,
        LAUNCHER=launcher,
    )
    return subprocess.Popen(
        ["bash", str(REPO / "recipes/slurm_multinode.sbatch"), *_train_args(data), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _sbatch(tmp_path, output, data, *args, fault="", launcher="torchrun", proc=None) -> tuple[int, str]:
    """Run the script to its end (or wait for PROC, started by _start_sbatch): (exit code, its log and the nodes')."""
    fake = tmp_path / "fake-slurm"
    proc = proc or _start_sbatch(tmp_path, output, data, *args, fault=fault, launcher=launcher)
    try:
        out, _ = proc.communicate(timeout=400)
        wait_group(proc.pid, timeout=60)
    finally:
        kill_group(proc.pid)
    logs = "".join((fake / f"node{n}.log").read_text() for n in range(2) if (fake / f"node{n}.log").exists())
    return proc.returncode, out + logs


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_nodes_preempted_together_leave_one_checkpoint_and_resume_exactly(data, tmp_path):
    """SIGTERM to every process of both nodes at step 2 (each rank sends it to its node's process group, as a
    preemption does): every rank stops with exit 75 and they leave one complete checkpoint covering both; SLURM
    requeues a preempted job itself, and the next start (the same script, LAUNCHER=deepspeed: a hostfile and
    --no_ssh per node) ends with the weights of one node running both ranks from the same init."""
    reference = tmp_path / "one_node"
    launch("torchrun", 2, reference, *_train_args(data))

    out = tmp_path / "run"
    rc, log = _sbatch(tmp_path, out, data, fault="signal_group_at_step=SIGTERM:step=2")
    assert rc != 0, log[-4000:]  # torchrun reports its ranks' 75 as a failure (exit 1)
    assert log.count("stopped by SIGTERM at step 2: checkpoint-2 saved") == 2, log[-4000:]  # a rank per node
    assert log.count("failed (exitcode: 75)") == 2 and "slurm-launch: " in log
    assert complete_checkpoints(out) == ["checkpoint-2"] and not (out / "model.safetensors").exists()
    assert len(list((out / "checkpoint-2").glob("rng_state_*.pth"))) == 2  # both nodes' ranks in one checkpoint

    (tmp_path / "fake-slurm" / "scontrol.log").unlink(missing_ok=True)
    rc, log = _sbatch(tmp_path, out, data, launcher="deepspeed")  # the requeued job, under deepspeed's launcher
    assert rc == 0, log[-4000:]
    assert log.count("deepspeed --hostfile") == 2 and log.count("--no_ssh --node_rank") == 2
    assert not (tmp_path / "fake-slurm" / "scontrol.log").exists()  # finished: no requeue
    assert same_weights(out, reference) <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_time_limit_warning_stops_every_node_and_requeues(data, tmp_path):
    """SLURM's USR1 to the batch shell (--signal=B:USR1@120): the script has every process of the job's steps sent
    SIGTERM, the ranks of both nodes checkpoint together and stop, and the script requeues the job."""
    import signal
    import time

    out = tmp_path / "run"
    proc = _start_sbatch(tmp_path, out, data, "--max_steps", "100000")
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2").exists():  # training is under way on both nodes
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    rc, log = _sbatch(tmp_path, out, data, proc=proc)
    assert rc == 0 and "USR1: asking every rank to checkpoint and stop" in log, log[-4000:]
    assert "requeue 4242" in (tmp_path / "fake-slurm" / "scontrol.log").read_text()
    assert log.count("stopped by SIGTERM at step") == 2, log[-4000:]
    assert not (out / "model.safetensors").exists()
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert len(names) >= 2 and complete_checkpoints(out) == sorted(names, key=lambda n: int(n.split("-")[1]))
