"""Several nodes on this host: one launcher per node, each in its own session (process group), all on 127.0.0.1.

A node is a launcher with its own node rank; two on one machine run the same code paths as two hosts, over
loopback instead of a network."""

from __future__ import annotations

import subprocess
from pathlib import Path

from disco_clip_ds.testing.launch import REPO, VENV_BIN, train_env
from disco_clip_ds.testing.ranks import free_port

MODULE = "disco_clip_ds.train"


def node_command(launcher: str, nnodes: int, node_rank: int, port: int, nproc=1, config=None, script=None) -> list:
    """Node NODE_RANK's command for `disco_clip_ds.train` (or SCRIPT, a file taking its arguments) on NNODES nodes
    of NPROC CPU ranks, master 127.0.0.1:PORT. launcher: torchrun | accelerate (`config`: its --config_file) |
    deepspeed (`config`: its hostfile; --no_ssh)."""
    master = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    if launcher == "torchrun":
        head = [VENV_BIN / "torchrun", "--nnodes", nnodes, "--node_rank", node_rank, "--nproc_per_node", nproc]
        cmd = [*head, *master, "-m", MODULE]
    elif launcher == "accelerate":
        cmd = [
            VENV_BIN / "accelerate", "launch", "--config_file", config,
            "--num_machines", nnodes, "--machine_rank", node_rank, "--num_processes", nnodes * nproc,
            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "-m", MODULE,
        ]  # fmt: skip
    elif launcher == "deepspeed":
        cmd = [VENV_BIN / "deepspeed", "--hostfile", config, "--no_ssh", "--node_rank", node_rank, *master]
        cmd += ["--module", MODULE]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    if script is not None:  # every launcher above ends with its module flag and the module
        cmd[-2:] = [script]
    return [str(c) for c in cmd]


def hostfile(folder: Path, nnodes: int, slots: int = 1) -> Path:
    """A DeepSpeed hostfile naming this host NNODES times (localhost, 127.0.0.1, 127.0.0.2, ...: distinct names)."""
    names = ["localhost", *(f"127.0.0.{i}" for i in range(1, nnodes))][:nnodes]
    path = folder / "hostfile"
    path.write_text("".join(f"{name} slots={slots}\n" for name in names))
    return path


def start_nodes(
    launcher: str, nnodes: int, train_args: list, log: Path, nproc=1, config=None, only=None, port=0, script=None, **env
):
    """Start the launchers of `disco_clip_ds.train TRAIN_ARGS` for NNODES nodes (or the node ranks in `only`), each
    in its own session, node R's output appended to LOG.nodeR.log, master port PORT (0: a free one), SCRIPT in place
    of the module if given: [Popen per node started]."""
    port, procs = port or free_port(), []
    for rank in range(nnodes) if only is None else only:
        with open(f"{log}.node{rank}.log", "a") as out:
            procs.append(
                subprocess.Popen(
                    node_command(launcher, nnodes, rank, port, nproc, config, script) + [str(a) for a in train_args],
                    cwd=REPO,
                    env=train_env(**env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs
