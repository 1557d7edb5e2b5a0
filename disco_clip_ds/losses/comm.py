"""Autograd collectives for the loss: all-gather rows from every rank (uneven counts allowed) in forward, and sum
their gradient back to the owner with a reduce-scatter in backward. Torch only."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from disco_clip_ds import compat


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


def check_inputs(image_features, text_features, scalars: dict, group, who: str) -> list[int]:
    """Validate shapes on every rank at once and return each rank's local batch size.

    `scalars` maps a name (e.g. "logit_scale") to its value, which must be a 0-dim tensor or a Python number.
    Each rank shares its shapes before any feature collective, so a bad input on one rank raises the same error
    on all ranks instead of leaving the others blocked in the exchange of features.
    """
    _, world = rank_and_world(group)
    shape = lambda t: list(t.shape) if t.dim() == 2 else [-1, -1]
    scalar_dims = [v.dim() if torch.is_tensor(v) else 0 for v in scalars.values()]
    meta = torch.tensor(
        [image_features.dim(), text_features.dim(), *shape(image_features), *shape(text_features), *scalar_dims],
        device=image_features.device,
    )
    if world > 1:
        gathered = meta.new_empty(world * meta.numel())  # gloo wants the flat layout
        compat.all_gather_single(gathered, meta, group=group)
        gathered = gathered.view(world, -1)
    else:
        gathered = meta[None]
    metas = gathered.tolist()  # one device-to-host copy for every rank's shapes
    problems = []
    for rank, (nd_i, nd_t, b_i, d_i, b_t, d_t, *dims) in enumerate(metas):
        where = f"rank {rank}: " if world > 1 else ""
        for name, nd in zip(scalars, dims):
            if nd != 0:
                problems.append(f"{where}{name} must be a 0-dim tensor or a number, got {nd}-D")
        if nd_i != 2 or nd_t != 2:
            problems.append(f"{where}features must be 2-D (batch, dim); got image {nd_i}-D and text {nd_t}-D")
        elif (b_i, d_i) != (b_t, d_t):
            problems.append(f"{where}image features {(b_i, d_i)} and text features {(b_t, d_t)} differ in shape")
    dims = {m[3] for m in metas if m[0] == 2}
    if not problems and len(dims) > 1:
        problems.append(f"feature dim differs between ranks: {[m[3] for m in metas]}; all ranks must use one model")
    if problems:
        raise ValueError(f"{who}: bad input. " + "; ".join(problems))
    return [m[2] for m in metas]


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group=None, tag: int = 0) -> list:
    """Post the send of `send` to the next rank and the receive into `recv` from the previous one (a ring step);
    returns the requests to wait on. Empty tensors are neither sent nor received: every rank knows the sizes."""
    rank, world = rank_and_world(group)
    peer = lambda r: dist.get_global_rank(group, r % world) if group is not None else r % world
    ops = [dist.P2POp(dist.isend, send, peer(rank + 1), group, tag)] if send.numel() else []
    ops += [dist.P2POp(dist.irecv, recv, peer(rank - 1), group, tag)] if recv.numel() else []
    return dist.batch_isend_irecv(ops) if ops else []
