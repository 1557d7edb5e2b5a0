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

import math

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

# One exponential per logit serves both a row's and a column's log-sum-exp through bands: a tile's logits are
# measured down from an anchor a in bands of _BAND nats, band k <= 0 holding a + (k - 1) W < S <= a + k W, and each
# logit is exponentiated once against its own band's top, E = exp(S - a - k W), in (e^-W, 1]. A row (or column)
# whose maximum lies in band K sums its band-K terms with weight 1 and its band-(K - 1) terms with weight e^-W: its
# terms more than 2 bands down lie over W below its maximum, under B e^-48 of its sum. No term underflows (E >
# e^-48) nor overflows (a sum <= B), whatever the logits' span: there is no shortcut to fall back from. W = 48
# keeps a weighted next-band term that matters (within 17 + ln B nats of the maximum) a normal fp32 up to B = 2^24.
_BAND = 48.0
_NEXT = math.exp(-_BAND)  # the weight of the band below the top one


def _to_bands(shifted: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Given S - a (<= 0 up to rounding), in place: each value minus its band's top k W; returns the bands k (in
    `out`). The subtraction is exact (Sterbenz: S - a and k W lie within a factor 2 of each other, or k = 0)."""
    bands = torch.mul(shifted, 1 / _BAND, out=out).ceil_()
    shifted.sub_(bands, alpha=_BAND)
    return bands


def _band_of(shifted: torch.Tensor) -> torch.Tensor:
    """The band of each value of S - a, computed as _to_bands computes an element's (the same fp32 operations)."""
    return torch.mul(shifted, 1 / _BAND).ceil_()


def _band_weights(bands: torch.Tensor, top: torch.Tensor, dim: int, out: torch.Tensor) -> torch.Tensor:
    """Weights of a tile's exponentials for the rows (dim 1) or columns (dim 0) whose top bands are `top`: 1 in the
    top band, e^-W in the one below, 0 further down; float arithmetic only (masks are slower on CPU). `out` may be
    `bands` itself."""
    return torch.sub(bands, (top - 1).unsqueeze(dim), out=out).add_(_NEXT).clamp_(0.0, 1.0)


def _workspace(chunk: int, total: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 tiles of `chunk` x `total`, reused by every tile of a pass (the last one takes their first rows)."""
    return tuple(like.new_empty((chunk, total), dtype=torch.float32) for _ in range(2))


class _OneBlockLogSumExps(torch.autograd.Function):
    """sum_{i local} lse_j S_ij + sum_{j local} lse_i S_ij from this rank's block S_r = s I_r T_all^T alone.

    Pass 1 walks row tiles of S_r once. One exponential per logit, E = exp(S - a - k W) in bands under the tile's
    maximum a (see _BAND), gives both the row sums (row log-sum-exps: complete, a row lies in one rank's block) and
    the column sums (this rank's partial column log-sum-exps), which two all-reduces of B floats (max, then sum of
    exp(x - max)) combine into the global column log-sum-exps. Exact for any span of the logits: a column whose
    logits all lie far below their rows' maxima is summed in its own band, without a host sync or a second pass.
    Pass 2 (backward) recomputes each tile's logits into E = exp(S - a - k W) again, a the tile's largest row lse
    (one exponential per logit), and the gradient tile
        G_ij = g_r exp(S_ij - rowlse_i) + g_owner(j) exp(S_ij - collse_j)
             = E_ij (g_r alpha_i w_ij + g_owner(j) beta_j v_ij),
        alpha_i = exp(a + K_i W - rowlse_i), beta_j = exp(a + K'_j W - collse_j),
    K_i, K'_j the bands of the row's and column's lse, w, v the band weights: each probability to an absolute
    e^-48. The column term carries the upstream gradient of the rank that owns text j (its loss holds collse_j), so
    the summed reduce-scatter of dT_all gives every rank d(sum_r g_r l_r)/d(its texts), as the contract says. When
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
        kept = []
        work = _workspace(min(chunk, b), total, texts32)
        for rows in tiles(b, chunk):
            logits = (images[rows].float() * scale) @ texts32.T
            row_max, col_max = logits.amax(1), logits.amax(0)
            top = row_max.max()
            shifted = logits - top if keep else logits.sub_(top)  # kept logits stay
            if keep:
                kept.append(logits)
            n = shifted.shape[0]
            bands = _to_bands(shifted, work[0][:n])
            exps = shifted.exp_()
            row_top, col_top = _band_of(row_max.sub_(top)), _band_of(col_max.sub_(top))
            row_sum = _band_weights(bands, row_top, 1, work[1][:n]).mul_(exps).sum(1)
            col_sum = _band_weights(bands, col_top, 0, bands).mul_(exps).sum(0)
            del exps, bands, shifted
            row_lse[rows] = row_sum.log_().add_(row_top.mul_(_BAND).add_(top))
            torch.logaddexp(col_lse, col_sum.log_().add_(col_top.mul_(_BAND).add_(top)), out=col_lse)
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
        work = _workspace(min(chunk, images.shape[0]), texts.shape[0], texts32)
        for k, rows in enumerate(tiles(images.shape[0], chunk)):
            q = images[rows].float()
            q_scaled = q * scale
            top = row_lse[rows].max()  # >= every logit of these rows
            if ctx.kept is not None:
                shifted, ctx.kept[k] = ctx.kept[k].sub_(top), None  # consumed in place
            else:
                # S - a, S's rounding as in pass 1 (the same product (s q) T^T)
                shifted = torch.addmm(top.expand(1, 1), q_scaled, texts32.T, beta=-1)
            grad = _gradient_tile(shifted, top, row_lse[rows], col_lse, g, g_col, work)
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


def _gradient_tile(shifted, top, row_lse, col_lse, g, g_col, work) -> torch.Tensor:
    """G = g exp(S - rowlse) + g_col exp(S - collse) from S - top (consumed), with one exponential per logit; the
    result lies in work[1]."""
    n = shifted.shape[0]
    bands = _to_bands(shifted, work[0][:n])
    exps = shifted.exp_()
    # The lse's band, or a logit's if the recompute rounded it over a band's edge above its lse: weights need k <= K.
    row_top = torch.maximum(_band_of(row_lse - top), bands.amax(1))
    col_top = torch.maximum(_band_of(col_lse - top), bands.amax(0))
    alpha = (top - row_lse).add_(row_top, alpha=_BAND).exp_().mul_(g)  # exact shift (Sterbenz); in [1, e^W) g
    beta = (top - col_lse).add_(col_top, alpha=_BAND).exp_().mul_(g_col)
    grad = _band_weights(bands, row_top, 1, work[1][:n]).mul_(alpha[:, None])
    return grad.addcmul_(_band_weights(bands, col_top, 0, bands), beta).mul_(exps)


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
