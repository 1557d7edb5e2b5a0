"""Several nodes on one host, launched: node-local output folders refused, nodes started differently refused, and a
torchrun elastic run that heals itself after a rank is killed.

A node is one launcher with its own ranks (one CPU rank each here) on 127.0.0.1, as in test_slurm_two_nodes.py. A
node-local disk is made real, as root, with a mount namespace per node: `unshare --mount` and a bind mount give each
node its own folder at the same path, as two hosts' local disks would."""

import json
import os
import shutil
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import (
    LAUNCH_COMMON,
    REPO,
    SGD,
    finish,
    launch,
    node_command,
    start,
)
from disco_clip_ds.testing.processes import kill_group
from disco_clip_ds.testing.ranks import free_port
from disco_clip_ds.testing.runs import complete_checkpoints, same_weights, save_initial_model

STEPS, SAVE = 6, 2
ROOT = os.geteuid() == 0 and shutil.which("unshare") is not None
needs_root = pytest.mark.skipif(not ROOT, reason="per-node mount namespaces need root and unshare")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    write_shards(root / "data/shards", num_shards=2, per_shard=32, seed=3)
    return {"root": root, "shards": str(root / "data/shards"), "model": save_initial_model(root / "data/init", 5)}


def _train_args(data, output: Path) -> list[str]:
    return [
        "--output_dir", str(output), "--model_name_or_path", str(data["model"]), "--train_shards", data["shards"],
        "--train_num_samples", "64", "--per_device_train_batch_size", "8", "--max_steps", str(STEPS),
        *LAUNCH_COMMON, "--save_steps", str(SAVE), *SGD, "--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"),
    ]  # fmt: skip


def _start_node(node: int, log: Path, train_args: list[str], port: int, bind=None, nproc=1, rendezvous=None, **env):
    """Node NODE's torchrun (NPROC ranks; `rendezvous`: its rendezvous arguments, else a static master on PORT),
    `start`ed in its own session; with `bind` (SOURCE, TARGET), in a mount namespace of its own where SOURCE is
    mounted on TARGET."""
    command = node_command("torchrun", 2, node, port, nproc, rendezvous=rendezvous) + train_args
    if bind:
        mount = f'mount --bind {bind[0]} {bind[1]} && exec "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *command]
    return start(command, log, **env)


def _finish(procs, timeout=500) -> list[int]:
    """Every node's launcher to its end (`finish`: its ranks waited for, then killed): their exit codes."""
    try:
        return [finish(p, timeout, linger=60) for p in procs]
    finally:
        for p in procs:
            kill_group(p.pid)


