"""`disco-clip node-check`, alone and as the recipes run it before their launcher: a bad hostfile or node rank is
one line, exit 2, no launcher started."""

import subprocess
from pathlib import Path

import pytest

from disco_clip_ds.commands.node_check import main as node_check_main
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.launch import (
    REPO,
    train_env,
)

HOSTFILES = {
    "good": "# two nodes\nnode1 slots=8\n\nnode2   slots=8\n",
    "bad slots": "node1 slots=8\nnode2 slots eight\n",
    "no slots": "node1\n",
    "twice": "node1 slots=8\nnode1 slots=4\n",
    "empty": "# nothing\n\n",
    "zero slots": "node1 slots=8\nnode2 slots=0\n",
    "latin-1": b"# n\xe9ud\nnode1 slots=8\n",  # 'nœud' as Latin-1 writes it
}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hostfile", "bad slots"], "line 2 'node2 slots eight': write one node per line, 'HOST slots=GPUS'"),
        (["--hostfile", "twice"], "line 2: node1 is listed twice; one line per node"),
        (["--hostfile", "empty"], "names no node"),
        (["--hostfile", "missing"], "--hostfile missing: no such file"),
        (["--hostfile", "good", "--node_rank", "2"], "--node_rank 2 is out of range for the 2 nodes of --hostfile"),
        (["--nnodes", "2", "--node_rank", "2"], "--node_rank 2 is out of range for --nnodes 2: give 0 to 1"),
        (["--nnodes", "2", "--node_rank", "-1"], "--node_rank -1 is out of range for --nnodes 2"),
        (["--nnodes", "0"], "--nnodes 0: give the number of nodes"),
        (["--hostfile", "zero slots"], "line 2: node2 slots=0 would start no rank; give its GPUs (at least 1)"),
        (["--hostfile", "latin-1"], "latin-1: line 1 is not UTF-8 text (byte 0xe9 at column 4): save it as UTF-8"),
    ],
)
def test_a_bad_hostfile_or_node_rank_is_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, text in HOSTFILES.items():
        Path(name).write_bytes(text if isinstance(text, bytes) else text.encode())
    assert run_main(node_check_main, argv, "disco-clip node-check") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


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
