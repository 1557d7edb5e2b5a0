"""What the nodes of one run must share, checked on every rank before any work: the same launch (arguments, files,
software, ranks per node) and one output folder.

A node started with other arguments, another model or shard list, or other package versions would train a
different run in lock-step with the others, or fail hours later in a collective with no word of why; a node-local
--output_dir would leave each checkpoint in pieces across the nodes' disks (every rank writes its part into
OUTPUT_DIR/tmp-checkpoints and rank 0 publishes the folder once all parts are there), and no node could resume.
Both are refused at the start in one line, the same on every rank, naming the rank and node that differ.

Checkpoints are written once, into one shared folder: `--save_on_each_node` (each node's first rank writing the
weights into its own disk) is refused for the same reason.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from disco_clip_ds.distributed.ranks import (
    all_gathered,
    decided_on_rank0,
    from_rank0,
    is_distributed,
    rank,
    ranks_per_node,
)
from disco_clip_ds.errors import UsageError

logger = logging.getLogger("disco_clip_ds.distributed.nodes")

SEE_TIMEOUT_S = 5.0  # how long a rank looks for rank 0's token: a network filesystem may show a new file late


def check_nodes(args, facts: Callable[[], dict]) -> None:
    """Refuse, on every rank and before the model is built, an elastic launch whose restarts would hang
    (`check_elastic`), a launch whose ranks were not started alike (`launch_problem` of each rank's `facts()`, read
    only across ranks: train.node_facts), `--save_on_each_node`, and an --output_dir that some rank does not see
    (`check_shared_output_dir`). `args`: DiscoTrainingArguments (its world_size sets up the process group)."""
    check_elastic()
    _ = args.world_size  # the process group, under every launcher
    log_restart()
    if is_distributed():
        ranks = all_gathered(_node() | {"facts": facts()})
        decided_on_rank0(lambda: _refuse(launch_problem(ranks)))
    if args.save_on_each_node:
        raise UsageError(
            "--save_on_each_node: checkpoints are written once, into one --output_dir that every node sees (each "
            "rank writes its part and rank 0 publishes the checkpoint once every part is there); leave it out"
        )
    check_shared_output_dir(args.output_dir)


def log_restart(env=os.environ) -> None:
    """Say so, on each node whose workers torchrun restarted (its own count: TORCHELASTIC_RESTART_COUNT is kept per
    node), that the run goes on: with --resume_from_checkpoint latest, from its newest complete checkpoint."""
    count = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if count and int(env.get("LOCAL_RANK") or 0) == 0:
        logger.warning(
            "elastic restart %d of at most %s on this node (torchrun --max_restarts): the workers were started again "
            "after a failure",
            count,
            env.get("TORCHELASTIC_MAX_RESTARTS", "?"),
        )


def check_elastic(env=os.environ) -> None:
    """Refuse a torchrun launch across nodes that would restart its workers (--max_restarts) through torch's shared
    rendezvous store: the restarted workers of one node and those of another (restarted for the change of members)
    count their restarts apart and look for each other under different keys of that store, so the new process
    group never forms and the run hangs (pytorch/pytorch#135712; measured with torch 2.13). torchrun then needs
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (and a c10d rendezvous), which every rank sees in its environment."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    nodes = int(env.get("GROUP_WORLD_SIZE") or 1)
    if restarts > 0 and nodes > 1 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise UsageError(
            f"torchrun --max_restarts {restarts} across {nodes} nodes: start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and --rdzv_backend c10d on every node; with "
            "torch's shared rendezvous store the restarted workers never form their process group "
            "(pytorch/pytorch#135712)"
        )


# --- the same launch everywhere ---


def _node() -> dict:
    """This rank's place: its rank, node (torchrun's GROUP_RANK, deepspeed's CROSS_RANK) and host."""
    local = ranks_per_node()
    node = os.environ.get("GROUP_RANK") or os.environ.get("CROSS_RANK") or str(rank() // max(1, local))
    return {"rank": rank(), "node": int(node), "host": socket.gethostname()}


def _refuse(problem: str | None) -> None:
    if problem:
        raise UsageError(problem)


def launch_problem(ranks: list[dict]) -> str | None:
    """One line naming the first rank whose launch facts differ from rank 0's, what differs (rank 0's value ->
    its value), and the other ranks that differ; None when every rank's facts are rank 0's. `ranks`: each rank's
    place (rank, node, host) with its "facts" (train.node_facts)."""
    first, *rest = ranks
    odd = [r for r in rest if r["facts"] != first["facts"]]
    if not odd:
        return None
    other = odd[0]
    a, b = first["facts"], other["facts"]
    changes = [_difference(name, a.get(name), b.get(name)) for name in {**a, **b} if a.get(name) != b.get(name)]
    more = f" (ranks {', '.join(str(r['rank']) for r in odd[1:])} differ too)" if len(odd) > 1 else ""
    return (
        f"the nodes were not started alike: rank {other['rank']} ({_where(other)}) differs from rank 0 "
        f"({_where(first)}) in {'; '.join(changes)}{more}: start every node with the same arguments, files and "
        "software"
    )


def _where(r: dict) -> str:
    return f"node {r['node']} on {r['host']}"


def _difference(name: str, a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        inner = [f"{k} {_short(x)} -> {_short(y)}" for k, x, y in _leaves(a, b)]
        return f"{name} ({', '.join(inner[:4])}{', ...' if len(inner) > 4 else ''})"
    return f"{name} {_short(a)} -> {_short(b)}"


def _leaves(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """The differing values of two nested dicts, as ('text_config.hidden_size', a's, b's)."""
    found = []
    for k in {**a, **b}:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            found += _leaves(x, y, f"{prefix}{k}.")
        elif x != y:
            found.append((f"{prefix}{k}", x, y))
    return found


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- one output folder ---


def check_shared_output_dir(output_dir: str | os.PathLike) -> None:
    """Refuse (UsageError on every rank, before anything else is written) an --output_dir that some rank does not
    see as rank 0 does: rank 0 writes a token file there, every rank looks for it, rank 0 removes it (and the folder,
    when it made it for this). A no-op in one process."""
    if not is_distributed():
        return
    folder = Path(output_dir)
    token = from_rank0(uuid.uuid4().hex if rank() == 0 else None)
    path = folder / f".shared-{token}"
    made = False
    if rank() == 0 and (folder.is_dir() or not folder.exists()):  # a file there is the run lock's to refuse
        made = not folder.exists()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(token)
        except OSError:  # no rank sees it, rank 0 included: the run lock names why it cannot write there
            pass
    from_rank0(None)  # the token is written before any rank looks
    deadline = time.monotonic() + SEE_TIMEOUT_S
    while not (seen := _sees(path, token)) and time.monotonic() < deadline and folder.is_dir():
        time.sleep(0.2)
    blind = [r for r in all_gathered(_node() | {"sees": seen}) if not r["sees"]]
    if rank() == 0:
        path.unlink(missing_ok=True)
        if made and not any(folder.iterdir()):
            folder.rmdir()
    if blind and any(r["rank"] == 0 for r in blind):
        blind = []  # rank 0 could not write there: the run lock names why
    if blind:
        first = blind[0]
        more = f" (and ranks {', '.join(str(r['rank']) for r in blind[1:])})" if len(blind) > 1 else ""
        raise UsageError(
            f"--output_dir {output_dir} is not shared: rank {first['rank']} ({_where(first)}){more} does not see "
            "the file rank 0 wrote there; every node must see one --output_dir (NFS, Lustre, a cloud filesystem), "
            "where each rank writes its part of every checkpoint and rank 0 publishes it"
        )


def _sees(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False
