"""Shared test helpers: spawn N gloo ranks on CPU (and, from the data tests, the loopback image server)."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Pickled to bytes here: a queued tensor would travel as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # report every failure with its rank, the parent decides
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo ranks; return results in rank order.

    `fn` must be a module-level function. Raises RuntimeError listing each rank's exception, and
    TimeoutError (after killing the ranks) when any rank does not finish within `timeout` seconds.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s (hang?)") from None
            outcomes[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RuntimeError("\n".join(f"[rank {r}] {msg}" for r, msg in sorted(errors.items())))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


@pytest.fixture
def spawn_ranks():
    """The `run_ranks` helper as a fixture."""
    return run_ranks


# --- data: the loopback image server and the demo dataset (owned by the data-prep tests) ---


@pytest.fixture
def image_server():
    """A running `imageserver.ImageServer` on 127.0.0.1 (add routes with `.add(path, ...)`)."""
    from imageserver import ImageServer

    with ImageServer() as server:
        yield server


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """The digits demo dataset (`disco-clip data demo`), built once per test session; returns its folder."""
    from disco_clip_ds.data.demo import build_demo

    folder = tmp_path_factory.mktemp("demo")
    build_demo(folder)
    return folder
