"""Training that diverges stops: a step whose loss or gradient norm is not finite (NaN, inf), or after which the
weights about to be saved are not, ends the run at that step on every rank, with one line and exit code 1, before
the Trainer logs or saves anything of it.

The Trainer alone trains on: it logs a non-finite loss as the mean of the earlier ones (`logging_nan_inf_filter`),
DeepSpeed steps on NaN gradients in fp32 and bf16, and the run ends with exit 0 and NaN weights.
"""

from __future__ import annotations

import math

import torch

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


def non_finite_parameters(model):
    """How many of this rank's parameters (its ZeRO-3 partitions) hold a NaN or inf: a 0-dim tensor on the device
    (no host read: it rides the step's flags), or 0 for a model without parameters."""
    with torch.no_grad():
        flags = [
            (~torch.isfinite(t)).any().reshape(1).to(torch.float64)
            for t in (_local(p) for p in model.parameters() if p.numel())
        ]
        if not flags:
            return 0
        device = flags[0].device  # ZeRO-3's offloaded partitions live on the CPU: counted where the first one lives
        return torch.cat([f.to(device) for f in flags]).sum()


def _local(param):
    """This rank's own values of a parameter: its ZeRO-3 partition, its FSDP2 shard (a DTensor's local tensor: a
    DTensor would not fit the step's plain flags tensor), or the parameter itself."""
    param = getattr(param, "ds_tensor", param)
    return param.to_local() if hasattr(param, "to_local") else param


class FiniteCheck:
    """After every optimizer step, before the Trainer logs, evaluates or saves, the step's loss (this rank's micro-step
    losses, added by `add`, averaged over ranks) and its gradient norm (global under DeepSpeed) must be finite, and at
    a step that saves, every weight too; otherwise every rank raises `TrainingDiverged` at that same step (`check`).
    The numbers travel in the step's flags (train/step_flags.py): DiscoTrainer's `_maybe_log_save_evaluate` takes
    them from here and hands the verdict back."""

    def __init__(self):
        self.step_loss = None  # this rank's micro-step losses of the step, summed on the device in float64

    def add(self, loss: torch.Tensor) -> None:
        """A micro-step's loss, kept here: the Trainer replaces a non-finite loss by the mean of the earlier ones
        before it logs. Summed on the device: a host read here would stop the GPU's queue every micro-step."""
        value = loss.detach().to(torch.float64)
        self.step_loss = value if self.step_loss is None else self.step_loss + value

    def take_loss(self):
        """This rank's summed loss of the step (0.0 when none was added), and start the next step's sum."""
        loss, self.step_loss = self.step_loss, None
        return 0.0 if loss is None else loss

    @staticmethod
    def check(step: int, loss: float, grad_norm: float | None, weights_finite: bool) -> None:
        """Raise TrainingDiverged when step `step` was not finite (the numbers every rank agreed on)."""
        message = divergence_message(step, loss, grad_norm, weights_finite)
        if message:
            raise TrainingDiverged(message)
