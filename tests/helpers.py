"""Test-only helpers: reading and comparing the results of training runs. The harness the tests share with the
benchmarks (ranks, images, the image server, launches) is disco_clip_ds.testing."""

from __future__ import annotations

import json
from pathlib import Path

from disco_clip_ds.testing.launch import TINY_CONFIG


def save_initial_model(folder: Path, seed: int) -> Path:
    """Save the tiny CLIP drawn with `seed` to FOLDER: the weights that every run of an equivalence test starts from
    (under ZeRO-3, deepspeed.zero.Init draws initial weights in its own order, so no run may draw its own)."""
    import torch

    from disco_clip_ds.modeling import build_model

    torch.manual_seed(seed)
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(folder)
    return folder


def step_losses(output: Path) -> list[float]:
    """The training loss of each logged step, from the Trainer's trainer_state.json."""
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def weights(output: Path) -> dict:
    """The saved model's tensors (float32) from OUTPUT/model.safetensors."""
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(output / "model.safetensors").items()}


def assert_same_training(a: Path, b: Path, w0: dict, steps: int, loss_rtol=1e-5, update_rtol=1e-4):
    """Runs A and B logged the same `steps` per-step losses and the same weight updates, up to fp32 reduction-order
    noise."""
    import pytest
    import torch

    la, lb = step_losses(a), step_losses(b)
    assert len(la) == len(lb) == steps
    assert la == pytest.approx(lb, rel=loss_rtol)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() == w0.keys()
    update = torch.cat([(wa[k] - w0[k]).reshape(-1) for k in w0])
    gap = torch.cat([(wa[k] - wb[k]).reshape(-1) for k in w0])
    assert update.norm() > 1e-2 * torch.cat([w.reshape(-1) for w in w0.values()]).norm()  # training moved the weights
    assert gap.norm() <= update_rtol * update.norm(), f"updates differ by {gap.norm() / update.norm():.2e} (relative)"
