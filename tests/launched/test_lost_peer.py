"""The collective timeout (--ddp_timeout, default 600 s): applied to the process group on every launcher path, a
peer that stops answering mid-run ends its survivors with one line once it has passed, and a master nobody answers
on (or ranks that never join) is one line naming the address and port, within it.

Two nodes are two launchers on 127.0.0.1, each its own session. The lost peer is real: its rank stops itself
(SIGSTOP) at the end of step 2 (DISCO_FAULT signal_at_step), so its sockets stay open and only the timeout can
end the wait, as with a frozen host or a cut-off network."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, hostfile, start_nodes
from disco_clip_ds.testing.processes import kill_group, ranks_of, wait_group
from disco_clip_ds.testing.ranks import free_port
from disco_clip_ds.testing.runs import run_and_data, two_shards_and_init

TIMEOUT = 12  # --ddp_timeout in the launched tests, seconds: several times the longest healthy wait of these runs
# where no rank ever meets another there is no start-up to wait through: a shorter one, waited in full
ALONE_TIMEOUT = 5
MARGIN = 120  # a busy machine's slack on top of it: still far from torch's 30 minutes


_RANK = r"""
import json, sys, torch
import torch.distributed as dist
from transformers import TrainingArguments
from disco_clip_ds.train.args import DiscoTrainingArguments

cls = DiscoTrainingArguments if sys.argv[2] == "disco" else TrainingArguments
args = cls(output_dir=sys.argv[1], ddp_timeout=42, use_cpu=True, report_to="none")
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print("RESULT " + json.dumps({"world": args.world_size, "timeout": backend.options._timeout.total_seconds()}))
"""


def _group_timeouts(tmp_path, which: str) -> list[dict]:
    """Two fresh interpreters with the environment a launcher gives its ranks build `which` arguments (disco |
    transformers) with --ddp_timeout 42 on CPU: the world size and the timeout of the group each joined."""
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        command = [sys.executable, "-c", _RANK, str(tmp_path / which), which]
        procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    return [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPU transformers passes ddp_timeout itself")
def test_ddp_timeout_reaches_the_cpu_process_group(tmp_path):
    # transformers alone leaves a CPU group at torch's 30 minutes (compat.init_cpu_process_group's reason) ...
    assert _group_timeouts(tmp_path, "transformers") == [{"world": 2, "timeout": 1800.0}] * 2
    # ... the training arguments join it with --ddp_timeout
    assert _group_timeouts(tmp_path, "disco") == [{"world": 2, "timeout": 42.0}] * 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return two_shards_and_init(tmp_path_factory.mktemp("lost_peer"))


def _args(data, out, timeout: int = TIMEOUT) -> list[str]:
    return [
        *LAUNCH_COMMON, *run_and_data(out, data), "--train_num_samples", "64", "--per_device_train_batch_size", "8",
        "--max_steps", "4", "--save_steps", "2", *SGD, "--ddp_timeout", str(timeout),
    ]  # fmt: skip


def _config(launcher: str, root):
    return REPO / "recipes/accelerate/deepspeed_zero2.yaml" if launcher == "accelerate" else hostfile(root, 2)


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:  # exited between listing and reading
        return False


def _one_line(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("disco-clip train: ")]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_a_peer_that_stops_answering_ends_the_survivor_within_the_timeout(data, launcher):
    out = data["root"] / f"stopped_{launcher}"
    extra = [] if launcher == "accelerate" else ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]
    nodes = start_nodes(
        launcher, 2, _args(data, out) + extra, out, config=_config(launcher, data["root"]),
        DISCO_FAULT="signal_at_step=SIGSTOP:step=2,rank=1",
    )  # fmt: skip
    stopped_ranks = []
    try:
        deadline = time.monotonic() + 400
        while not any(_stopped(p) for p in stopped_ranks):
            assert nodes[0].poll() is None and time.monotonic() < deadline, "rank 1 never reached step 2"
            time.sleep(0.2)
            stopped_ranks = ranks_of(nodes[1].pid)
        stopped = time.monotonic()
        code = nodes[0].wait(timeout=TIMEOUT + MARGIN)  # no hang: raises TimeoutExpired otherwise
        took = time.monotonic() - stopped
        wait_group(nodes[0].pid, timeout=60)
    finally:
        for pid in [node.pid for node in nodes] + stopped_ranks:  # torchrun's ranks lead sessions of their own
            kill_group(pid)
    log = (out.parent / f"{out.name}.node0.log").read_text()
    assert code != 0 and took <= TIMEOUT + MARGIN, log[-3000:]
    lines = _one_line(log)
    assert len(lines) == 1, log[-3000:]  # node 0's one rank: one line
    assert lines[0].startswith("disco-clip train: lost contact with another rank"), lines
    assert f"--ddp_timeout {TIMEOUT} s" in lines[0] and "Timed out waiting" in lines[0], lines
    assert (
        "Traceback" not in log[: log.index(lines[0])]
    )  # the rank raised no traceback before it (the launcher's own report follows)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "node, message",
    [
        (1, "no master answered at 127.0.0.1:{port} within --ddp_timeout {timeout} s ([Errno 111] Connection refused)"),
        (0, "not all 2 ranks joined the master at 127.0.0.1:{port} within --ddp_timeout {timeout} s: start every node"),
    ],
    ids=["nobody_at_the_master", "a_node_never_joins"],
)
def test_a_master_nobody_answers_is_one_line_within_the_timeout(data, tmp_path, node, message):
    """Only one of two nodes started (deepspeed's launcher, whose ranks connect themselves: torchrun's and
    accelerate's own rendezvous waits `--rdzv_conf timeout` first): node 1 finds nobody at the master's port, node
    0 waits for a rank that never comes."""
    out, port = tmp_path / "alone", free_port()
    extra = ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]
    started = time.monotonic()
    (proc,) = start_nodes(
        "deepspeed",
        2,
        _args(data, out, ALONE_TIMEOUT) + extra,
        out,
        config=hostfile(tmp_path, 2),
        only=[node],
        port=port,
    )
    try:
        code = proc.wait(timeout=ALONE_TIMEOUT + MARGIN)
    finally:
        kill_group(proc.pid)
    log = (tmp_path / f"alone.node{node}.log").read_text()
    assert code != 0 and time.monotonic() - started <= ALONE_TIMEOUT + MARGIN, log[-3000:]
    lines = _one_line(log)
    said = message.format(port=port, timeout=ALONE_TIMEOUT)
    assert len(lines) == 1 and lines[0].startswith(f"disco-clip train: {said}"), log[-3000:]
    assert "--master_addr and --master_port" in lines[0] and "GLOO_SOCKET_IFNAME" in lines[0]
    assert "Traceback" not in log and "frame #" not in log, log[-3000:]  # no page of traceback
    assert not (out / "run.json").exists()  # nothing written before the ranks met
