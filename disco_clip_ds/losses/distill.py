"""Distillation of a teacher's global-batch similarities into a student, tiled and exact across ranks. Torch only.

Notation as in softmax.py and sigmoid.py: rank r holds b_r student image and text rows x_i, y_j and the teacher's
rows x'_i, y'_j of the same samples (L2-normalised; the teacher's width may differ from the student's, only
similarities are compared), B = sum_r b_r. Student logits S_ij = s x_i . y_j (+ t for SigLIP); teacher logits
T_ij = s' x'_i . y'_j (+ t' for SigLIP). `teacher_scale` s' is the multiplier of the teacher's cosine similarities:
the teacher's own `logit_scale.exp()`, or 1 / temperature when a distillation temperature is set (the training
flag --distill_temperature); it scales the teacher's similarities only, never the student's nor the teacher's bias.
The teacher's features carry no gradient.

Softmax (CLIP) distillation, both directions averaged as CLIP's loss is:

    L = 1/(2B) * [sum_i KL(softmax_j T_i. || softmax_j S_i.) + sum_j KL(softmax_i T_.j || softmax_i S_.j)].

Rank r returns l_r = N/(2B) * (its image rows' KLs + its text columns' KLs), so mean_r l_r = L. Only the texts
(student and teacher) are gathered; the student's gathered texts' gradient is reduce-scattered to their owner, so
data-parallel averaging gives every parameter exactly dL/dtheta, as for the contrastive loss. Rank r walks its
block (b_r x B) in tiles of `chunk_size` rows: a row's KL is complete in its tile; a column's student and teacher
log-sum-exps and its teacher-weighted mean of T - S are merged tile by tile and then across ranks (one all-reduce
of 2B maxima, one of 3B sums). Backward recomputes each tile into its gradient

    dL/dS_ij ~ g_r (softmax_j S_ij - softmax_j T_ij) + g_owner(j) (softmax_i S_ij - softmax_i T_ij),

never keeping a b x B matrix: peak extra memory O(B * (d + d') + tile).

Sigmoid (SigLIP) distillation, per pair the binary cross-entropy of the student's sigmoid against the teacher's:

    L = (1/B) sum_ij [softplus(S_ij) - sigmoid(T_ij) S_ij],

which is SigLIP's loss when sigmoid(T) is the identity matrix. As in sigmoid.py, rank r walks its image rows
against one rank's text blocks at a time, the student's and the teacher's text blocks passing together round the
ring: a rank never holds more than two blocks of each, whatever the number of ranks. d/dS_ij = sigmoid(S_ij) -
sigmoid(T_ij).

Mixed with the contrastive loss (`distill_weight` W < 1): (1 - W) contrastive + W distillation is one loss of the
same tiles, the student's logits against a target mixing the positives (weight 1 - W) with the teacher's
distribution (weight W): CLIP's cross-entropy is the student's row and column log-sum-exps minus S_ii, SigLIP's
loss is softplus(S_ij) minus S_ii, and both share their first part with the distillation above. So the tiles carry
the student's log-sum-exps (softplus) once, W times the teacher's terms and (1 - W) times the positives, which lie
on the diagonal of a rank's own block (the gradient subtracts (1 - W) there). The mix costs what the distillation
alone costs: no second gather of the student's texts, no second pass over the tiles, no b x d temporaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from disco_clip_ds.losses.comm import check_inputs, gather_features, rank_and_world, upstream_per_column
from disco_clip_ds.losses.tiles import (
    Ring,
    add_ring_tile_gradient,
    add_tile_gradient,
    as_fp32,
    as_scalar,
    check_options,
    tile_rows,
    tiles,
)


class _SoftmaxDistill(torch.autograd.Function):
    """sum over this rank's image rows of KL_row_i + over its text columns of KL_col_j (module docstring); with a
    weight W < 1, W times those + (1 - W) times the CLIP cross-entropies of the same rows and columns."""

    @staticmethod
    def forward(ctx, images, texts, scale, t_images, t_texts, t_scale, weight, sizes, group, chunk):
        rank, world = rank_and_world(group)
        b, total = images.shape[0], texts.shape[0]
        texts32, t_texts32 = texts.float(), t_texts.float()
        row_lse_s, row_lse_t = texts32.new_empty(b), texts32.new_empty(b)
        col_lse_s, col_lse_t = texts32.new_full((total,), -torch.inf), texts32.new_full((total,), -torch.inf)
        col_mean = texts32.new_zeros(total)  # sum_i softmax_i(T)_ij (T_ij - S_ij) over the rows seen so far
        rows_terms = texts32.new_zeros(())
        lo = sum(sizes[:rank])  # this rank's texts' first column: its positives lie on the diagonal from there
        for rows in tiles(b, chunk):
            logits = (images[rows].float() * scale) @ texts32.T
            t_logits = (t_images[rows].float() * t_scale) @ t_texts32.T
            if weight < 1:  # S_ii of these rows, in the row and in the column of sample i
                rows_terms -= 2 * (1 - weight) * logits.diagonal(lo + rows.start).sum()
            row_lse_s[rows], row_lse_t[rows] = logits.logsumexp(1), t_logits.logsumexp(1)
            col_lse_s = torch.logaddexp(col_lse_s, logits.logsumexp(0))
            diff = t_logits - logits
            # KL_i = sum_j p_ij (T_ij - S_ij) - lse_T_i + lse_S_i with p the teacher's row softmax
            p = (t_logits - row_lse_t[rows, None]).exp_()
            rows_terms += (
                weight * (torch.vdot(p.view(-1), diff.view(-1)) - row_lse_t[rows].sum()) + row_lse_s[rows].sum()
            )
            tile_lse_t = t_logits.logsumexp(0)
            tile_mean = t_logits.sub_(tile_lse_t).exp_().mul_(diff).sum(0)  # this tile's teacher column softmax
            merged = torch.logaddexp(col_lse_t, tile_lse_t)
            col_mean = col_mean * (col_lse_t - merged).exp() + tile_mean * (tile_lse_t - merged).exp()
            col_lse_t = merged
        if world > 1:  # merge the ranks' partial columns: log-sum-exps and the teacher-weighted means
            top = torch.stack([col_lse_s, col_lse_t])
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # finite: every column has a row somewhere
            weight_t = (col_lse_t - top[1]).exp()
            sums = torch.stack([(col_lse_s - top[0]).exp(), weight_t, weight_t * col_mean])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            col_lse_s, col_lse_t = sums[0].log() + top[0], sums[1].log() + top[1]
            col_mean = sums[2] / sums[1]
        mine = slice(lo, lo + b)
        cols_terms = (weight * (col_mean[mine] - col_lse_t[mine]) + col_lse_s[mine]).sum()
        lses = (row_lse_s, row_lse_t, col_lse_s, col_lse_t)
        ctx.save_for_backward(images, texts, scale, t_images, t_texts, t_scale, *lses)
        ctx.meta = (sizes, group, chunk, weight, lo)
        return rows_terms + cols_terms

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        images, texts, scale, t_images, t_texts, t_scale, *lses = ctx.saved_tensors
        row_lse_s, row_lse_t, col_lse_s, col_lse_t = lses
        sizes, group, chunk, weight, lo = ctx.meta
        need_i, need_t, need_s = ctx.needs_input_grad[:3]
        g, g_col = upstream_per_column(grad_total, sizes, group, texts.shape[0])
        texts32, t_texts32 = texts.float(), t_texts.float()
        grad_i = torch.empty(images.shape, dtype=torch.float32, device=images.device) if need_i else None
        grad_t = torch.zeros(texts.shape, dtype=torch.float32, device=texts.device) if need_t else None
        grad_s = texts32.new_zeros(())
        for rows in tiles(images.shape[0], chunk):
            q = images[rows].float()
            q_scaled = q * scale
            logits = q_scaled @ texts32.T  # S's rounding as in forward (the same product)
            t_logits = (t_images[rows].float() * t_scale) @ t_texts32.T
            # every exponent is <= 0: a logit minus a log-sum-exp that contains it
            teacher_rows = (t_logits - row_lse_t[rows, None]).exp_()
            grad = (logits - row_lse_s[rows, None]).exp_().sub_(teacher_rows, alpha=weight).mul_(g)
            grad += logits.sub_(col_lse_s).exp_().sub_(t_logits.sub_(col_lse_t).exp_(), alpha=weight).mul_(g_col)
            if weight < 1:  # the positives' -(1 - W) in the row's loss and in the column's (both this rank's)
                grad.diagonal(lo + rows.start).sub_(2 * (1 - weight) * g)
            add_tile_gradient(grad, rows, q, q_scaled, texts32, scale, grad_i, grad_t, grad_s if need_s else None)
        return (
            grad_i.to(images.dtype) if need_i else None,
            grad_t.to(texts.dtype) if need_t else None,
            grad_s.to(scale.dtype) if need_s else None,
            *([None] * 7),
        )


class _RingSigmoidDistill(torch.autograd.Function):
    """sum over this rank's image rows i and all texts j of softplus(S_ij) - W sigmoid(T_ij) S_ij, the student's and
    the teacher's text blocks travelling round the ring together (as _RingSigmoid's texts)."""

    @staticmethod
    def forward(ctx, images, texts, scale, bias, t_images, t_texts, t_scale, t_bias, weight, sizes, group, chunk):
        saved = (images, texts, scale, bias, t_images, t_texts, t_scale, t_bias)
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.weight = (sizes, group, chunk), weight
        total = images.new_zeros((), dtype=torch.float32)
        for own, rows, _, _, logits, t_logits in _ring_tiles(Ring(sizes, group, chunk, texts, t_texts), saved):
            total += F.softplus(logits).sum() - weight * torch.vdot(t_logits.sigmoid_().view(-1), logits.view(-1))
            if own and weight < 1:  # the positives (i, i) lie on this rank's own block's diagonal
                total -= (1 - weight) * logits.diagonal(rows.start).sum()
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        saved = ctx.saved_tensors
        images, texts, scale, bias, _, t_texts = saved[:6]
        g = grad_total.float()
        grad_i = torch.zeros(images.shape, dtype=torch.float32, device=images.device)
        sums = [grad_i.new_zeros(()), grad_i.new_zeros(())]  # dL/ds, dL/dt
        ring = Ring(*ctx.meta, texts, t_texts)
        ring.grad = torch.zeros(texts.shape, dtype=torch.float32, device=texts.device)
        for own, rows, q, dots, logits, t_logits in _ring_tiles(ring, saved, backward=True):
            grad = logits.sigmoid_().sub_(t_logits.sigmoid_(), alpha=ctx.weight)
            if own and ctx.weight < 1:
                grad.diagonal(rows.start).sub_(1 - ctx.weight)
            add_ring_tile_gradient(grad.mul_(g), rows, q, dots, ring.block32, scale, grad_i, ring.grad, sums)
        return (
            grad_i.to(images.dtype),
            ring.grad.to(texts.dtype),
            sums[0].to(scale.dtype),
            sums[1].to(bias.dtype),
            *([None] * 8),
        )


def _ring_tiles(ring: Ring, saved, backward: bool = False):
    """Yield (own, rows, q, dots, S tile, T tile) for every tile of this rank's rows against every rank's student
    and teacher text blocks (Ring.walk); ring.block32 is the student's block of the tile."""
    images, _, scale, bias, t_images, _, t_scale, t_bias = saved
    images32, t_images32 = images.float(), t_images.float()
    for own, rows, (block32, t_block32) in ring.walk(images32, backward):
        ring.block32 = block32
        q = images32[rows]
        dots = q @ block32.T
        t_logits = torch.addmm(t_bias, t_images32[rows] * t_scale, t_block32.T)
        yield own, rows, q, dots, dots * scale + bias, t_logits


