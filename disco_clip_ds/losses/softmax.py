"""CLIP's exact global-batch loss, each rank computing its own rows: the DisCo decomposition and a tiled loss.
Torch only; the collectives that move the features are in comm.py.

Notation: rank r holds b_r image rows x_i and text rows y_i (L2-normalised); X, Y are all ranks' rows in rank
order, B = sum_r b_r, s = logit_scale and S = s X Y^T. The global CLIP loss is

    L = (CE(S, diag) + CE(S^T, diag)) / 2 = 1/(2B) * sum_i [lse_j(S_ij) + lse_j(S_ji) - 2 S_ii].

Rank r returns l_r = N/(2B) * (its rows' terms), so mean_r l_r = L. The gathered features' gradient is summed
back to their owner with a reduce-scatter, so rank r's features receive d(sum_r l_r)/d(rows of r) = N dL/d(rows):
ordinary data-parallel gradient averaging (DDP, DeepSpeed, FSDP) then gives every encoder parameter exactly
dL/dtheta, and logit_scale, which every rank holds, the mean of its local gradients, which is dL/ds too. (The
published DisCo code averages in its backward and so gives the encoders 1/N of this.)

Two implementations of the per-rank term:
- "disco": the paper's decomposition. Both modalities are gathered, and each direction builds a b x B logit
  block through plain autograd: every logit S_ij is computed twice across the ranks (once as image-to-text on
  the rank owning image i, once as text-to-image on the rank owning text j).
- "tiled": each logit once. Only the texts are gathered (and only their gradient reduce-scattered: half the
  feature bytes on the wire). Rank r owns the block S_r = s X_r Y^T: its rows give the image-to-text
  log-sum-exps, and its columns' partial log-sum-exps, combined across ranks by two all-reduces of B floats,
  give the text-to-image ones. The block is walked in tiles of `chunk_size` rows, twice: pass 1 for the
  log-sum-exps, pass 2 (backward) recomputing each tile into its gradient. 4 b x B x d matmuls per rank
  (disco: 6), peak extra memory O(B*d + tile) with one modality's B x d buffer and its gradient. When the b x B
  block fits `keep_bytes` its logits are kept and the recompute skipped (3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disco_clip_ds import LOSS_IMPLS
from disco_clip_ds.losses.comm import check_inputs, gather_features, rank_and_world, upstream_per_column
from disco_clip_ds.losses.tiles import (
    DEFAULT_TILE_ELEMENTS,
    add_tile_gradient,
    as_fp32,
    check_options,
    tile_rows,
    tiles,
)

IMPLS = tuple(impl for impl in LOSS_IMPLS if impl != "local")  # the global-batch losses implemented here
# The tiled loss keeps its b x B fp32 logits between forward and backward (skipping the recompute) when they
# take at most this many bytes: by default when the block is one default tile anyway, so that no extra memory
# is spent; raise it to trade memory for a quarter of the loss's matmuls.
DEFAULT_KEEP_BYTES = DEFAULT_TILE_ELEMENTS * 4
default_chunk_size = tile_rows  # rows per tile against the B columns of the global batch

# Below these, a shortcut's shared shift can have lost terms to fp32 underflow (exp(-87) is fp32's smallest normal):
# a tile's row or column sum of exp(S - tile max) under e^-46 (its significant terms may be under e^-78), and a
# column whose log-sum-exp lies more than 50 below the rank's largest row log-sum-exp (the backward's rescaling).
_TINY_SUM = 1e-20
_MAX_LSE_GAP = 50.0


class _OneBlockLogSumExps(torch.autograd.Function):
    """sum_{i local} lse_j S_ij + sum_{j local} lse_i S_ij from this rank's block S_r = s I_r T_all^T alone.

    Pass 1 walks row tiles of S_r once. One exponential per logit, E = exp(S - tile max), gives both the row sums
    (row log-sum-exps: complete, a row lies in one rank's block) and the column sums (this rank's partial column
    log-sum-exps), which two all-reduces of B floats (max, then sum of exp(x - max)) combine into the global
    column log-sum-exps. A row or column whose sum in a tile falls below _TINY_SUM sits so far below the tile's
    maximum that its terms may have underflowed: it takes the log-sum-exp of its own logits (shifted by its own
    maximum), which every tile computes beside the shortcut so that no host sync has to pick those rows, so a
    column whose logits are all far below their rows' maxima does not underflow to log(0).
    Pass 2 (backward) recomputes each tile's logits into P = exp(S - rowlse) (one exponential per logit again)
    and the gradient tile
        G_ij = g_r P_ij + g_owner(j) exp(S_ij - collse_j) = P_ij (g_r + a_i c_j),
        a_i = exp(rowlse_i - m), c_j = g_owner(j) exp(m - collse_j), m = max_i rowlse_i,
    whose column term carries the upstream gradient of the rank that owns text j (its loss holds collse_j), so
    the summed reduce-scatter of dT_all gives every rank d(sum_r g_r l_r)/d(its texts), as the contract says.
    Columns with m - collse_j > _MAX_LSE_GAP would overflow c_j while P_ij underflows: they take their column
    term from the logits directly (computed on every tile and chosen per column, again without a host sync). When
    the whole b x B block fits `keep_bytes`, pass 1 keeps its logits and pass 2 skips the recompute.
    """

    @staticmethod
    def forward(ctx, images, texts, scale, sizes, group, chunk, keep_bytes):
        rank, world = rank_and_world(group)
        need_grad = any(ctx.needs_input_grad[:3])
        texts32 = texts.float()
        b, total = images.shape[0], texts.shape[0]
        keep = need_grad and b * total * 4 <= keep_bytes
        row_lse = images.new_empty(b, dtype=torch.float32)
        col_lse = texts32.new_full((total,), -torch.inf)
        exact_col_lse = texts32.new_full((total,), -torch.inf)  # from each column's own maximum, for low columns
        low_cols = torch.zeros(total, dtype=torch.bool, device=images.device)
        kept = []
        for rows in tiles(b, chunk):
            logits = (images[rows].float() * scale) @ texts32.T
            exact_rows = torch.logsumexp(logits, dim=1)
            torch.logaddexp(exact_col_lse, torch.logsumexp(logits, dim=0), out=exact_col_lse)
            top = logits.max()
            exps = (logits - top if keep else logits.sub_(top)).exp_()  # kept logits stay; else exp in place
            if keep:
                kept.append(logits)
            row_sum, col_sum = exps.sum(1), exps.sum(0)
            del exps
            low_cols |= col_sum < _TINY_SUM
            row_lse[rows] = torch.where(row_sum < _TINY_SUM, exact_rows, row_sum.log_().add_(top))
            torch.logaddexp(col_lse, col_sum.log_().add_(top), out=col_lse)
        col_lse = torch.where(low_cols, exact_col_lse, col_lse)
        if world > 1:
            col_max = col_lse.clone()  # finite: every column has a row somewhere
            dist.all_reduce(col_max, op=dist.ReduceOp.MAX, group=group)
            col_sum = col_lse.sub_(col_max).exp_()
            dist.all_reduce(col_sum, op=dist.ReduceOp.SUM, group=group)
            col_lse = col_sum.log_().add_(col_max)
        lo = sum(sizes[:rank])
        if need_grad:
            ctx.save_for_backward(images, texts, scale, row_lse, col_lse)
            ctx.meta = (sizes, group, chunk)
            ctx.kept, ctx.used = (kept if keep else None), False
        return row_lse.sum() + col_lse[lo : lo + sizes[rank]].sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        images, texts, scale, row_lse, col_lse = ctx.saved_tensors
        sizes, group, chunk = ctx.meta
        need_i, need_t, need_s = ctx.needs_input_grad[:3]
        # each column's term belongs to the loss of the rank that owns the text
        g, g_col = upstream_per_column(grad_total, sizes, group, texts.shape[0])
        if ctx.kept is not None and ctx.used:
            raise RuntimeError(
                "the tiled CLIP loss kept its logits for one backward (retain_graph re-use is not supported)"
            )
        ctx.used = True
        texts32 = texts.float()
        grad_i = torch.empty(images.shape, dtype=torch.float32, device=images.device) if need_i else None
        grad_t = torch.zeros(texts.shape, dtype=torch.float32, device=texts.device) if need_t else None
        grad_s = torch.zeros((), dtype=torch.float32, device=images.device)
        m = row_lse.max() if row_lse.numel() else row_lse.new_zeros(())
        gap = m - col_lse
        direct = gap > _MAX_LSE_GAP  # chosen per column on the device: no host sync
        col_w = gap.clamp_(max=_MAX_LSE_GAP).exp_().mul_(g_col).masked_fill_(direct, 0.0)
        row_w = (row_lse - m).exp_()
        for k, rows in enumerate(tiles(images.shape[0], chunk)):
            q = images[rows].float()
            q_scaled = q * scale
            if ctx.kept is not None:
                shifted, ctx.kept[k] = ctx.kept[k].sub_(row_lse[rows, None]), None  # consumed in place
            else:
                # S - rowlse, S's rounding as in pass 1 (the same product (s q) T^T)
                shifted = torch.addmm(row_lse[rows, None], q_scaled, texts32.T, beta=-1)
            direct_term = (shifted + row_lse[rows, None]).sub_(col_lse).exp_().mul_(g_col)
            grad = shifted.exp_().mul_(torch.addr(g, row_w[rows], col_w))
            torch.where(direct, direct_term.add_(grad), grad, out=grad)
            del direct_term
            add_tile_gradient(grad, rows, q, q_scaled, texts32, scale, grad_i, grad_t, grad_s if need_s else None)
        return (
            grad_i.to(images.dtype) if need_i else None,
            grad_t.to(texts.dtype) if need_t else None,
            grad_s.to(scale.dtype) if need_s else None,
            None,
            None,
            None,
            None,
        )


def _direction_terms(queries, keys, scale) -> torch.Tensor:
    """sum over local rows i of logsumexp_j(s q_i . k_j), through the plain b x B block (the disco impl)."""
    logits = scale.float() * (queries.float() @ keys.float().T)
    return torch.logsumexp(logits, dim=1).sum()


def disco_clip_loss(
    image_features,
    text_features,
    logit_scale,
    impl: str = "tiled",
    chunk_size: int | None = None,
    group=None,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
) -> torch.Tensor:
    """Functional form of :class:`DiscoClipLoss`; see the module docstring for the exact contract."""
    _check_options(impl, chunk_size, keep_bytes)
    sizes = check_inputs(image_features, text_features, {"logit_scale": logit_scale}, group, "DiscoClipLoss")
    world = rank_and_world(group)[1]
    total = sum(sizes)
    # Autocast would run the logit matmuls in 16 bits (an error of ~0.3 at logit 100): the loss keeps its own fp32.
    with torch.autocast(device_type=image_features.device.type, enabled=False):
        scale = as_fp32(logit_scale, image_features.device)
        if impl == "tiled":
            (all_texts,) = gather_features(text_features, sizes=sizes, group=group)
            chunk = chunk_size or default_chunk_size(total)
            lse_sum = _OneBlockLogSumExps.apply(image_features, all_texts, scale, sizes, group, chunk, keep_bytes)
        else:
            all_images, all_texts = gather_features(image_features, text_features, sizes=sizes, group=group)
            lse_sum = _direction_terms(image_features, all_texts, scale) + _direction_terms(
                text_features, all_images, scale
            )
        positives = (image_features.float() * text_features.float()).sum() * scale
        return (lse_sum - 2 * positives) * (world / (2 * total))


def _check_options(impl: str, chunk_size, keep_bytes) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    check_options(chunk_size)
    if keep_bytes < 0:
        raise ValueError(f"keep_bytes must be >= 0 (0 = always recompute the logits in backward), got {keep_bytes}")


class DiscoClipLoss(nn.Module):
    """Global-batch CLIP loss over all ranks of `group`, each rank computing only its own rows.

    forward(image_features, text_features, logit_scale): this rank's (b, d) L2-normalised features (ranks may
    hold different b) and the logit multiplier (e.g. `model.logit_scale.exp()`). Returns this rank's share
    l_r with mean_r l_r = the single-device loss over the global batch and gradients such that data-parallel
    averaging yields exactly the global-batch gradient. Without torch.distributed it is the plain CLIP loss.
    `chunk_size`: rows per tile of the tiled loss (None: about 8 MiB of logits per tile). `keep_bytes`: the
    tiled loss keeps its b x B fp32 logits for backward instead of recomputing them when they fit this.
    """

    def __init__(
        self, impl: str = "tiled", chunk_size: int | None = None, group=None, keep_bytes: int = DEFAULT_KEEP_BYTES
    ):
        super().__init__()
        _check_options(impl, chunk_size, keep_bytes)
        self.impl, self.chunk_size, self.group, self.keep_bytes = impl, chunk_size, group, keep_bytes

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale) -> torch.Tensor:
        return disco_clip_loss(
            image_features, text_features, logit_scale, self.impl, self.chunk_size, self.group, self.keep_bytes
        )

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, chunk_size={self.chunk_size}, keep_bytes={self.keep_bytes}"
