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

An ensemble of teachers t = 1..M (each its own features x'^t, y'^t of width d'_t, multiplier s'_t and SigLIP bias
t'_t; logits T^t) is distilled as MobileCLIP's DistillClipLoss does with `average_after_softmax` (its DRClipLoss
reads DataCompDR's teachers that way): the target of each direction is the mean of the teachers' own softmaxes,

    P_i. = (1/M) sum_t softmax_j T^t_i.,    P_.j = (1/M) sum_t softmax_i T^t_.j,

and the loss is the KL of those targets from the student's (KL where MobileCLIP writes the cross-entropy: they differ
by the targets' entropy, a constant of the data, and the KL is zero when the student matches). With M = 1 it is the
loss above. A row's target is complete in its tile once each teacher's row log-sum-exp is (the tile spans every
column); a column's is not, and log P_.j depends on all M teachers' final column log-sum-exps at once, which no
online merge can rescale. So an ensemble's forward first walks its tiles for the teachers' log-sum-exps alone (rows
and columns; one all-reduce of 2MB values merges the columns across ranks), then the tiles again for the student
and the KLs, each column's sum_i P_ij (log P_ij - S_ij) added up across ranks with the student's column sums. The
backward is the one above with P in place of the single teacher's softmaxes. Peak extra memory O(B * (d + sum_t d'_t)
+ (M + 3) tiles); the teachers' texts are gathered (or passed round the ring) as one block, their widths side by
side, as MobileCLIP's `teacher_dimension` splits one concatenated feature.

The sigmoid ensemble averages the teachers' probabilities, as MobileCLIP's DistillSigLipLoss does with
`average_after_sigmoid`: the target of pair ij is P_ij = (1/M) sum_t sigmoid(T^t_ij) in the binary cross-entropy
above (MobileCLIP feeds 2 P - 1 as a soft label to -logsigmoid(label * S) instead; this keeps the loss above, of
which M = 1 is the single teacher's). d/dS_ij = sigmoid(S_ij) - P_ij.

Mixed with the contrastive loss (`distill_weight` W < 1): (1 - W) contrastive + W distillation is one loss of the
same tiles, the student's logits against a target mixing the positives (weight 1 - W) with the teacher's
distribution (weight W): CLIP's cross-entropy is the student's row and column log-sum-exps minus S_ii, SigLIP's
loss is softplus(S_ij) minus S_ii, and both share their first part with the distillation above. So the tiles carry
the student's log-sum-exps (softplus) once, W times the teacher's terms and (1 - W) times the positives, which lie
on the diagonal of a rank's own block (the gradient subtracts (1 - W) there). The mix costs what the distillation
alone costs: no second gather of the student's texts, no second pass over the tiles, no b x d temporaries.
"""

from __future__ import annotations

import functools

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


class _Teachers:
    """M teachers' features side by side in one (rows, sum_t d'_t) tensor per modality, their widths `dims` and their
    fp32 multipliers (and SigLIP biases), shape (M,): each tile's logits per teacher."""

    def __init__(self, images, dims, scales, biases=None):
        self.images32, self.dims, self.scales, self.biases = images.float(), dims, scales, biases

    def logits(self, rows, texts32) -> list[torch.Tensor]:
        """[T^t of the image rows `rows` against `texts32` (fp32, the teachers' texts side by side)] for t = 1..M."""
        pairs = zip(self.images32[rows].split(self.dims, 1), texts32.split(self.dims, 1))
        if self.biases is None:
            return [(q * self.scales[t]) @ k.T for t, (q, k) in enumerate(pairs)]
        return [torch.addmm(self.biases[t], q * self.scales[t], k.T) for t, (q, k) in enumerate(pairs)]


