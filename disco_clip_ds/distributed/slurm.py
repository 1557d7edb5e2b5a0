"""A node's launch of a multi-node job: its launcher's command from SLURM's variables (`launch_command`, what
`disco-clip slurm-launch` execs), and its launch arguments (hostfile, node rank) checked before its launcher starts
(`check_node_launch`, `disco-clip node-check`). The commands themselves are commands/slurm_launch.py and
commands/node_check.py.

`srun` runs one task per node (`--ntasks-per-node=1`); each task becomes (exec) the launcher with this node's rank
and the job's master address: the first host of SLURM_JOB_NODELIST (expanded with python-hostlist, the compressed
`gpu[01-04,07]` form included), SLURM_NODEID as the node rank, SLURM_JOB_NUM_NODES nodes. Exec rather than a
child process, so that the signals SLURM sends the task (preemption, `--signal`) reach the launcher itself.
recipes/slurm_multinode.sbatch uses it.

The launchers' own checks of a node's arguments are a traceback (deepspeed: a bad hostfile line, a --node_rank out of
range) or a wait without end (torchrun: a --node_rank out of range waits for a node that never comes):
`check_node_launch` says the same in one line, and the recipes run it first.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import tempfile
from pathlib import Path

from disco_clip_ds.errors import UsageError
from disco_clip_ds.texts import read_text

LAUNCHERS = ("torchrun", "deepspeed")
# torchrun with restarts across nodes: the shared rendezvous store hangs the restarted workers (nodes.check_elastic)
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # deepspeed 0.19's rule (launcher/runner.py _parse_hostfile)
HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # RFC 1123, and '_' as /etc/hosts allows


def read_hostfile(path: str | os.PathLike) -> list[tuple[str, int]]:
    """The (host, slots) lines of a DeepSpeed hostfile, by DeepSpeed's own rule (`HOSTFILE_LINE`, '#' comments and
    blank lines skipped, a host once); UsageError naming the line that breaks it. Not deepspeed's parser itself:
    importing deepspeed to read two columns costs seconds and prints its accelerator banner."""
    lines = read_text(path, "--hostfile").splitlines()  # the one reader: a missing file, text that is not UTF-8
    hosts: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.search(line)
        if not match:
            raise UsageError(f"--hostfile {path} line {number} {line!r}: write one node per line, 'HOST slots=GPUS'")
        if match.group(1) in hosts:
            raise UsageError(f"--hostfile {path} line {number}: {match.group(1)} is listed twice; one line per node")
        if int(match.group(2)) < 1:
            raise UsageError(
                f"--hostfile {path} line {number}: {match.group(1)} slots={match.group(2)} would start no rank; give "
                "its GPUs (at least 1), or leave the node out"
            )
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise UsageError(f"--hostfile {path} names no node: write one node per line, 'HOST slots=GPUS'")
    return list(hosts.items())


def check_node_launch(nnodes: str | None = None, node_rank: int | None = None, hostfile: str | None = None) -> None:
    """This node's launch arguments: a hostfile DeepSpeed reads (`read_hostfile`), and a --node_rank within the
    nodes (--nnodes, or the hostfile's lines). UsageError in one line; an elastic range (--nnodes 1:4) assigns ranks
    itself and is not checked."""
    count = len(read_hostfile(hostfile)) if hostfile else None
    where = f"the {count} nodes of --hostfile {hostfile}" if hostfile else f"--nnodes {nnodes}"
    if count is None and nnodes is not None and ":" not in nnodes:
        if not nnodes.isdigit() or int(nnodes) < 1:
            raise UsageError(f"--nnodes {nnodes}: give the number of nodes (or MIN:MAX for an elastic launch)")
        count = int(nnodes)
    if node_rank is not None and count is not None and not 0 <= node_rank < count:
        raise UsageError(f"--node_rank {node_rank} is out of range for {where}: give 0 to {count - 1}, one per node")


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
    bad = [host for host in hosts if not is_host(host)]
    if bad:
        raise UsageError(f"SLURM_JOB_NODELIST {env['SLURM_JOB_NODELIST']!r} names {bad[0]!r}, not a host name")
    name = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
    count = env.get(name)
    if count and (number := _number(name, count)) != len(hosts):
        raise UsageError(f"{name} {number} but SLURM_JOB_NODELIST names {len(hosts)} hosts: {hosts}")
    node = _number("SLURM_NODEID", env["SLURM_NODEID"])
    if not 0 <= node < len(hosts):
        raise UsageError(f"SLURM_NODEID {node} is out of range for {len(hosts)} nodes ({', '.join(hosts)})")
    return hosts, node


def _number(name: str, value: str) -> int:
    """A SLURM variable's whole number; UsageError naming it otherwise."""
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        raise UsageError(f"{name} {value!r} is not a whole number: run this under srun inside a SLURM job")
    return int(text)


def is_host(name: str) -> bool:
    """Whether `name` is a host name (labels of letters, digits, '-' and '_', none starting or ending with '-', at
    most 253 characters) or an IP address: what torchrun and deepspeed can reach as --master_addr."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return len(name) <= 253 and all(HOST_LABEL.fullmatch(label) for label in name.split("."))


def check_port(port) -> int:
    """A rendezvous port (1 to 65535) from --master_port or $MASTER_PORT; UsageError naming it otherwise."""
    text = str(port).strip()
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
        raise UsageError(f"--master_port / MASTER_PORT {port!r}: give a TCP port, 1 to 65535")
    return int(text)


def launch_command(
    train_args: list[str],
    env=os.environ,
    launcher: str = "torchrun",
    nproc_per_node: int = 1,
    master_port: int | str = 29500,
    python: str = sys.executable,
) -> list[str]:
    """The command that starts this node's ranks of `disco-clip train TRAIN_ARGS` across the job's nodes."""
    hosts, node = slurm_nodes(env)
    master_port = check_port(master_port)
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
