"""torch.distributed ranks in processes of their own on one machine: free ports, `run_ranks`, DeepSpeed's shm buffers
(and a private /dev/shm to count them in)."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from pathlib import Path

from disco_clip_ds.data.prep.fetch import environ
from disco_clip_ds.testing.zygote import import_time_env

_PORTS: set[int] = set()  # handed out since the last release_shm_buffers()
# What multiprocessing's fork server imports once (a rank it forks starts with them done) where a spawned rank imports
# them itself, seconds of CPU each: torch, and what the ranks of the tests import besides.
PRELOAD = ["torch", "torch.distributed", "transformers", "deepspeed", "disco_clip_ds.losses"]
_SERVER_ENV: dict | None = None  # import_time_env of the fork server, once started


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a master port or a web UI)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _PORTS.add(port)
    return port


def release_shm_buffers() -> None:
    """Unlink the /dev/shm buffers (one per rank) of DeepSpeed's CPU comm op of the runs started on a port from
    free_port() since the last call; call it once they ended. A training run unlinks its own as soon as every rank
    has mapped them (compat.unlink_deepspeed_shm_buffer): this catches those of runs killed before that, and of
    tests that start deepspeed.comm without it.

    Their names carry the master port (deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK): another session on the
    same machine keeps its own, which its live runs need (a rank waits, forever, for its peers' buffers to appear)."""
    from disco_clip_ds.compat import SHM_BUFFER_PREFIX

    for port in list(_PORTS):
        for buffer in Path("/dev/shm").glob(f"{SHM_BUFFER_PREFIX}_*_{port}_*"):
            buffer.unlink(missing_ok=True)
        _PORTS.discard(port)


def in_private_shm(folder: Path, command: list) -> list[str]:
    """COMMAND run with FOLDER bind-mounted on /dev/shm in a private mount namespace (`unshare --mount`; needs root):
    what the run leaves in /dev/shm is then exactly what is left in FOLDER, whatever other processes do there."""
    private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"']
    return [*private, str(folder), *(str(c) for c in command)]


class RanksFailed(RuntimeError):
    """One or more ranks raised or died; `errors` maps each such rank to its exception's text (with traceback)."""

    def __init__(self, errors: dict[int, str]):
        self.errors = dict(sorted(errors.items()))
        super().__init__("\n".join(f"[rank {r}] {msg}" for r, msg in self.errors.items()))


def _rank_entry(fn, rank, world_size, port, backend, threads, args, results, environment):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment: a forked rank has the fork server's, from when that started
    os.environ.update(environment)
    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # The queue's feeder thread starts with the first put: here, before `fn` can exhaust memory (or limit it, as
    # the loss benchmark does), so that an error can still be reported.
    results.put((rank, "started", None))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # Pickled to bytes here: a queued tensor would travel as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # report every failure with its rank, the parent decides
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads: int = 1,
    env: dict[str, str] | None = None,
    grace: float = 10.0,
) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` ranks of one process group (forked by multiprocessing's
    fork server, PRELOAD imported; spawned when `env` is given, see `_context`); return the results in rank order.

    `fn` must be a module-level function and its result picklable. Each rank gets MASTER_ADDR/PORT, RANK,
    LOCAL_RANK, WORLD_SIZE, `threads` torch threads and, for backend "nccl", GPU `rank`; `env` is added to the
    environment the ranks start with. Raises RanksFailed when a rank raises or dies (once the others have ended,
    or `grace` seconds later: they may wait forever in a collective), and TimeoutError when the ranks do not
    finish within `timeout` seconds. Every rank is stopped before this returns or raises.
    """
    ctx = _context(env)
    results = ctx.Queue()
    port = free_port()
    with environ(**(env or {})):  # a spawned process reads its environment (glibc's MALLOC_* too) when it starts
        environment = dict(os.environ)
        procs = [
            ctx.Process(
                target=_rank_entry, args=(fn, r, world_size, port, backend, threads, args, results, environment)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    outcomes: dict[int, tuple[str, bytes | str]] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size:
            if any(status == "error" for status, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() >= deadline:
                break
            try:
                rank, status, value = results.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                if status != "started":
                    outcomes[rank] = (status, value)
            except queue.Empty:
                for rank, p in enumerate(procs):  # a rank killed from outside (the OOM killer) reports nothing
                    if rank not in outcomes and p.exitcode not in (None, 0) and results.empty():
                        outcomes[rank] = ("error", f"died with exit code {p.exitcode} (killed: out of memory?)")
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcomes) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RanksFailed(errors)
    if len(outcomes) < world_size:
        missing = sorted(set(range(world_size)) - set(outcomes))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout}s (hang?)")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _context(env: dict[str, str] | None):
    """The multiprocessing context the ranks start in: spawn when `env` is given (a rank starts with it), else the fork
    server, PRELOAD imported once. The server is restarted when this process's environment has changed, since it
    started, in a variable read at start or import (zygote.IMPORT_TIME_PREFIXES): a rank it forked would not see the
    change, and the ranks of every later call would pay for spawning."""
    global _SERVER_ENV
    import multiprocessing as mp
    from multiprocessing import forkserver

    if env:
        return mp.get_context("spawn")
    current = import_time_env(os.environ)
    if _SERVER_ENV is not None and current != _SERVER_ENV:
        forkserver._forkserver._stop()  # the next start runs a new one, in the environment of now
        _SERVER_ENV = None
    ctx = mp.get_context("forkserver")
    if _SERVER_ENV is None:
        ctx.set_forkserver_preload(PRELOAD)
        _SERVER_ENV = current
    return ctx
