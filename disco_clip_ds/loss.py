"""The exact distributed CLIP loss: DisCo decomposition and a tiled successor. Torch only.

Notation: rank r holds b_r image rows x_i and text rows y_i (L2-normalised); X, Y are all ranks' rows in rank
order, B = sum_r b_r, s = logit_scale and S = s X Y^T. The global CLIP loss is

    L = (CE(S, diag) + CE(S^T, diag)) / 2 = 1/(2B) * sum_i [lse_j(S_ij) + lse_j(S_ji) - 2 S_ii].

Rank r returns l_r = N/(2B) * (its rows' terms), so mean_r l_r = L. The gathered features' gradient is summed
back to their owner with a reduce-scatter, so rank r's features receive d(sum_r l_r)/d(rows of r) = N dL/d(rows):
ordinary data-parallel gradient averaging (DDP, DeepSpeed, FSDP) then gives every encoder parameter exactly
dL/dtheta, and logit_scale, which every rank holds, the mean of its local gradients, which is dL/ds too. (The
published DisCo code averages in its backward and so gives the encoders 1/N of this.)

Two implementations of the per-rank term:
- "disco": the paper's decomposition, a b x B logit block per direction through plain autograd.
- "tiled": never holds a b x B block. It walks its rows in tiles of `chunk_size` rows against all B columns.
  The loss is a sum of row log-sum-exps whose upstream gradient is one scalar, so each tile's gradient
  (softmax x keys) is accumulated in the same pass as its log-sum-exp and only scaled in backward: no logits are
  stored and none recomputed, 3 matmuls per tile like plain autograd, and peak extra memory O(B*d + tile).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IMPLS = ("disco", "tiled")
# torch 2.13 renamed the single-tensor collectives; the old names still work there but warn.
_all_gather_single = getattr(dist, "all_gather_single", getattr(dist, "all_gather_into_tensor", None))
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", getattr(dist, "reduce_scatter_tensor", None))
# Logits per tile (rows x B, fp32) when chunk_size is None: 2M -> 8 MiB. Measured on CPU (B = 8192, d = 512):
# tiles of 128-1024 rows all beat the plain b x B block; below ~64 rows the matmuls get inefficient.
DEFAULT_TILE_ELEMENTS = 1 << 21


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _check_inputs(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale, group) -> list[int]:
    """Validate shapes on every rank at once and return each rank's local batch size.

    Each rank shares its shapes before any feature collective, so a bad input on one rank raises the same
    error on all ranks instead of leaving the others blocked in the all-gather.
    """
    _, world = _world(group)
    shape = lambda t: list(t.shape) if t.dim() == 2 else [-1, -1]  # noqa: E731
    scale_dim = logit_scale.dim() if torch.is_tensor(logit_scale) else 0
    meta = torch.tensor(
        [image_features.dim(), text_features.dim(), *shape(image_features), *shape(text_features), scale_dim],
        device=image_features.device,
    )
    if world > 1:
        metas = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(metas, meta, group=group)
    else:
        metas = [meta]
    problems = []
    for rank, (nd_i, nd_t, b_i, d_i, b_t, d_t, nd_s) in enumerate(m.tolist() for m in metas):
        where = f"rank {rank}: " if world > 1 else ""
        if nd_s != 0:
            problems.append(f"{where}logit_scale must be a 0-dim tensor (the multiplier, e.g. model.logit_scale.exp()), got {nd_s}-D")
        if nd_i != 2 or nd_t != 2:
            problems.append(f"{where}features must be 2-D (batch, dim); got image {nd_i}-D and text {nd_t}-D")
        elif (b_i, d_i) != (b_t, d_t):
            problems.append(f"{where}image features {(b_i, d_i)} and text features {(b_t, d_t)} differ in shape")
    dims = {m[3].item() for m in metas if m[0] == 2}
    if not problems and len(dims) > 1:
        problems.append(f"feature dim differs between ranks: {[m[3].item() for m in metas]}; all ranks must use one model")
    if problems:
        raise ValueError("DiscoClipLoss: bad input. " + "; ".join(problems))
    return [m[2].item() for m in metas]


class _GatherRows(torch.autograd.Function):
    """All-gather rows in forward (uneven counts allowed); reduce-scatter (sum) their gradient in backward.

    A SUM reduce-scatter returns to each rank exactly the gradient of every rank's loss w.r.t. its rows and
    moves half the bytes of the all-reduce-then-slice that the DisCo paper uses. Several tensors (image and
    text) go through one call, each into its own contiguous (B, d) buffer: no packing copies.
    """

    @staticmethod
    def forward(ctx, sizes: list[int], group, *locals_: torch.Tensor):
        ctx.sizes, ctx.rank, ctx.group = sizes, _world(group)[0], group
        return tuple(_gather_rows(t, sizes, group) for t in locals_)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *(_reduce_scatter_rows(g, ctx.sizes, ctx.rank, ctx.group) for g in grads))


def _gather_rows(local: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    pad = max(sizes)
    padded = F.pad(local, (0, 0, 0, pad - local.shape[0])) if local.shape[0] < pad else local.contiguous()
    out = local.new_empty((len(sizes) * pad, local.shape[1]))
    _all_gather_single(out, padded, group=group)
    if pad * len(sizes) == sum(sizes):
        return out
    return torch.cat([out[r * pad : r * pad + n] for r, n in enumerate(sizes)])


def _reduce_scatter_rows(grad: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    pad = max(sizes)
    grad = grad.contiguous()
    if pad * len(sizes) != sum(sizes):  # re-pad each rank's block to the common size
        grad = torch.cat([F.pad(g, (0, 0, 0, pad - g.shape[0])) for g in grad.split(sizes)])
    out = grad.new_empty((pad, grad.shape[1]))
    _reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=group)
    return out[: sizes[rank]]


def gather_features(*local: torch.Tensor, sizes: list[int], group=None) -> tuple[torch.Tensor, ...]:
    """All ranks' rows of each tensor, in rank order; differentiable (gradient summed back to the owner)."""
    if _world(group)[1] == 1:
        return local
    return _GatherRows.apply(sizes, group, *local)


