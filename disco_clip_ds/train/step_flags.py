"""The end of an optimizer step: what every rank must agree on before the Trainer logs, evaluates or saves anything
of it (this rank's loss, the gradient norm, weights that are not finite, a data loading that failed, a stop signal)
travels in one all-reduce of a few numbers, read on the host once.

Why one: every host read of a device value waits for the GPU's queue to drain, and a collective per flag would add
one such wait each. The step's other syncs are the Trainer's and DeepSpeed's own (the HF Trainer's NaN check of
each micro-step's loss under `logging_nan_inf_filter`, its `grad_norm.item()` under DeepSpeed), not ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from disco_clip_ds.distributed.ranks import is_distributed


@dataclass(frozen=True)
class StepFlags:
    """One step's flags, the same on every rank: `loss` and `grad_norm` averaged over ranks (a NaN or inf on any rank
    reaches all of them through the sum; grad_norm None: not known), and whether the weights are finite, some rank's
    data loading failed, some rank received a stop signal."""

    loss: float
    grad_norm: float | None
    weights_finite: bool
    data_failed: bool
    stop: bool


def exchange(loss, grad_norm, bad_weights, data_failed: bool, stop: bool, device) -> StepFlags:
    """Every rank's flags of this step, summed in one all-reduce (collective: every rank calls it at the same step).

    loss: this rank's summed micro-step losses (a 0-dim tensor on the device, or a float); grad_norm: a tensor, a float
    or None; bad_weights: how many of this rank's parameters are not finite (a tensor or an int)."""
    values = torch.zeros(5, dtype=torch.float64, device=device)  # filled on the device: no copy from the host
    values[0] = loss
    if grad_norm is not None:
        values[1] = grad_norm
    values[2] = bad_weights
    values[3] = float(data_failed)
    values[4] = float(stop)
    world = 1
    if is_distributed():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        world = dist.get_world_size()
    # The step's one host read of ours: every rank must decide the same (raise, stop, train on) before the Trainer
    # goes on, and only the host can decide.
    loss_sum, norm_sum, bad, failed, stopped = values.tolist()
    norm = None if grad_norm is None else norm_sum / world
    return StepFlags(loss_sum / world, norm, bad == 0, failed > 0, stopped > 0)
