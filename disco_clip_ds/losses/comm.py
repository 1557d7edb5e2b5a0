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


# The shape agreement's last result per (process group, loss): the local meta every rank held, recorded only when
# every rank held the same one. Every rank updates it from the same gathered values, so every rank holds the same
# entry (see check_inputs for the one assumption this rests on).
_AGREED: dict = {}


def check_inputs(image_features, text_features, scalars: dict, group, who: str) -> list[int]:
    """Validate shapes on every rank at once and return each rank's local batch size.

    `scalars` maps a name (e.g. "logit_scale") to its value, which must be a 0-dim tensor or a Python number.
    Each rank shares its shapes before any feature collective, so a bad input on one rank raises the same error
    on all ranks instead of leaving the others blocked in the exchange of features.

    The agreement (a collective and one device-to-host copy) runs once per shape, not on every call: when the last
    agreement of this loss on this group found every rank holding the same shapes and this rank's are unchanged,
    the ranks skip it. That decision is the same on every rank as long as ranks change shape together: a rank whose
    shapes equal the last uniform ones never meets a rank whose shapes changed. Training keeps to it (every rank's
    batch, accumulated or not, has the same rows at every step), and so does any sequence of calls whose ranks'
    shapes differ, which agree on every call. A caller that follows a uniform call with one in which only some
    ranks change (a finite loader's ragged last batch) calls `forget_agreements()` on every rank first.
    """
    _, world = rank_and_world(group)
    local = _local_meta(image_features, text_features, scalars)
    key = None
    if world > 1:
        # The group object itself (the default one for None): a group destroyed and created again is another key.
        key = (group if group is not None else dist.group.WORLD, who)
        if _AGREED.get(key) == local:
            return [local[2]] * world
    metas = _agree(local, image_features.device, group) if world > 1 else [local]
    problems = _problems(metas, list(scalars), world)
    if key is not None:  # every rank takes the same branch: it judges the same gathered metas
        if not problems and all(m == local for m in metas):
            _AGREED[key] = local
        else:
            _AGREED.pop(key, None)
    if problems:
        raise ValueError(f"{who}: bad input. " + "; ".join(problems))
    return [m[2] for m in metas]


def forget_agreements() -> None:
    """Make the next call of every loss agree on the shapes again (call it on every rank)."""
    _AGREED.clear()


def _local_meta(image_features, text_features, scalars: dict) -> list[int]:
    shape = lambda t: list(t.shape) if t.dim() == 2 else [-1, -1]
    scalar_dims = [v.dim() if torch.is_tensor(v) else 0 for v in scalars.values()]
    return [image_features.dim(), text_features.dim(), *shape(image_features), *shape(text_features), *scalar_dims]


def _agree(local: list[int], device, group) -> list[list[int]]:
    """Every rank's meta, in rank order."""
    meta = torch.tensor(local, device=device)
    gathered = meta.new_empty(rank_and_world(group)[1] * meta.numel())  # gloo wants the flat layout
    compat.all_gather_single(gathered, meta, group=group)
    # The one host sync of the agreement, once per shape: the sizes decide the shapes of every buffer that follows.
    return gathered.view(-1, meta.numel()).tolist()


def _problems(metas: list[list[int]], names: list[str], world: int) -> list[str]:
    problems = []
    for rank, (nd_i, nd_t, b_i, d_i, b_t, d_t, *dims) in enumerate(metas):
        where = f"rank {rank}: " if world > 1 else ""
        for name, nd in zip(names, dims):
            if nd != 0:
                problems.append(f"{where}{name} must be a 0-dim tensor or a number, got {nd}-D")
        if nd_i != 2 or nd_t != 2:
            problems.append(f"{where}features must be 2-D (batch, dim); got image {nd_i}-D and text {nd_t}-D")
        elif (b_i, d_i) != (b_t, d_t):
            problems.append(f"{where}image features {(b_i, d_i)} and text features {(b_t, d_t)} differ in shape")
    dims = {m[3] for m in metas if m[0] == 2}
    if not problems and len(dims) > 1:
        problems.append(f"feature dim differs between ranks: {[m[3] for m in metas]}; all ranks must use one model")
    return problems


def upstream_per_column(grad_total: torch.Tensor, sizes: list[int], group, total: int):
    """The upstream gradient of this rank's loss (1 element, fp32) and, per column, that of the rank owning the text:
    a column's term is in its owner's loss. One all-gather of N floats, kept on the device."""
    g = grad_total.float().reshape(1)
    world = rank_and_world(group)[1]
    if world == 1:
        return g, g.expand(total)
    owners = g.new_empty(world)
    compat.all_gather_single(owners, g, group=group)
    return g, owners.repeat_interleave(torch.tensor(sizes, device=owners.device), output_size=total)


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group=None, tag: int = 0) -> list:
    """Post the send of `send` to the next rank and the receive into `recv` from the previous one (a ring step);
    returns the requests to wait on. Empty tensors are neither sent nor received: every rank knows the sizes."""
    rank, world = rank_and_world(group)
    peer = lambda r: dist.get_global_rank(group, r % world) if group is not None else r % world
    ops = [dist.P2POp(dist.isend, send, peer(rank + 1), group, tag)] if send.numel() else []
    ops += [dist.P2POp(dist.irecv, recv, peer(rank - 1), group, tag)] if recv.numel() else []
    return dist.batch_isend_irecv(ops) if ops else []