def _one_line(log: str, text: str) -> int:
    """How many lines of LOG hold TEXT, each a whole `disco-clip train: ...` line."""
    return sum(1 for line in log.splitlines() if text in line and line.startswith("disco-clip train: "))


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_root
def test_a_node_local_output_folder_is_refused_on_every_node(data, tmp_path):
    """Each node sees its own folder at the same --output_dir (a per-node mount namespace): every rank stops before
    any work with one line naming the rank that does not see rank 0's file; neither node's disk keeps anything."""
    out = tmp_path / "run"
    out.mkdir()
    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    port = free_port()
    procs = []
    for node, disk in enumerate(disks):
        disk.mkdir()
        log = tmp_path / f"node{node}.log"
        procs.append(_start_node(node, log, _train_args(data, out), port, bind=(disk, out)))
    codes = _finish(procs)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in range(2)]
    line = f"--output_dir {out} is not shared: rank 1 (node 1 on "
    for log in logs:
        assert _one_line(log, line) == 1, log[-3000:]
        assert "does not see the file rank 0 wrote there; every node must see one --output_dir" in log
        assert "exitcode: 2" in log and str(REPO / "disco_clip_ds") not in log  # no traceback of ours
    assert codes == [1, 1]  # torchrun reports a rank's exit code 2 as its own 1
    assert [list(d.iterdir()) for d in disks] == [[], []] and list(out.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_root
def test_a_node_started_differently_is_refused_on_every_node(data, tmp_path):
    """Node 1 runs two ranks where node 0 runs one (world size 3, not 2), sees another model config and a third
    shard at the same paths (its own data disk), and was given another learning rate: every rank stops with one line
    naming rank 1, node 1 and each difference, before the model is built or the output folder made."""
    other = tmp_path / "other_data"
    shutil.copytree(data["root"] / "data", other)
    config = json.loads((other / "init/config.json").read_text())
    config["text_config"]["num_hidden_layers"] += 1
    (other / "init/config.json").write_text(json.dumps(config))
    shutil.copy(other / "shards/00000.tar", other / "shards/00002.tar")
    out = tmp_path / "run"
    port = free_port()
    procs = [
        _start_node(0, tmp_path / "node0.log", _train_args(data, out), port),
        _start_node(
            1, tmp_path / "node1.log", [*_train_args(data, out), "--learning_rate", "0.1"], port,
            bind=(other, data["root"] / "data"), nproc=2,
        ),
    ]  # fmt: skip
    codes = _finish(procs)
    layers = config["text_config"]["num_hidden_layers"]
    for n, ranks in enumerate((1, 2)):
        log = (tmp_path / f"node{n}.log").read_text()
        assert _one_line(log, "the nodes were not started alike: rank 1 (node 1 on ") == ranks, log[-3000:]
        line = next(x for x in log.splitlines() if "not started alike" in x)
        assert "differs from rank 0 (node 0 on " in line and "ranks per node 1 -> 2" in line
        assert "(ranks 2 differ too): start every node with the same arguments, files and software" in line
        assert "--learning_rate 0.5 -> 0.1" in line
        assert f"the model (text_config.num_hidden_layers {layers - 1} -> {layers})" in line
        assert "the training shards (count 2 -> 3, sha256 " in line
        assert "exitcode: 2" in log and str(REPO / "disco_clip_ds") not in log  # no traceback of ours
    assert codes == [1, 1] and not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_elastic_run_heals_itself_after_a_rank_is_killed(data, tmp_path):
    """torchrun elastic on two nodes (c10d rendezvous, --max_restarts 1): node 1's rank is SIGKILLed inside the save
    of step 4 on the first attempt. The survivors fail out of their collective, both nodes' workers start again,
    the restarted rank 0 clears the staged half-checkpoint and every rank resumes from checkpoint-2 with no person
    involved; the run ends with the weights of one node running both ranks, uninterrupted."""
    reference = tmp_path / "one_node"
    args = _train_args(data, reference)
    launch("torchrun", 2, reference, *args[: args.index("--deepspeed")])

    out = tmp_path / "run"
    port = free_port()
    rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "heal"]
    rendezvous += ["--max_restarts", "1"]
    train_args = [*_train_args(data, out), "--resume_from_checkpoint", "latest"]
    procs = [
        _start_node(
            node, tmp_path / f"node{node}.log", train_args, port, rendezvous=rendezvous,
            DISCO_FAULT="kill_in_save:step=4,attempt=0" if node == 1 else "", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        )
        for node in range(2)
    ]  # fmt: skip
    codes = _finish(procs, timeout=900)
    log = "".join((tmp_path / f"node{n}.log").read_text() for n in range(2))
    assert codes == [0, 0], log[-4000:]
    assert "DISCO_FAULT: killing rank" in log and "inside the save of step 4" in log
    assert "elastic restart 1 of at most 1 on this node (torchrun --max_restarts)" in log
    assert "removing ['checkpoint-4']: partial checkpoints of an interrupted save" in log
    assert log.count(f"resume: {out}/checkpoint-2") == 2  # every rank of the second attempt
    assert complete_checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (out / "tmp-checkpoints").exists() and not list(out.glob(".shared-*"))
    run = json.loads((out / "run.json").read_text())
    assert [r["from_step"] for r in run["resumes"]] == [2]
    assert same_weights(out, reference) <= 1e-6
