"""Agreement across training ranks, before and after the Trainer exists: one rank decides, every rank learns the
verdict. In a single process (no process group, or a group of one) each function is a no-op."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from disco_clip_ds.errors import DiscoClipError


def is_distributed() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 outside a process group)."""
    return dist.get_world_size() if is_distributed() else 1


LAUNCH = (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))  # torchrun's variables, and their values alone


def launched() -> tuple[int, int, int]:
    """(rank, world size, local rank) as a launcher (torchrun) set them; (0, 1, 0) when not launched."""
    rank_, world, local = (int(os.environ.get(name, default)) for name, default in LAUNCH)
    return rank_, world, local


@contextlib.contextmanager
def process_group(world: int, device: torch.device):
    """A process group of `world` ranks for the duration (NCCL on GPUs, gloo on CPU), joined from the launcher's
    environment; nothing for one rank, or where a group is up already."""
    if world <= 1 or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def from_rank0(value):
    """`value` as computed on rank 0, on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gathered(value) -> list:
    """Every rank's `value`, in rank order, on every rank ([value] in one process)."""
    if not is_distributed():
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def all_true(flag: bool, device) -> bool:
    """True on every rank when `flag` is true on every rank."""
    if not is_distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def any_true(flag: bool, device) -> bool:
    """True on every rank when `flag` is true on any rank."""
    return not all_true(not flag, device)


def barrier() -> None:
    """Wait for every rank."""
    if is_distributed():
        dist.barrier()


def ranks_per_node() -> int:
    """This node's ranks, as the launcher says (torchrun's LOCAL_WORLD_SIZE, deepspeed's LOCAL_SIZE); 1 without one."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def decided_on_rank0(compute):
    """compute() on rank 0, its result on every rank. A DiscoClipError raised there is raised on every rank (the
    other ranks would otherwise wait for the result until the process group times out)."""
    result = None
    if rank() == 0:
        try:
            result = ("ok", compute())
        except DiscoClipError as error:
            result = ("error", error)
    kind, value = from_rank0(result)
    if kind == "error":
        raise value
    return value