def _check(who, student, teacher, scalars, t_scalars, chunk_size, group, distill_weight) -> list[int]:
    """Both models' inputs checked on every rank at once; the local batch sizes."""
    check_options(chunk_size, distill_weight)
    sizes = check_inputs(*student, scalars, group, who)
    t_sizes = check_inputs(*teacher, t_scalars, group, f"{who} (teacher features)")
    if sizes != t_sizes:  # every rank holds both lists: every rank raises
        raise ValueError(f"{who}: bad input. the teacher's rows per rank {t_sizes} differ from the student's {sizes}")
    return sizes


def softmax_distill_loss(
    image_features,
    text_features,
    logit_scale,
    teacher_image_features,
    teacher_text_features,
    teacher_scale,
    chunk_size: int | None = None,
    group=None,
    distill_weight: float = 1.0,
) -> torch.Tensor:
    """Functional form of :class:`SoftmaxDistillLoss`; see the module docstring for the exact contract."""
    student, teacher = (image_features, text_features), (teacher_image_features, teacher_text_features)
    scalars, t_scalars = {"logit_scale": logit_scale}, {"teacher_scale": teacher_scale}
    sizes = _check("SoftmaxDistillLoss", student, teacher, scalars, t_scalars, chunk_size, group, distill_weight)
    world, total = rank_and_world(group)[1], sum(sizes)
    device = image_features.device
    with torch.autocast(device_type=device.type, enabled=False):  # fp32 logits, as the contrastive loss
        scale, t_scale = as_fp32(logit_scale, device), as_fp32(teacher_scale, device).detach()
        (all_texts,) = gather_features(text_features, sizes=sizes, group=group)
        with torch.no_grad():  # the teacher's texts: gathered once, no gradient
            (t_all_texts,) = gather_features(teacher_text_features.detach(), sizes=sizes, group=group)
        chunk = chunk_size or tile_rows(total)
        terms = _SoftmaxDistill.apply(
            image_features,
            all_texts,
            scale,
            teacher_image_features.detach(),
            t_all_texts,
            t_scale,
            float(distill_weight),
            sizes,
            group,
            chunk,
        )
        return terms * (world / (2 * total)) if total else terms


