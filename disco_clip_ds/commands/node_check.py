"""`disco-clip node-check`: a node's launch arguments (hostfile, node rank), checked before its launcher starts.

The launchers' own checks are a traceback (deepspeed: a bad hostfile line, a --node_rank out of range) or a wait
without end (torchrun: a --node_rank out of range waits for a node that never comes); this says the same in one
line (distributed.slurm.check_node_launch), and the recipes run it first.
"""

from __future__ import annotations

from disco_clip_ds.cli import ArgumentParser, DefaultsOnce
from disco_clip_ds.distributed.slurm import check_node_launch


def main(argv: list[str] | None = None) -> int:
    """`disco-clip node-check [--hostfile H] [--nnodes N] [--node_rank R]`: exit 0 when they can work, else one
    line and exit 2."""
    parser = ArgumentParser(
        formatter_class=DefaultsOnce, prog="disco-clip node-check", description=check_node_launch.__doc__
    )
    parser.add_argument("--hostfile")
    parser.add_argument("--nnodes")
    parser.add_argument("--node_rank", type=int)
    args = parser.parse_args(argv)
    check_node_launch(args.nnodes, args.node_rank, args.hostfile)
    return 0
