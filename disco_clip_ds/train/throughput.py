"""Throughput in the training log: samples/s, TFLOPs per device (the planner's training FLOPs per sample x samples/s
per device, plan/flops.py) and MFU, the model FLOPs utilisation: TFLOPs per device / the device's dense peak at the
run's precision (`PEAK_TFLOPS`, or --peak_tflops). docs/training.md explains each figure."""

from __future__ import annotations

import logging

import torch

from disco_clip_ds.errors import PlanConfigError

logger = logging.getLogger("disco_clip_ds.train")

# Dense peak TFLOPs (no 2:4 sparsity) per precision, from NVIDIA's data sheets: A100 (SXM4 and PCIe, 40 and 80 GB),
# H100 SXM5 / PCIe / NVL, H200 SXM / NVL. bf16 and fp16 share the tensor cores' peak; tf32 is fp32 matmuls on the
# tensor cores (torch.backends.cuda.matmul.allow_tf32, --tf32); fp32 without it runs on the CUDA cores.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
}


def device_model(name: str) -> str | None:
    """The PEAK_TFLOPS row of a device as torch.cuda.get_device_name names it (e.g. "NVIDIA H100 80GB HBM3" is an
    H100 SXM), or None for a device not in the table."""
    name = name.upper()
    for gpu in ("H200", "H100"):
        if gpu in name:
            form = "NVL" if "NVL" in name else "PCIe" if "PCIE" in name else "SXM"
            return f"{gpu} {form}"
    return "A100" if "A100" in name else None


def run_precision(args) -> str:
    """The precision the run's matrix products run in: bf16 (fp16 alike), tf32 or fp32."""
    if args.bf16 or args.fp16:
        return "bf16"
    tf32 = args.tf32 if args.tf32 is not None else torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def peak_tflops(args, device: torch.device) -> tuple[float | None, str]:
    """(dense peak TFLOPs of one device at the run's precision, where it came from); (None, why) when there is none:
    then the log holds no MFU."""
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak_tflops"
    if device.type != "cuda":
        return None, f"no dense peak is known for a {device.type} device (pass --peak_tflops to set one)"
    name = torch.cuda.get_device_name(device)
    model, precision = device_model(name), run_precision(args)
    if model is None:
        return None, f"{name} is not in the peak table (pass --peak_tflops to set its dense peak at {precision})"
    return PEAK_TFLOPS[model][precision], f"{model} dense {precision}"


class Throughput:
    """The throughput figures of each training log (`figures`) and of the whole run (`run_figures`): samples/s (all
    devices and per device), TFLOPs per device and MFU. `flops_per_sample(step)`: the training FLOPs of one sample at
    optimizer step `step` (None: not known); `peak`: the device's dense peak TFLOPs (None: no MFU, `why_no_peak` is
    logged once)."""

    def __init__(self, flops_per_sample, peak: float | None, why_no_peak: str = ""):
        self.flops_per_sample, self.peak, self.why_no_peak = flops_per_sample, peak, why_no_peak
        self.start = None  # (time, step) of the first batch
        self.last = None  # (time, step) of the last log
        self.run_flops = 0.0  # the FLOPs per device of the steps logged so far

    def started(self, now: float, step: int) -> None:
        """The clock starts at the first batch: no start-up time, and after a resume at the restored step."""
        if self.start is None:
            self.start = self.last = (now, step)

    def figures(self, now: float, step: int, samples_per_step: int, world: int) -> dict[str, float]:
        """The figures since the last log (`samples_per_step`: over all devices), and the clock restarts."""
        (last_time, last_step), self.last = self.last, (now, step)
        steps, elapsed = max(1, step - last_step), now - last_time
        per_device = steps * samples_per_step / world / elapsed
        figures = {"samples_per_s": per_device * world, "samples_per_s_per_rank": per_device}
        figures["step_time_s"] = elapsed / steps
        # the mean over the steps since the last log: patch dropout or a resolution stage may change within them
        each = [self.flops_per_sample(s) for s in range(step - steps + 1, step + 1)]
        flops = None if None in each else sum(each) / len(each)
        if flops is not None:
            self.run_flops += flops * steps * samples_per_step / world
            figures.update(self._compute(flops * per_device / 1e12))
        return figures

    def run_figures(self, samples_per_step: int, world: int) -> dict[str, float]:
        """The whole run's figures, from the first batch to the last log."""
        if self.start is None or self.last[0] <= self.start[0]:
            return {}
        elapsed = self.last[0] - self.start[0]
        per_device = (self.last[1] - self.start[1]) * samples_per_step / world / elapsed
        figures = {"train_samples_per_s_per_rank": per_device}
        if self.run_flops:
            figures.update({f"train_{k}": v for k, v in self._compute(self.run_flops / elapsed / 1e12).items()})
        return figures

    def _compute(self, tflops: float) -> dict[str, float]:
        if self.peak is None:
            if self.why_no_peak:
                logger.warning("MFU is not logged: %s", self.why_no_peak)
                self.why_no_peak = ""  # once
            return {"tflops_per_device": tflops}
        return {"tflops_per_device": tflops, "mfu": tflops / self.peak}


def flops_per_sample(model_config, args, max_num_patches: int | None = None, teacher=None, size_at=None):
    """The training FLOPs of one sample at each optimizer step, as a function of the step (1-based, as logged: patch
    dropout ends at --patch_dropout_until_step; `size_at(0-based step)`, when given and not None, is the image side
    or SigLIP 2 patch budget of a --resolution_schedule stage), from the planner's count; a function that returns
    None when the planner cannot count this model (said once in the log). `teacher`: a distillation teacher
    (train/distill.py; one whose embeddings are stored runs no forward)."""
    from disco_clip_ds.plan.flops import at_size, model_shape, training_flops_per_sample

    try:
        student = model_shape(model_config, max_num_patches)
        members = getattr(teacher, "members", [teacher])  # an ensemble's members, each its own forward
        live = [m for m in members if m is not None and getattr(m, "model", None) is not None]
        teacher_shape = [model_shape(m.config) for m in live] or None
    except (PlanConfigError, ValueError, AttributeError) as error:  # a model the planner does not know: train on
        logger.warning("TFLOPs per device are not logged: the planner cannot count this model (%s)", error)
        return lambda step: None
    until = args.patch_dropout_until_step  # the first step (1-based, as logged) that sees every patch
    sizes = {}  # size -> (masked, full): a schedule has a few stages

    def per_step(step: int) -> float:
        size = size_at(step - 1) if size_at is not None else None
        if size not in sizes:
            shape = student if size is None else at_size(student, size)
            rates = (args.patch_dropout or 0.0, 0.0)
            sizes[size] = tuple(training_flops_per_sample(shape, p, teacher_shape) for p in rates)
        return sizes[size][1 if until is not None and step >= until else 0]

    return per_step