def sigmoid_distill_loss(
    image_features,
    text_features,
    logit_scale,
    logit_bias,
    teacher_image_features,
    teacher_text_features,
    teacher_scale,
    teacher_bias,
    chunk_size: int | None = None,
    group=None,
    distill_weight: float = 1.0,
) -> torch.Tensor:
    """Functional form of :class:`SigmoidDistillLoss`; see the module docstring for the exact contract."""
    logit_scale, logit_bias = as_scalar(logit_scale), as_scalar(logit_bias)
    teacher_scale, teacher_bias = as_scalar(teacher_scale), as_scalar(teacher_bias)
    sizes = _check(
        "SigmoidDistillLoss",
        (image_features, text_features),
        (teacher_image_features, teacher_text_features),
        {"logit_scale": logit_scale, "logit_bias": logit_bias},
        {"teacher_scale": teacher_scale, "teacher_bias": teacher_bias},
        chunk_size,
        group,
        distill_weight,
    )
    world, total = rank_and_world(group)[1], sum(sizes)
    device = image_features.device
    with torch.autocast(device_type=device.type, enabled=False):
        as32 = lambda v: as_fp32(v, device)
        chunk = chunk_size or tile_rows(max(sizes))
        terms = _RingSigmoidDistill.apply(
            image_features,
            text_features,
            as32(logit_scale),
            as32(logit_bias),
            teacher_image_features.detach(),
            teacher_text_features.detach(),
            as32(teacher_scale).detach(),
            as32(teacher_bias).detach(),
            float(distill_weight),
            sizes,
            group,
            chunk,
        )
        return terms * (world / total) if total else terms


