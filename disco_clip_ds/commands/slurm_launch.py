"""`disco-clip slurm-launch`: start this node's launcher of a multi-node job from SLURM's variables.

`srun` runs one task per node (`--ntasks-per-node=1`); each task becomes (exec) the launcher with this node's rank
and the job's master address (distributed.slurm.launch_command). Exec rather than a child process, so that the
signals SLURM sends the task (preemption, `--signal`) reach the launcher itself. recipes/slurm_multinode.sbatch
uses it.
"""

from __future__ import annotations

import os
import sys

from disco_clip_ds.cli import ArgumentParser, DefaultsOnce
from disco_clip_ds.distributed.slurm import ELASTIC_ENV, LAUNCHERS, launch_command
from disco_clip_ds.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    """Parse `[options] [--] TRAIN_ARGS` and exec this node's launcher (does not return when it starts). Every
    argument that is not one of ours is a training argument (`disco-clip` passes the words after `--` on without it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None)
    parser = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip slurm-launch",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--launcher", default="torchrun", choices=LAUNCHERS)
    parser.add_argument("--nproc_per_node", type=int, default=1, help="ranks per node (GPUs per node)")
    parser.add_argument(
        "--master_port",
        default=os.environ.get("MASTER_PORT") or "29500",
        help="the rendezvous port, 1 to 65535 (default: $MASTER_PORT, else 29500)",
    )
    args, rest = parser.parse_known_args(ours)
    train_args = rest if train_args is None else [*rest, *train_args]
    if not train_args:
        raise UsageError("give the training arguments after `--`, e.g. -- --output_dir runs/x --train_shards ...")
    command = launch_command(train_args, os.environ, args.launcher, args.nproc_per_node, args.master_port)
    print("slurm-launch:", " ".join(command), flush=True)
    os.execve(command[0], command, {**os.environ, **ELASTIC_ENV})
    return 0  # not reached
