"""The planner's estimates against measured CPU peak memory: of the loss on 2 gloo ranks (softmax and sigmoid), and of
a whole training step of a real CLIPModel (the small one at its largest measured batch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disco_clip_ds import plan as P
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.memory import mmap_threshold_env, peak_extra_mib
from disco_clip_ds.testing.ranks import run_ranks

VIT = REPO / "recipes/models/vit_b32.json"


def _loss_peak_rank(rank, world, impl, batch, dim) -> float:
    """Bytes above the steady state at the peak of one forward + backward of the shipped loss `impl` on this rank,
    measured as bench/loss/loss_bench.py does: after a warm-up, gradients freed after the step."""
    import math

    import torch
    import torch.nn.functional as F

    from disco_clip_ds.losses import DiscoClipLoss

    gen = torch.Generator().manual_seed(rank)
    image, text = (
        F.normalize(torch.randn(batch // world, dim, generator=gen), dim=1).requires_grad_() for _ in range(2)
    )
    log_scale = torch.tensor(math.log(1 / 0.07), requires_grad=True)
    loss_fn = DiscoClipLoss(impl)
    warm = [t[:8].detach().requires_grad_() for t in (image, text)]
    loss_fn(*warm, log_scale.exp()).backward()  # thread pools and gloo buffers are set up once per process

    def step():
        loss_fn(image, text, log_scale.exp()).backward()
        image.grad = text.grad = log_scale.grad = None

    return peak_extra_mib(step) * 2**20


@pytest.mark.parametrize("impl", ["disco", "tiled"])
@pytest.mark.slow
def test_loss_term_within_25_percent_of_measured_peak(impl):
    """The loss working-set formula against the shipped loss's measured per-rank peak: 2 gloo ranks, B = 4096
    (below that the process's fixed costs, thread pools and gloo buffers, dominate), d = 512, fp32. Freed large
    blocks go back to the system, so that resident memory tracks live tensors. bench/plan/plan_check.py --loss
    compares more batches, worlds and dtypes from the loss benchmark's results."""
    batch, world, dim = 4096, 2, 512
    measured = max(run_ranks(_loss_peak_rank, world, impl, batch, dim, env=mmap_threshold_env(1 << 20)))
    estimate = P.loss_bytes(impl, batch, world, dim, 4)
    assert abs(estimate / measured - 1) < 0.25, (
        f"{impl}: estimate {estimate / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB"
    )


def _measured_train_peak(model: Path, batch: int, patch_dropout: float, teacher: Path | None) -> float:
    cmd = [
        sys.executable,
        "-m",
        "disco_clip_ds.testing.step_memory",
        "--model",
        str(model),
        "--batch",
        str(batch),
        "--mode",
        "train",
        "--patch_dropout",
        str(patch_dropout),
        *(["--teacher", str(teacher)] if teacher else []),
    ]
    # A fresh process with a minimal environment: nothing that earlier in-process tests left in os.environ. (Peak
    # resident memory can only overstate the step, by pages faulted in from outside it; bench/plan/plan_check.py
    # puts the estimates 2-16 % under the measured peaks, far from the 25 % bound, so one run is enough.)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])["delta_mib"] * 2**20


# the largest measured batch of the larger model; with FLIP's patch dropout at 0.5 too (the kept tokens counted);
# the tiny model taught by the small one (--teacher: frozen weights, a no-grad forward before the step, embeddings)
@pytest.mark.parametrize(
    "model, batch, patch_dropout, teacher",
    [("small", 128, 0.0, None), ("small", 128, 0.5, None), ("tiny", 256, 0.0, "small")],
)
@pytest.mark.slow
def test_estimate_within_25_percent_of_measured_cpu_peak(model, batch, patch_dropout, teacher):
    """Single process, fp32, AdamW, the model's own (local) loss: what the CPU can run. The activation
    coefficients come from ViT-B/32 and probe models (activation_fit.json), never from these models."""
    path = REPO / f"recipes/models/{model}.json"
    teacher_path = REPO / f"recipes/models/{teacher}.json" if teacher else None
    shape = P.ModelShape.from_json(path).with_patch_dropout(patch_dropout)
    taught = P.ModelShape.from_json(teacher_path) if teacher else None
    settings = P.validate_config({"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0}}, 1)
    fit = P.load_fit()
    estimate = P.memory_plan(shape, settings, fit, "local", False, float("inf"), 0.0, teacher=taught).total
    measured = _measured_train_peak(path, batch, patch_dropout, teacher_path)
    assert abs(estimate / measured - 1) < 0.25, (
        f"{model} b={batch} p={patch_dropout} teacher={teacher}: estimate {estimate / 2**20:.0f} MiB, "
        f"measured {measured / 2**20:.0f} MiB"
    )


SIGLIP_B16 = REPO / "recipes/models/siglip_b16.json"


def _sigmoid_peak_rank(rank, world, batch, dim) -> float:
    """As _loss_peak_rank, for the sigmoid loss."""
    import torch
    import torch.nn.functional as F

    from disco_clip_ds.losses.sigmoid import SigmoidLoss

    gen = torch.Generator().manual_seed(rank)
    image, text = (
        F.normalize(torch.randn(batch // world, dim, generator=gen), dim=1).requires_grad_() for _ in range(2)
    )
    scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    loss_fn = SigmoidLoss()
    loss_fn(image[:8].detach().requires_grad_(), text[:8].detach().requires_grad_(), scale, bias).backward()

    def step():
        loss_fn(image, text, scale, bias).backward()
        image.grad = text.grad = scale.grad = bias.grad = None

    return peak_extra_mib(step) * 2**20


@pytest.mark.slow
def test_sigmoid_loss_term_within_25_percent_of_measured_peak():
    """As for CLIP's losses: 2 gloo ranks, B = 4096, d = 512, fp32."""
    batch, world, dim = 4096, 2, 512
    measured = max(run_ranks(_sigmoid_peak_rank, world, batch, dim, env=mmap_threshold_env(1 << 20)))
    estimate = P.loss_bytes("tiled", batch, world, dim, 4, loss="sigmoid")
    assert abs(estimate / measured - 1) < 0.25, f"estimate {estimate / 2**20:.0f} MiB, measured {measured / 2**20:.0f}"
