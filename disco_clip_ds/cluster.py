"""`disco-clip slurm-launch`: start this node's launcher of a multi-node job from SLURM's variables.

`srun` runs one task per node (`--ntasks-per-node=1`); each task becomes (exec) the launcher with this node's rank
and the job's master address: the first host of SLURM_JOB_NODELIST (expanded with python-hostlist, the compressed
`gpu[01-04,07]` form included), SLURM_NODEID as the node rank, SLURM_JOB_NUM_NODES nodes. Exec rather than a
child process, so that the signals SLURM sends the task (preemption, `--signal`) reach the launcher itself.
recipes/slurm_multinode.sbatch uses it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .errors import UsageError

LAUNCHERS = ("torchrun", "deepspeed")


def slurm_nodes(env=os.environ) -> tuple[list[str], int]:
    """(the job's hosts in order, this node's rank) from SLURM's variables; UsageError naming what is wrong."""
    import hostlist

    missing = [name for name in ("SLURM_JOB_NODELIST", "SLURM_NODEID") if not env.get(name)]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: run this under srun inside a SLURM job (one task per node)")
    try:
        hosts = hostlist.expand_hostlist(env["SLURM_JOB_NODELIST"])
    except hostlist.BadHostlist as e:
        raise UsageError(f"SLURM_JOB_NODELIST {env['SLURM_JOB_NODELIST']!r} is not a host list: {e}") from None
    count = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if count is not None and int(count) != len(hosts):
        raise UsageError(f"SLURM_JOB_NUM_NODES {count} but SLURM_JOB_NODELIST names {len(hosts)} hosts: {hosts}")
    node = int(env["SLURM_NODEID"])
    if not 0 <= node < len(hosts):
        raise UsageError(f"SLURM_NODEID {node} is out of range for {len(hosts)} nodes ({', '.join(hosts)})")
    return hosts, node


def launch_command(
    train_args: list[str],
    env=os.environ,
    launcher: str = "torchrun",
    nproc_per_node: int = 1,
    master_port: int = 29500,
    python: str = sys.executable,
) -> list[str]:
    """The command that starts this node's ranks of `disco-clip train TRAIN_ARGS` across the job's nodes."""
    hosts, node = slurm_nodes(env)
    if nproc_per_node < 1:
        raise UsageError(f"--nproc_per_node {nproc_per_node}: give the ranks (GPUs) per node, at least 1")
    bin_dir = Path(python).parent
    common = ["--node_rank", str(node), "--master_addr", hosts[0], "--master_port", str(master_port)]
    if launcher == "torchrun":
        head = [str(bin_dir / "torchrun"), "--nnodes", str(len(hosts)), "--nproc_per_node", str(nproc_per_node)]
        return [*head, *common, "-m", "disco_clip_ds.train", *train_args]
    if launcher == "deepspeed":
        # deepspeed's multi-node launch reads a hostfile; --no_ssh starts only this node's ranks, as srun wants
        hostfile = Path(tempfile.mkdtemp(prefix="disco-clip-hosts-")) / "hostfile"
        hostfile.write_text("".join(f"{host} slots={nproc_per_node}\n" for host in hosts))
        head = [str(bin_dir / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh"]
        return [*head, *common, "--module", "disco_clip_ds.train", *train_args]
    raise UsageError(f"--launcher {launcher}: one of {', '.join(LAUNCHERS)}")


def main(argv: list[str] | None = None) -> int:
    """Parse `[options] [--] TRAIN_ARGS` and exec this node's launcher (does not return when it starts). Every
    argument that is not one of ours is a training argument (`disco-clip` passes the words after `--` on without it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None)
    parser = argparse.ArgumentParser(
        prog="disco-clip slurm-launch", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--launcher", default="torchrun", choices=LAUNCHERS)
    parser.add_argument("--nproc_per_node", type=int, default=1, help="ranks per node (GPUs per node)")
    parser.add_argument(
        "--master_port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)), help="default: $MASTER_PORT"
    )
    args, rest = parser.parse_known_args(ours)
    train_args = rest if train_args is None else [*rest, *train_args]
    if not train_args:
        raise UsageError("give the training arguments after `--`, e.g. -- --output_dir runs/x --train_shards ...")
    command = launch_command(train_args, os.environ, args.launcher, args.nproc_per_node, args.master_port)
    print("slurm-launch:", " ".join(command), flush=True)
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    from .errors import run_main

    sys.exit(run_main(main, None, "disco-clip slurm-launch"))