class _TiledLogSumExp(torch.autograd.Function):
    """sum_i logsumexp_j(scale * q_i . k_j) in row tiles, with the gradient built in the same pass."""

    @staticmethod
    def forward(ctx, queries: torch.Tensor, keys: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
        need_q, need_k, need_s = ctx.needs_input_grad[:3]
        need_grad = need_q or need_k or need_s
        keys32, s = keys.float(), float(scale)
        total = torch.zeros((), dtype=torch.float32, device=queries.device)
        grad_q = torch.empty(queries.shape, dtype=torch.float32, device=queries.device) if need_q else None
        grad_k = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device) if need_k else None
        grad_s = torch.zeros((), dtype=torch.float32, device=queries.device)
        for start in range(0, queries.shape[0], chunk):
            q = queries[start : start + chunk].float()
            logits = (q @ keys32.T).mul_(s)  # (rows, B), in fp32 whatever the input dtype
            row_max = logits.amax(dim=1, keepdim=True)
            prob = logits.sub_(row_max).exp_()  # one exp pass serves the log-sum-exp and the softmax
            row_sum = prob.sum(dim=1, keepdim=True)
            total += (row_max + row_sum.log()).sum()
            if not need_grad:
                continue
            prob.div_(row_sum)
            if need_q or need_s:
                prob_keys = prob @ keys32  # d lse_i / d q_i = s * prob_keys_i
                if need_q:
                    grad_q[start : start + chunk] = prob_keys * s
                if need_s:  # d lse_i / d s = sum_j prob_ij q_i.k_j = q_i . prob_keys_i
                    grad_s += torch.vdot(q.view(-1), prob_keys.view(-1))
            if need_k:
                grad_k.addmm_(prob.T, q, alpha=s)
        ctx.grads = (grad_q, grad_k, grad_s if need_s else None)
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("the tiled CLIP loss supports one backward per forward (retain_graph re-use is not supported)")
        # Scaled in place: the buffers are ours, and a copy of the (B, d) key gradient would double its memory.
        grads, ctx.grads = ctx.grads, None
        return (*(None if g is None else g.mul_(grad_total).to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None)


def default_chunk_size(total_batch: int) -> int:
    """Rows per tile so that one tile of logits holds about DEFAULT_TILE_ELEMENTS fp32 values."""
    return max(32, DEFAULT_TILE_ELEMENTS // max(1, total_batch) // 8 * 8)


def _direction_terms(queries, keys, scale, impl: str, chunk: int | None) -> torch.Tensor:
    """sum over local rows i of logsumexp_j(s q_i . k_j)."""
    if impl == "tiled":
        chunk = chunk or default_chunk_size(keys.shape[0])
        return _TiledLogSumExp.apply(queries, keys, scale, chunk)
    logits = scale.float() * (queries.float() @ keys.float().T)  # the b x B block
    return torch.logsumexp(logits, dim=1).sum()


def disco_clip_loss(image_features, text_features, logit_scale, impl: str = "tiled", chunk_size: int | None = None, group=None) -> torch.Tensor:
    """Functional form of :class:`DiscoClipLoss`; see the module docstring for the exact contract."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or None, got {chunk_size}")
    sizes = _check_inputs(image_features, text_features, logit_scale, group)
    world = _world(group)[1]
    total = sum(sizes)
    # Autocast would run the logit matmuls in 16 bits (an error of ~0.3 at logit 100): the loss keeps its own fp32.
    with torch.autocast(device_type=image_features.device.type, enabled=False):
        scale = torch.as_tensor(logit_scale, device=image_features.device).float()
        all_images, all_texts = gather_features(image_features, text_features, sizes=sizes, group=group)
        lse_sum = _direction_terms(image_features, all_texts, scale, impl, chunk_size) + _direction_terms(
            text_features, all_images, scale, impl, chunk_size
        )
        positives = (image_features.float() * text_features.float()).sum() * scale
        return (lse_sum - 2 * positives) * (world / (2 * total))


class DiscoClipLoss(nn.Module):
    """Global-batch CLIP loss over all ranks of `group`, each rank computing only its own rows.

    forward(image_features, text_features, logit_scale): this rank's (b, d) L2-normalised features (ranks may
    hold different b) and the logit multiplier (e.g. `model.logit_scale.exp()`). Returns this rank's share
    l_r with mean_r l_r = the single-device loss over the global batch and gradients such that data-parallel
    averaging yields exactly the global-batch gradient. Without torch.distributed it is the plain CLIP loss.
    """

    def __init__(self, impl: str = "tiled", chunk_size: int | None = None, group=None):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl, self.chunk_size, self.group = impl, chunk_size, group

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale) -> torch.Tensor:
        return disco_clip_loss(image_features, text_features, logit_scale, self.impl, self.chunk_size, self.group)

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, chunk_size={self.chunk_size}"
