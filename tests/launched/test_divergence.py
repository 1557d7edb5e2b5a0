"""A step whose loss or gradient norm is not finite stops the run at that step, on every rank, with one line and
exit code 1, and nothing of that step saved: the decision in-process, and launched 2-rank runs resumed from a
checkpoint whose weights hold NaN or whose optimizer state holds 1e30 (real poisoned files, resumed as a user
would). That one rank's NaN reaches every rank: tests/unit/train/test_step_flags.py."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from disco_clip_ds.checkpoint.manifest import write_manifest
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, QUICK, REPO, run_to_end
from disco_clip_ds.testing.runs import complete_checkpoints, save_initial_model

ARGS = [
    *LAUNCH_COMMON,
    "--train_num_samples",
    "64",
    "--per_device_train_batch_size",
    "4",
    "--save_steps",
    "2",
    "--optim",
    "adamw_torch",
    "--learning_rate",
    "1e-3",
    "--lr_scheduler_type",
    "constant",
    "--max_grad_norm",
    "0",
    "--deepspeed",
    str(REPO / "ds_configs/cpu_zero2.json"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run with its checkpoint-2 (AdamW state in it)."""
    root = tmp_path_factory.mktemp("numerics")
    write_shards(root / "shards", num_shards=2, per_shard=32, seed=1)
    model = save_initial_model(root / "tiny", 7)
    shards = f"{root}/shards/{{00000..00001}}.tar"
    out = root / "run"
    rc, log = run_to_end(out, _args(out, model, shards, 2), launcher=QUICK)  # the reference: starts sooner
    assert rc == 0 and complete_checkpoints(out) == ["checkpoint-2"], log[-3000:]
    return out, model, shards


def _args(out: Path, model: Path, shards: str, steps: int) -> list[str]:
    return ["--output_dir", str(out), "--model_name_or_path", str(model), "--train_shards", shards, *ARGS,
            "--max_steps", str(steps)]  # fmt: skip


def _poison(checkpoint: Path, keys: set[str], value: float) -> int:
    """Fill every float tensor held under one of `keys` (at any depth) in the DeepSpeed files of `checkpoint`
    with `value`; returns how many were filled."""
    filled = 0

    def walk(obj, under=False):
        nonlocal filled
        if isinstance(obj, torch.Tensor) and under and obj.is_floating_point():
            obj.detach().fill_(value)  # ZeRO's fp32 partitions are saved as leaves that require grad
            filled += 1
        elif isinstance(obj, dict):
            for key, item in obj.items():
                walk(item, under or key in keys)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, under)

    for path in checkpoint.glob("global_step*/*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        walk(state)
        torch.save(state, path)
    return filled


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "keys, value, step",
    [
        # the weights: the module's and ZeRO's fp32 master partitions, both of which a resume loads
        ({"module", "single_partition_of_fp32_groups"}, math.nan, 3),
        # AdamW's first moment: the first resumed step throws the weights to ~1e29, the next one overflows
        ({"exp_avg"}, 1e30, 4),
    ],
    ids=["nan_weights", "huge_optimizer_state"],
)
def test_a_poisoned_checkpoint_stops_at_the_first_non_finite_step_with_nothing_saved(
    trained, tmp_path, keys, value, step
):
    source, model, shards = trained
    out = tmp_path / "run"
    shutil.copytree(source / "checkpoint-2", out / "checkpoint-2")
    assert _poison(out / "checkpoint-2", keys, value) > 0
    write_manifest(out / "checkpoint-2")  # as a run that saved these values would have recorded them
    rc, log = run_to_end(out, [*_args(out, model, shards, 6), "--resume_from_checkpoint", "latest"])
    lines = [line for line in log.splitlines() if line.startswith("disco-clip train: ")]
    assert rc == 1, log[-3000:]
    assert len(lines) == 2 and all(f"training diverged at step {step}: loss" in line for line in lines), lines
    assert all("nan" in line or "inf" in line for line in lines), lines
    assert "Traceback" not in log, log[-3000:]
    # nothing written after the bad step: no checkpoint past the resumed one, no final model
    assert complete_checkpoints(out) == ["checkpoint-2"] and not list(out.glob("tmp-checkpoint*"))
    assert not (out / "model.safetensors").exists() and not (out / "train_results.json").exists()
