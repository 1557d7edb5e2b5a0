"""Reaching the other ranks: the collective timeout, and a lost master or peer as one line.

`--ddp_timeout` (seconds) bounds the connection to the master's store and every collective after it, on every
launcher path (compat.init_cpu_process_group, compat.init_deepspeed_comm). Two ways of losing the others become a
`PeerError` (exit code 1) whose message names what to check:

- joining: the master address and port answer nobody (`DistNetworkError` once the timeout has passed), or rank 0
  waited that long for ranks that never came (`DistStoreError`);
- training: a collective that did not finish within the timeout (a peer frozen, hung, or cut off: gloo's "Timed
  out waiting ... for recv") or whose peer closed its connection (a peer that died: at once).

The launchers' own rendezvous comes before any of this: torchrun, and accelerate which runs it, waits for the other
nodes' launchers `--rdzv_conf timeout=S` (900 s by default); the deepspeed launcher has none, its ranks connect
themselves.
"""

from __future__ import annotations

import contextlib
import os
import re

from disco_clip_ds.errors import DiscoClipError, PeerError


def _master() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


_CHECK = (
    "check that every node was started with the same --master_addr and --master_port, that this address is the "
    "master node's as seen from here and the port is open between the nodes, and, on hosts with several network "
    "interfaces, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"
)


@contextlib.contextmanager
def joining(timeout_s: float):
    """Around process-group setup: a master nobody answers, or ranks that never come, is a PeerError."""
    import torch.distributed as dist

    if not dist.is_initialized():
        _wait_for_master(timeout_s)
    try:
        yield
    except dist.DistNetworkError as error:
        raise PeerError(
            f"no master answered at {_master()} within --ddp_timeout {timeout_s:g} s: is the master node (node rank "
            f"0) running? {_CHECK}"
        ) from error
    except dist.DistStoreError as error:
        world = os.environ.get("WORLD_SIZE", "?")
        raise PeerError(
            f"not all {world} ranks joined the master at {_master()} within --ddp_timeout {timeout_s:g} s: start "
            f"every node (--nnodes); {_CHECK}"
        ) from error


def _wait_for_master(timeout_s: float) -> None:
    """In a launched rank other than 0: wait up to the timeout for the master's port to accept a connection.

    torch's store client does the same, but logs every failed try with a C++ backtrace (some 20 lines each) before
    its error; probing first leaves one line, and torch then connects at once."""
    import socket
    import time

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names) or os.environ["RANK"] == "0" or os.environ["WORLD_SIZE"] == "1":
        return
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(address, timeout=max(1.0, min(10.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise PeerError(
                    f"no master answered at {_master()} within --ddp_timeout {timeout_s:g} s ({error}): is the "
                    f"master node (node rank 0) running? {_CHECK}"
                ) from error
            time.sleep(1.0)


# What gloo (and NCCL's watchdog) raise when a peer stops answering or goes away; any other error is not ours to map.
_LOST = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe")


@contextlib.contextmanager
def watching(timeout_s: float):
    """Around training: a collective that timed out, or whose peer vanished, is a PeerError on this rank."""
    import torch.distributed as dist

    try:
        yield
    except (dist.DistError, RuntimeError) as error:
        text = str(error)
        if isinstance(error, DiscoClipError) or not any(lost in text.lower() for lost in _LOST):
            raise
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
        first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # without gloo's source location and advice
        raise PeerError(
            f"lost contact with another rank (a collective got no answer within --ddp_timeout {timeout_s:g} s, or "
            f"its peer closed the connection: {first[:160]}); look at the other nodes' logs for the first failure, "
            "then resume every node with --resume_from_checkpoint latest"
        ) from error
