"""Several nodes on one host: node-local output folders refused, nodes started differently refused, bad hostfiles and
node ranks in one line, and a torchrun elastic run that heals itself after a rank is killed.

A node is one launcher with its own ranks (one CPU rank each here) on 127.0.0.1, as in test_cluster.py. A node-local
disk is made real, as root, with a mount namespace per node: `unshare --mount` and a bind mount give each node its
own folder at the same path, as two hosts' local disks would."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from disco_clip_ds.commands.node_check import main as node_check_main
from disco_clip_ds.distributed import nodes
from disco_clip_ds.distributed.slurm import check_node_launch, read_hostfile
from disco_clip_ds.errors import UsageError, run_main
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import (
    LAUNCH_COMMON,
    REPO,
    SGD,
    TINY_CONFIG,
    finish,
    launch,
    node_command,
    start,
    train_env,
)
from disco_clip_ds.testing.ranks import free_port
from disco_clip_ds.train.node_facts import node_facts

from helpers import complete_checkpoints, kill_group, same_weights, save_initial_model

# --- a node's launch arguments ---

HOSTFILES = {
    "good": "# two nodes\nnode1 slots=8\n\nnode2   slots=8\n",
    "bad slots": "node1 slots=8\nnode2 slots eight\n",
    "no slots": "node1\n",
    "twice": "node1 slots=8\nnode1 slots=4\n",
    "empty": "# nothing\n\n",
}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hostfile", "bad slots"], "line 2 'node2 slots eight': write one node per line, 'HOST slots=GPUS'"),
        (["--hostfile", "twice"], "line 2: node1 is listed twice; one line per node"),
        (["--hostfile", "empty"], "names no node"),
        (["--hostfile", "missing"], "missing: No such file or directory"),
        (["--hostfile", "good", "--node_rank", "2"], "--node_rank 2 is out of range for the 2 nodes of --hostfile"),
        (["--nnodes", "2", "--node_rank", "2"], "--node_rank 2 is out of range for --nnodes 2: give 0 to 1"),
        (["--nnodes", "2", "--node_rank", "-1"], "--node_rank -1 is out of range for --nnodes 2"),
        (["--nnodes", "0"], "--nnodes 0: give the number of nodes"),
    ],
)
def test_a_bad_hostfile_or_node_rank_is_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, text in HOSTFILES.items():
        Path(name).write_text(text)
    assert run_main(node_check_main, argv, "disco-clip node-check") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_good_node_arguments_pass(tmp_path):
    (tmp_path / "h").write_text(HOSTFILES["good"])
    assert read_hostfile(tmp_path / "h") == [("node1", 8), ("node2", 8)]
    check_node_launch(hostfile=str(tmp_path / "h"), node_rank=1)
    check_node_launch(nnodes="2", node_rank=1)
    check_node_launch(nnodes="1:4", node_rank=7)  # an elastic range: torchrun assigns the ranks


@pytest.mark.slow  # imports deepspeed (seconds)
def test_hostfiles_are_read_by_deepspeeds_own_rule(tmp_path):
    """The reference is deepspeed's own parser: the same hostfiles pass and fail, with the same hosts."""
    from deepspeed.launcher.runner import _parse_hostfile

    for name, text in HOSTFILES.items():
        try:
            theirs = list(_parse_hostfile(text.splitlines(keepends=True)).items())
        except ValueError:
            theirs = None
        (tmp_path / name).write_text(text)
        try:
            ours = read_hostfile(tmp_path / name)
        except UsageError:
            ours = None
        assert ours == theirs, name


