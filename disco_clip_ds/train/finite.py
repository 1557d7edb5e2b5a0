"""Training that diverges stops: a step whose loss or gradient norm is not finite (NaN, inf), or after which the
weights about to be saved are not, ends the run at that step on every rank, with one line and exit code 1, before
the Trainer logs or saves anything of it.

The Trainer alone trains on: it logs a non-finite loss as the mean of the earlier ones (`logging_nan_inf_filter`),
DeepSpeed steps on NaN gradients in fp32 and bf16, and the run ends with exit 0 and NaN weights.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from disco_clip_ds.distributed.ranks import is_distributed
from disco_clip_ds.errors import TrainingDiverged


def divergence_message(step: int, loss: float, grad_norm: float | None, weights_finite: bool = True) -> str | None:
    """The one line that stops training at `step`, or None when `loss`, `grad_norm` (None: not known) and the
    weights are finite."""
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)) and weights_finite:
        return None
    norm = "" if grad_norm is None else f", gradient norm {grad_norm:g}"
    weights = "" if weights_finite else ", weights not finite after it"
    return (
        f"training diverged at step {step}: loss {loss:g}{norm}{weights}; stopped without saving step {step} (the "
        "earlier checkpoints are as they were). Try a lower --learning_rate or --max_grad_norm 1, check the training "
        "data, resume from an earlier checkpoint if the run was resumed, or train in fp32 instead of bf16/fp16"
    )


def global_step_numbers(
    loss: float, grad_norm: float | None, bad_weights: int, device
) -> tuple[float, float | None, bool]:
    """(loss averaged over ranks, gradient norm averaged over ranks or None, whether the weights are finite on every
    rank): one all-reduce of three numbers, so that every rank sees the same values and decides the same; a NaN or
    inf on any rank reaches all of them through the sum."""
    has_norm = grad_norm is not None
    values = torch.tensor(
        [loss, grad_norm if has_norm else 0.0, float(bad_weights)], dtype=torch.float64, device=device
    )
    world = 1
    if is_distributed():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        world = dist.get_world_size()
    loss_sum, norm_sum, bad = values.tolist()
    return loss_sum / world, (norm_sum / world if has_norm else None), bad == 0


def non_finite_parameters(model) -> int:
    """How many of this rank's parameters (its ZeRO-3 partitions) hold a NaN or inf."""
    with torch.no_grad():
        return sum(int(not torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in model.parameters() if p.numel())


class FiniteCheck:
    """After every optimizer step, before the Trainer logs, evaluates or saves (DiscoTrainer's
    `_maybe_log_save_evaluate` calls `check`), the step's loss (this rank's micro-step losses, added by `add`,
    averaged over ranks) and its gradient norm (global under DeepSpeed) must be finite, and at a step that saves,
    every weight too; otherwise every rank raises `TrainingDiverged` at that same step. One all-reduce of three
    numbers per step."""

    def __init__(self):
        self.step_loss = 0.0
        self.checked_step = None

    def add(self, loss: torch.Tensor) -> None:
        """A micro-step's loss, kept here: the Trainer replaces a non-finite loss by the mean of the earlier ones
        before it logs."""
        self.step_loss += loss.detach().double().item()

    def check(self, step: int, grad_norm, model, saves: bool, device) -> None:
        """Raise TrainingDiverged on every rank when step `step` was not finite (`saves`: the step saves)."""
        if step == self.checked_step:  # the Trainer logs again, for the same step, at an epoch's end
            return
        self.checked_step = step
        norm = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        bad = non_finite_parameters(model) if saves else 0  # what the save would write
        loss, norm, weights_finite = global_step_numbers(self.step_loss, norm, bad, device)
        self.step_loss = 0.0
        message = divergence_message(step, loss, norm, weights_finite)
        if message:
            raise TrainingDiverged(message)
