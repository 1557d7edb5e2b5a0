"""recipes/train_pe_b14.sh against what it names: its DeepSpeed configs add up to the 64K batch for the GPU count in
their names with the per-GPU batch the recipe passes, hold no optimizer block (LAMB refuses one), and its resolution
schedule is whole patch grids of its model."""

from __future__ import annotations

import json
import re

import pytest

from disco_clip_ds.models.resolution import parse_schedule, side_problem
from disco_clip_ds.testing.launch import REPO

RECIPE = (REPO / "recipes/train_pe_b14.sh").read_text()


def _flag(name: str) -> str:
    return re.search(rf"{name} (\S+)", RECIPE.replace("\\\n", " ")).group(1)


@pytest.mark.parametrize("gpus,per_gpu", [(64, 1024), (256, 256)])
def test_each_config_is_the_64k_batch_at_the_recipes_per_gpu_batch(gpus, per_gpu):
    assert re.search(rf"{gpus}\) DS_CONFIG=ds_configs/pe_b14_64k_{gpus}gpu.json PER_GPU={per_gpu} ", RECIPE)
    config = json.loads((REPO / f"ds_configs/pe_b14_64k_{gpus}gpu.json").read_text())
    assert config["train_micro_batch_size_per_gpu"] == per_gpu
    assert per_gpu * config["gradient_accumulation_steps"] * gpus == config["train_batch_size"] == 65536
    assert "optimizer" not in config and config["zero_optimization"]["stage"] == 2


def test_lamb_at_pes_rate_and_a_schedule_of_whole_patch_grids():
    assert _flag("--optim") == "lamb" and float(_flag("--learning_rate")) == 2e-3
    model = json.loads((REPO / _flag("--model_config")).read_text())
    stages = parse_schedule(_flag("--resolution_schedule"))
    assert [s.size for s in stages] == [98, 154, 224]
    assert side_problem(stages, model["vision_config"]["patch_size"]) is None
    assert stages[-1].size == model["vision_config"]["image_size"]
