"""Several teachers' features as losses/distill.py's ensemble reads them: side by side in one tensor per modality
(one block to gather or to pass round the ring, as MobileCLIP's `teacher_dimension` splits one concatenated
feature), their logits per tile, the mean of their softmaxes, and their log-sum-exps merged across ranks. Torch only.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from disco_clip_ds.losses.tiles import as_fp32, tiles


class Teachers:
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


def mean_softmax(t_logits: list[torch.Tensor], lses: list[torch.Tensor], keep: bool = False) -> torch.Tensor:
    """(1/M) sum_t exp(T^t - lse_t): the ensemble's target from each teacher's log-sum-exps (broadcast along the
    softmax's axis). Overwrites the teachers' logits unless `keep`. Every exponent is <= 0 (a logit minus a lse
    containing it)."""
    shifted = [(x - lse) if keep else x.sub_(lse) for x, lse in zip(t_logits, lses)]
    target = shifted[0].exp_()
    for x in shifted[1:]:
        target += x.exp_()
    return target.div_(len(t_logits)) if len(t_logits) > 1 else target


def merge_columns(lse: torch.Tensor, group) -> torch.Tensor:
    """Per-rank partial column log-sum-exps (any leading shape) merged across the ranks of `group`."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # finite: every column has a row somewhere
    sums = (lse - top).exp()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return sums.log() + top


def teacher_lses(teachers: Teachers, t_texts32, b, chunk, group, world):
    """An ensemble's first pass: every teacher's row log-sum-exps (M, b) and column ones (M, B), merged across ranks."""
    m, total = len(teachers.dims), t_texts32.shape[0]
    rows_lse, cols_lse = t_texts32.new_empty(m, b), t_texts32.new_full((m, total), -torch.inf)
    for rows in tiles(b, chunk):
        for t, logits in enumerate(teachers.logits(rows, t_texts32)):
            rows_lse[t, rows] = logits.logsumexp(1)
            cols_lse[t] = torch.logaddexp(cols_lse[t], logits.logsumexp(0))
    return rows_lse, merge_columns(cols_lse, group) if world > 1 else cols_lse


def as_list(value) -> list:
    """One teacher's tensor or scalar as a list of one; a list or tuple (an ensemble) as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def side_by_side(features: list[torch.Tensor]) -> torch.Tensor:
    """The teachers' features of one modality in one detached tensor, their widths side by side (one teacher's as
    they are), in the widest dtype among them: one block to gather or to pass round the ring."""
    if len(features) == 1:
        return features[0].detach()
    dtype = functools.reduce(torch.promote_types, (f.dtype for f in features))
    return torch.cat([f.detach().to(dtype) for f in features], dim=1)


def teacher_scalars(values: list, device) -> torch.Tensor:
    """Per-teacher scalars as one detached fp32 tensor of shape (M,)."""
    return torch.stack([as_fp32(v, device).detach().reshape(()) for v in values])
