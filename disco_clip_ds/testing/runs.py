"""Reading and comparing what launched runs leave behind (losses, weights, checkpoints), and the data and initial
weights they start from."""

from __future__ import annotations

import json
from pathlib import Path

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import TINY_CONFIG


def save_initial_model(folder: Path, seed: int, config: Path = TINY_CONFIG) -> Path:
    """Save the tiny CLIP (or the model of `config`) drawn with `seed` to FOLDER: the weights that every run of an
    equivalence test starts from (one file that every run loads, whatever its launcher, stage or data)."""
    import torch

    from disco_clip_ds.models.build import build_model

    torch.manual_seed(seed)
    build_model(model_config=str(config)).save_pretrained(folder)
    return folder


def two_shards_and_init(root: Path) -> dict:
    """The launched tests' usual data: 2 shards of 32 samples and a saved tiny model, as a fixture's dict
    ("root", "shards", "model") for `run_and_data`."""
    write_shards(root / "shards", num_shards=2, per_shard=32, seed=3)
    return {
        "root": root,
        "shards": f"{root}/shards/{{00000..00001}}.tar",
        "model": save_initial_model(root / "init", 5),
    }


def run_and_data(output: Path, data: dict) -> list[str]:
    """The arguments naming a launched run's folder, its initial weights and its shards (`data`: a test's fixture
    with "model" and "shards")."""
    return ["--output_dir", str(output), "--model_name_or_path", str(data["model"]), "--train_shards", data["shards"]]


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


def same_weights(a: Path, b: Path) -> float:
    """The largest absolute difference between the saved weights of runs A and B (same keys asserted)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def complete_checkpoints(output: Path) -> list[str]:
    """The checkpoint-N folders of OUTPUT that checkpoint_problem finds complete, oldest first."""
    from disco_clip_ds.checkpoint.layout import checkpoint_problem

    found = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return [p.name for p in found if checkpoint_problem(p) is None]


def assert_trained_under_fsdp(output: Path) -> None:
    """Every checkpoint of OUTPUT holds the model state accelerate saves for an FSDP model (pytorch_model_fsdp*),
    which a run that fell back to DDP (accelerate ignoring the FSDP config on CPU) or DeepSpeed never writes."""
    saved = complete_checkpoints(output)
    assert saved, f"{output}: no checkpoint"
    assert [name for name in saved if any((output / name).glob("pytorch_model_fsdp*"))] == saved, saved