def _mean_softmax(t_logits: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """(1/M) sum_t exp(T^t - lse_t): the ensemble's target from each teacher's log-sum-exps (broadcast along the
    softmax's axis). Overwrites the teachers' logits. Every exponent is <= 0 (a logit minus a lse containing it)."""
    target = t_logits[0].sub_(lses[0]).exp_()
    for logits, lse in zip(t_logits[1:], lses[1:]):
        target += logits.sub_(lse).exp_()
    return target.div_(len(t_logits)) if len(t_logits) > 1 else target


def _merge_columns(lse: torch.Tensor, group) -> torch.Tensor:
    """Per-rank partial column log-sum-exps (any leading shape) merged across the ranks of `group`."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # finite: every column has a row somewhere
    sums = (lse - top).exp()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return sums.log() + top


def _teacher_lses(teachers: _Teachers, t_texts32, b, chunk, group, world):
    """An ensemble's first pass: every teacher's row log-sum-exps (M, b) and column ones (M, B), merged across ranks."""
    m, total = len(teachers.dims), t_texts32.shape[0]
    rows_lse, cols_lse = t_texts32.new_empty(m, b), t_texts32.new_full((m, total), -torch.inf)
    for rows in tiles(b, chunk):
        for t, logits in enumerate(teachers.logits(rows, t_texts32)):
            rows_lse[t, rows] = logits.logsumexp(1)
            cols_lse[t] = torch.logaddexp(cols_lse[t], logits.logsumexp(0))
    return rows_lse, _merge_columns(cols_lse, group) if world > 1 else cols_lse


class _SoftmaxDistill(torch.autograd.Function):
    """sum over this rank's image rows of KL_row_i + over its text columns of KL_col_j (module docstring) against one
    teacher or the mean of M teachers' softmaxes; with a weight W < 1, W times those + (1 - W) times the CLIP
    cross-entropies of the same rows and columns."""

    @staticmethod
    def forward(ctx, images, texts, scale, t_images, t_texts, t_scales, dims, weight, sizes, group, chunk):
        texts32, t_texts32 = texts.float(), t_texts.float()
        teachers = _Teachers(t_images, dims, t_scales)
        # this rank's texts' first column: its positives lie on the diagonal from there
        lo = sum(sizes[: rank_and_world(group)[0]])
        if len(dims) == 1:
            terms, lses = _single_teacher_terms(images, texts32, scale, teachers, t_texts32, weight, lo, chunk, group)
        else:
            terms, lses = _ensemble_terms(images, texts32, scale, teachers, t_texts32, weight, lo, chunk, group)
        ctx.save_for_backward(images, texts, scale, t_images, t_texts, t_scales, *lses)
        ctx.meta = (dims, sizes, group, chunk, weight, lo)
        return terms

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        images, texts, scale, t_images, t_texts, t_scales, *lses = ctx.saved_tensors
        row_lse_s, row_lse_t, col_lse_s, col_lse_t = lses  # the teachers' (M, b) and (M, B)
        dims, sizes, group, chunk, weight, lo = ctx.meta
        need_i, need_t, need_s = ctx.needs_input_grad[:3]
        g, g_col = upstream_per_column(grad_total, sizes, group, texts.shape[0])
        texts32, t_texts32 = texts.float(), t_texts.float()
        teachers = _Teachers(t_images, dims, t_scales)
        grad_i = torch.empty(images.shape, dtype=torch.float32, device=images.device) if need_i else None
        grad_t = torch.zeros(texts.shape, dtype=torch.float32, device=texts.device) if need_t else None
        grad_s = texts32.new_zeros(())
        for rows in tiles(images.shape[0], chunk):
            q = images[rows].float()
            q_scaled = q * scale
            logits = q_scaled @ texts32.T  # S's rounding as in forward (the same product)
            t_logits = teachers.logits(rows, t_texts32)
            teacher_rows = _mean_softmax([x.clone() for x in t_logits], list(row_lse_t[:, rows, None]))
            grad = (logits - row_lse_s[rows, None]).exp_().sub_(teacher_rows, alpha=weight).mul_(g)
            teacher_cols = _mean_softmax(t_logits, list(col_lse_t))
            grad += logits.sub_(col_lse_s).exp_().sub_(teacher_cols, alpha=weight).mul_(g_col)
            if weight < 1:  # the positives' -(1 - W) in the row's loss and in the column's (both this rank's)
                grad.diagonal(lo + rows.start).sub_(2 * (1 - weight) * g)
            add_tile_gradient(grad, rows, q, q_scaled, texts32, scale, grad_i, grad_t, grad_s if need_s else None)
        return (
            grad_i.to(images.dtype) if need_i else None,
            grad_t.to(texts.dtype) if need_t else None,
            grad_s.to(scale.dtype) if need_s else None,
            *([None] * 8),
        )


def _single_teacher_terms(images, texts32, scale, teachers, t_texts32, weight, lo, chunk, group):
    """One teacher's forward in one pass over the tiles, its column log-sum-exps and teacher-weighted means merged
    online: (this rank's terms, the log-sum-exps backward needs)."""
    world = rank_and_world(group)[1]
    b, total = images.shape[0], texts32.shape[0]
    row_lse_s, row_lse_t = texts32.new_empty(b), texts32.new_empty(b)
    col_lse_s, col_lse_t = texts32.new_full((total,), -torch.inf), texts32.new_full((total,), -torch.inf)
    col_mean = texts32.new_zeros(total)  # sum_i softmax_i(T)_ij (T_ij - S_ij) over the rows seen so far
    rows_terms = texts32.new_zeros(())
    for rows in tiles(b, chunk):
        logits = (images[rows].float() * scale) @ texts32.T
        (t_logits,) = teachers.logits(rows, t_texts32)
        if weight < 1:  # S_ii of these rows, in the row and in the column of sample i
            rows_terms -= 2 * (1 - weight) * logits.diagonal(lo + rows.start).sum()
        row_lse_s[rows], row_lse_t[rows] = logits.logsumexp(1), t_logits.logsumexp(1)
        col_lse_s = torch.logaddexp(col_lse_s, logits.logsumexp(0))
        diff = t_logits - logits
        # KL_i = sum_j p_ij (T_ij - S_ij) - lse_T_i + lse_S_i with p the teacher's row softmax
        p = (t_logits - row_lse_t[rows, None]).exp_()
        rows_terms += weight * (torch.vdot(p.view(-1), diff.view(-1)) - row_lse_t[rows].sum()) + row_lse_s[rows].sum()
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
    return rows_terms + cols_terms, (row_lse_s, row_lse_t[None], col_lse_s, col_lse_t[None])


def _ensemble_terms(images, texts32, scale, teachers, t_texts32, weight, lo, chunk, group):
    """M > 1 teachers' forward: their log-sum-exps first (`_teacher_lses`), then the tiles again for the student's
    log-sum-exps and the KLs to the mean of the teachers' softmaxes: (this rank's terms, the log-sum-exps)."""
    world = rank_and_world(group)[1]
    b, total = images.shape[0], texts32.shape[0]
    row_lse_t, col_lse_t = _teacher_lses(teachers, t_texts32, b, chunk, group, world)
    row_lse_s, col_lse_s = texts32.new_empty(b), texts32.new_full((total,), -torch.inf)
    col_kl = texts32.new_zeros(total)  # sum_i P_ij (log P_ij - S_ij) over this rank's rows
    rows_terms = texts32.new_zeros(())
    for rows in tiles(b, chunk):
        logits = (images[rows].float() * scale) @ texts32.T
        if weight < 1:  # S_ii of these rows, in the row and in the column of sample i
            rows_terms -= 2 * (1 - weight) * logits.diagonal(lo + rows.start).sum()
        row_lse_s[rows] = logits.logsumexp(1)
        col_lse_s = torch.logaddexp(col_lse_s, logits.logsumexp(0))
        t_logits = teachers.logits(rows, t_texts32)
        target = _mean_softmax([x.clone() for x in t_logits], list(row_lse_t[:, rows, None]))
        # KL_i = sum_j P_ij (log P_ij - S_ij) + lse_S_i (xlogy: a target that underflows to 0 adds 0)
        rows_terms += weight * (torch.xlogy(target, target).sum() - torch.vdot(target.view(-1), logits.view(-1)))
        rows_terms += row_lse_s[rows].sum()
        target = _mean_softmax(t_logits, list(col_lse_t))
        col_kl += torch.xlogy(target, target).sub_(target.mul_(logits)).sum(0)
    if world > 1:  # the student's column log-sum-exps and the columns' KL sums, across ranks
        top = col_lse_s.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([(col_lse_s - top).exp(), col_kl])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        col_lse_s, col_kl = sums[0].log() + top, sums[1]
    mine = slice(lo, lo + b)
    cols_terms = (weight * col_kl[mine] + col_lse_s[mine]).sum()
    return rows_terms + cols_terms, (row_lse_s, row_lse_t, col_lse_s, col_lse_t)


class _RingSigmoidDistill(torch.autograd.Function):
    """sum over this rank's image rows i and all texts j of softplus(S_ij) - W P_ij S_ij, P_ij the teacher's sigmoid
    (the mean of M teachers'), the student's and the teachers' text blocks travelling round the ring together (as
    _RingSigmoid's texts)."""

    @staticmethod
    def forward(ctx, images, texts, scale, bias, t_images, t_texts, t_scales, t_biases, dims, weight, *meta):
        saved = (images, texts, scale, bias, t_images, t_texts, t_scales, t_biases)
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.weight, ctx.dims = meta, weight, dims  # meta: sizes, group, chunk
        total = images.new_zeros((), dtype=torch.float32)
        for own, rows, _, _, logits, target in _ring_tiles(Ring(*meta, texts, t_texts), saved, dims):
            total += F.softplus(logits).sum() - weight * torch.vdot(target.view(-1), logits.view(-1))
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
        for own, rows, q, dots, logits, target in _ring_tiles(ring, saved, ctx.dims, backward=True):
            grad = logits.sigmoid_().sub_(target, alpha=ctx.weight)
            if own and ctx.weight < 1:
                grad.diagonal(rows.start).sub_(1 - ctx.weight)
            add_ring_tile_gradient(grad.mul_(g), rows, q, dots, ring.block32, scale, grad_i, ring.grad, sums)
        return (
            grad_i.to(images.dtype),
            ring.grad.to(texts.dtype),
            sums[0].to(scale.dtype),
            sums[1].to(bias.dtype),
            *([None] * 9),
        )


def _ring_tiles(ring: Ring, saved, dims, backward: bool = False):
    """Yield (own, rows, q, dots, S tile, P tile) for every tile of this rank's rows against every rank's student and
    teachers' text blocks (Ring.walk), P the (mean) teachers' sigmoid; ring.block32 is the student's block."""
    images, _, scale, bias, t_images, _, t_scales, t_biases = saved
    images32, teachers = images.float(), _Teachers(t_images, dims, t_scales, t_biases)
    for own, rows, (block32, t_block32) in ring.walk(images32, backward):
        ring.block32 = block32
        q = images32[rows]
        dots = q @ block32.T
        t_logits = teachers.logits(rows, t_block32)
        target = t_logits[0].sigmoid_()
        for t_logit in t_logits[1:]:
            target += t_logit.sigmoid_()
        yield own, rows, q, dots, dots * scale + bias, target.div_(len(dims)) if len(dims) > 1 else target


def _as_list(value) -> list:
    """One teacher's tensor or scalar as a list of one; a list or tuple (an ensemble) as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check(who, student, teachers, scalars, t_scalars, chunk_size, group, distill_weight) -> list[int]:
    """Both models' inputs checked on every rank at once (each teacher's in turn); the local batch sizes."""
    check_options(chunk_size, distill_weight)
    sizes = check_inputs(*student, scalars, group, who)
    if not teachers[0] or len({len(x) for x in (*teachers, *t_scalars.values())}) > 1:
        counts = ", ".join(f"{len(x)} {name}" for name, x in zip(("image", "text"), teachers))
        counts += "".join(f", {len(v)} {k}" for k, v in t_scalars.items())
        raise ValueError(f"{who}: bad input. one entry per teacher in each teacher argument, got {counts}")
    for t, (t_images, t_texts) in enumerate(zip(*teachers)):
        name = "teacher" if len(teachers[0]) == 1 else f"teacher {t}"
        t_scalar = {k if len(v) == 1 else f"{k}[{t}]": v[t] for k, v in t_scalars.items()}
        t_sizes = check_inputs(
            t_images,
            t_texts,
            t_scalar,
            group,
            f"{who} ({name} features)" if len(teachers[0]) == 1 else f"{who} ({name}'s features)",
        )
        if sizes != t_sizes:  # every rank holds both lists: every rank raises
            raise ValueError(
                f"{who}: bad input. the {name}'s rows per rank {t_sizes} differ from the student's {sizes}"
            )
    return sizes


def _side_by_side(features: list[torch.Tensor]) -> torch.Tensor:
    """The teachers' features of one modality in one detached tensor, their widths side by side (one teacher's as
    they are), in the widest dtype among them: one block to gather or to pass round the ring."""
    if len(features) == 1:
        return features[0].detach()
    dtype = functools.reduce(torch.promote_types, (f.dtype for f in features))
    return torch.cat([f.detach().to(dtype) for f in features], dim=1)


def _scalars(values: list, device) -> torch.Tensor:
    """Per-teacher scalars as one detached fp32 tensor of shape (M,)."""
    return torch.stack([as_fp32(v, device).detach().reshape(()) for v in values])


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
    """Functional form of :class:`SoftmaxDistillLoss`; see the module docstring for the exact contract. The teacher
    arguments are one teacher's tensors and scalar, or lists of M teachers' (an ensemble)."""
    t_images, t_texts, t_scales = map(_as_list, (teacher_image_features, teacher_text_features, teacher_scale))
    student, scalars = (image_features, text_features), {"logit_scale": logit_scale}
    sizes = _check(
        "SoftmaxDistillLoss",
        student,
        (t_images, t_texts),
        scalars,
        {"teacher_scale": t_scales},
        chunk_size,
        group,
        distill_weight,
    )
    world, total = rank_and_world(group)[1], sum(sizes)
    device = image_features.device
    with torch.autocast(device_type=device.type, enabled=False):  # fp32 logits, as the contrastive loss
        scale, t_scales = as_fp32(logit_scale, device), _scalars(t_scales, device)
        (all_texts,) = gather_features(text_features, sizes=sizes, group=group)
        with torch.no_grad():  # the teachers' texts: gathered once, side by side, no gradient
            (t_all_texts,) = gather_features(_side_by_side(t_texts), sizes=sizes, group=group)
        chunk = chunk_size or tile_rows(total * len(t_texts))  # an ensemble's tiles hold M + 3 tiles of logits
        terms = _SoftmaxDistill.apply(
            image_features,
            all_texts,
            scale,
            _side_by_side(t_images),
            t_all_texts,
            t_scales,
            [t.shape[1] for t in t_images],
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
    """Functional form of :class:`SigmoidDistillLoss`; see the module docstring for the exact contract. The teacher
    arguments are one teacher's tensors and scalars, or lists of M teachers' (an ensemble)."""
    logit_scale, logit_bias = as_scalar(logit_scale), as_scalar(logit_bias)
    t_images, t_texts = _as_list(teacher_image_features), _as_list(teacher_text_features)
    t_scales = [as_scalar(v) for v in _as_list(teacher_scale)]
    t_biases = [as_scalar(v) for v in _as_list(teacher_bias)]
    sizes = _check(
        "SigmoidDistillLoss",
        (image_features, text_features),
        (t_images, t_texts),
        {"logit_scale": logit_scale, "logit_bias": logit_bias},
        {"teacher_scale": t_scales, "teacher_bias": t_biases},
        chunk_size,
        group,
        distill_weight,
    )
    world, total = rank_and_world(group)[1], sum(sizes)
    device = image_features.device
    with torch.autocast(device_type=device.type, enabled=False):
        as32 = lambda v: as_fp32(v, device)
        chunk = chunk_size or tile_rows(max(sizes) * len(t_texts))
        terms = _RingSigmoidDistill.apply(
            image_features,
            text_features,
            as32(logit_scale),
            as32(logit_bias),
            _side_by_side(t_images),
            _side_by_side(t_texts),
            _scalars(t_scales, device),
            _scalars(t_biases, device),
            [t.shape[1] for t in t_images],
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