@pytest.mark.parametrize(
    "env, refused",
    [
        ({"TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),
        ({"TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "0", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),
        ({"TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),
    ],
)
def test_restarts_across_nodes_through_the_shared_rendezvous_store_are_refused(env, refused):
    """torchrun's environment, as its workers see it: restarts across nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (which makes TORCHELASTIC_USE_AGENT_STORE False); the elastic run below hangs without it."""
    if refused:
        with pytest.raises(UsageError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"):
            nodes.check_elastic(env)
    else:
        nodes.check_elastic(env)


@pytest.mark.parametrize(
    "script, env, message",
    [
        ("train_torchrun.sh", {"NNODES": "2", "NODE_RANK": "2"}, "--node_rank 2 is out of range for --nnodes 2"),
        ("train_deepspeed.sh", {"HOSTFILE": "bad", "MASTER_ADDR": "x"}, "--hostfile bad line 1 'node1 slots=eight'"),
    ],
)
def test_the_recipes_check_a_nodes_arguments_before_the_launcher_starts(script, env, message, tmp_path):
    """torchrun would wait forever for a node rank out of range; deepspeed answers a bad hostfile line with a
    traceback. The recipes stop first, in one line, exit 2."""
    (tmp_path / "bad").write_text("node1 slots=eight\n")
    env = {k: str(tmp_path / v) if k == "HOSTFILE" else v for k, v in env.items()}
    proc = subprocess.run(
        ["bash", str(REPO / "recipes" / script), "--output_dir", str(tmp_path / "run")],
        env=train_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("disco-clip node-check: ") and message in proc.stderr.replace(str(tmp_path) + "/", "")
    assert len(proc.stderr.strip().splitlines()) == 1


# --- the facts every node must share, and --save_on_each_node ---


def _parsed(tmp_path: Path, *extra: str):
    from disco_clip_ds.train.run import parse_args

    return parse_args(
        [
            "--output_dir", str(tmp_path / "run"), "--model_config", str(tmp_path / "model.json"), "--tokenizer_name",
            str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "shards"), "--report_to", "none",
            *extra,
        ]
    )  # fmt: skip


def test_save_on_each_node_is_refused_before_any_work(tmp_path):
    with pytest.raises(UsageError, match="--save_on_each_node: checkpoints are written once, into one --output_dir"):
        model_args, data_args, args = _parsed(tmp_path, "--save_on_each_node")
        nodes.check_nodes(args, lambda: node_facts(model_args, data_args, args))
    assert not (tmp_path / "run").exists()


def test_what_differs_between_two_nodes_is_named(tmp_path, monkeypatch):
    """The facts two nodes' ranks would gather: node 1 runs 2 ranks where node 0 runs 1 (torchrun's
    --nproc_per_node), has another learning rate, and sees another model config and a third shard at the same
    paths."""
    config = json.loads(TINY_CONFIG.read_text())
    (tmp_path / "model.json").write_text(json.dumps(config))
    (tmp_path / "shards").mkdir()
    for name in ("00000.tar", "00001.tar"):
        (tmp_path / "shards" / name).write_bytes(b"")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    node0 = node_facts(*_parsed(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    layers = config["text_config"]["num_hidden_layers"]
    config["text_config"]["num_hidden_layers"] += 1
    (tmp_path / "model.json").write_text(json.dumps(config))
    (tmp_path / "shards" / "00002.tar").write_bytes(b"")
    node1 = node_facts(*_parsed(tmp_path, "--learning_rate", "0.1"))
    ranks = [{"rank": 0, "node": 0, "host": "a", "facts": node0}, {"rank": 1, "node": 1, "host": "b", "facts": node1}]
    problem = nodes.launch_problem(ranks)
    assert problem.startswith(
        "the nodes were not started alike: rank 1 (node 1 on b) differs from rank 0 (node 0 on a)"
    )
    assert "--learning_rate 5e-05 -> 0.1" in problem and "ranks per node 1 -> 2" in problem
    assert f"the model (text_config.num_hidden_layers {layers} -> {layers + 1})" in problem
    assert "the training shards (count 2 -> 3, sha256 " in problem
    assert problem.endswith("start every node with the same arguments, files and software")
    assert len(problem.splitlines()) == 1
    assert nodes.launch_problem([ranks[0], {**ranks[0], "rank": 1}]) is None
    three = [*ranks, {**ranks[1], "rank": 2}]
    assert "(ranks 2 differ too): start every node" in nodes.launch_problem(three)


def test_other_weights_under_the_same_config_are_named(tmp_path):
    """A pretrained model folder at the same path with the same config.json but other weights: another run."""
    from disco_clip_ds.train.run import parse_args

    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text(TINY_CONFIG.read_text())
    argv = [
        "--output_dir", str(tmp_path / "run"), "--model_name_or_path", str(init), "--tokenizer_name",
        str(REPO / "recipes/tokenizer"), "--train_shards", str(tmp_path / "x.tar"), "--report_to", "none",
    ]  # fmt: skip
    facts = []
    for weights in (b"\0" * 64, b"\1" * 64):
        (init / "model.safetensors").write_bytes(weights)
        facts.append(node_facts(*parse_args(argv)))
    problem = nodes.launch_problem([{"rank": r, "node": r, "host": "h", "facts": f} for r, f in enumerate(facts)])
    assert " in the model files (model.safetensors " in problem and "config.json" not in problem


# --- launched: two nodes on this host ---

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