class _DistillModule(nn.Module):
    """The module form of a distillation loss: its options checked once, forward(*inputs) passing the inputs on to the
    functional form (`loss_fn`) in the order its docstring gives."""

    loss_fn = None

    def __init__(self, chunk_size: int | None = None, group=None, distill_weight: float = 1.0):
        super().__init__()
        check_options(chunk_size, distill_weight)
        self.chunk_size, self.group, self.distill_weight = chunk_size, group, distill_weight

    def forward(self, *inputs) -> torch.Tensor:
        return type(self).loss_fn(*inputs, self.chunk_size, self.group, self.distill_weight)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, distill_weight={self.distill_weight}"


class SoftmaxDistillLoss(_DistillModule):
    """Global-batch softmax (CLIP) distillation over all ranks of `group`, each rank computing only its own rows.

    forward(image_features, text_features, logit_scale, teacher_image_features, teacher_text_features,
    teacher_scale): this rank's (b, d) student and (b, d') teacher L2-normalised features of the same samples, the
    student's logit multiplier (e.g. `model.logit_scale.exp()`) and the teacher's similarity multiplier (its
    `logit_scale.exp()`, or 1 / temperature). Returns this rank's share l_r with mean_r l_r = the single-device
    KL distillation loss over the global batch (module docstring), with gradients such that data-parallel
    averaging yields exactly the global-batch gradient. `chunk_size`: rows per tile (None: ~8 MiB of logits).
    `distill_weight` W < 1 returns (1 - W) CLIP's contrastive loss + W the distillation, both from the same tiles.
    """

    loss_fn = staticmethod(softmax_distill_loss)


class SigmoidDistillLoss(_DistillModule):
    """Global-batch sigmoid (SigLIP) distillation over all ranks of `group`: per pair, the binary cross-entropy of
    the student's sigmoid against the teacher's, the texts streamed round the ring (memory flat in ranks).

    forward(image_features, text_features, logit_scale, logit_bias, teacher_image_features, teacher_text_features,
    teacher_scale, teacher_bias): this rank's student and teacher features (as SoftmaxDistillLoss), the student's
    logit multiplier and bias, the teacher's similarity multiplier (its `logit_scale.exp()`, or 1 / temperature)
    and its bias. Returns l_r with mean_r l_r = the single-device loss (module docstring) and gradients exact under
    data-parallel averaging. `chunk_size`: image rows per tile (None: ~8 MiB of logits per tile).
    `distill_weight` W < 1 returns (1 - W) SigLIP's loss + W the distillation, both from the same tiles.
    """

    loss_fn = staticmethod(sigmoid_distill_loss)
