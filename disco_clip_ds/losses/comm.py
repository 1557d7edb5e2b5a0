"""Autograd collectives for the loss: all-gather rows from every rank (uneven counts allowed) in forward, and sum
their gradient back to the owner with a reduce-scatter in backward. Torch only."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import compat


def rank_and_world(group=None) -> tuple[int, int]:
    """This process's rank in `group` and the group's size; (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class _GatherRows(torch.autograd.Function):
    """All-gather rows in forward (uneven counts allowed); reduce-scatter (sum) their gradient in backward.

    A SUM reduce-scatter returns to each rank exactly the gradient of every rank's loss w.r.t. its rows and
    moves half the bytes of the all-reduce-then-slice that the DisCo paper uses. Several tensors (image and
    text) go through one call, each into its own contiguous (B, d) buffer: no packing copies.
    """

    @staticmethod
    def forward(ctx, sizes: list[int], group, *locals_: torch.Tensor):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank_and_world(group)[0], group
        return tuple(_gather_rows(t, sizes, group) for t in locals_)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *(_reduce_scatter_rows(g, ctx.sizes, ctx.rank, ctx.group) for g in grads))


def _gather_rows(local: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    pad = max(sizes)
    padded = F.pad(local, (0, 0, 0, pad - local.shape[0])) if local.shape[0] < pad else local.contiguous()
    out = local.new_empty((len(sizes) * pad, local.shape[1]))
    compat.all_gather_single(out, padded, group=group)
    if pad * len(sizes) == sum(sizes):
        return out
    return torch.cat([out[r * pad : r * pad + n] for r, n in enumerate(sizes)])


def _reduce_scatter_rows(grad: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    pad = max(sizes)
    grad = grad.contiguous()
    if pad * len(sizes) != sum(sizes):  # re-pad each rank's block to the common size
        grad = torch.cat([F.pad(g, (0, 0, 0, pad - g.shape[0])) for g in grad.split(sizes)])
    out = grad.new_empty((pad, grad.shape[1]))
    compat.reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=group)
    return out[: sizes[rank]]


def gather_features(*local: torch.Tensor, sizes: list[int], group=None) -> tuple[torch.Tensor, ...]:
    """All ranks' rows of each tensor, in rank order; differentiable (gradient summed back to the owner)."""
    if rank_and_world(group)[1] == 1:
        return local
    return _GatherRows.apply(sizes, group, *local)
