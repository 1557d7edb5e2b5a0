"""Every shipped DeepSpeed config parses, adds up for the world size in its name and is explained in the README."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from disco_clip_ds.plan import read_deepspeed_json, validate_config
from disco_clip_ds.testing.launch import REPO

CONFIG_DIR = REPO / "ds_configs"

CONFIGS = sorted(CONFIG_DIR.glob("*.json"))


def world_size_from_name(path: Path) -> int:
    """vit_b32_32k_8gpu.json -> 8; cpu_*.json are for the 2 gloo ranks of the CPU tests and quickstart."""
    if path.name.startswith("cpu_"):
        return 2
    match = re.search(r"_(\d+)gpu\.json$", path.name)
    assert match, f"{path.name}: name the world size as *_<N>gpu.json (or cpu_*.json for 2 CPU ranks)"
    return int(match.group(1))


def test_the_paper_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"vit_b32_32k_8gpu.json", "vit_b32_196k_64gpu.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_batch_arithmetic_matches_world_size_in_name(path):
    config = json.loads(path.read_text())  # plain json: the arithmetic is checked here independently of the planner
    world = world_size_from_name(path)
    values = [
        config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ]
    if "auto" in values:
        readme = (CONFIG_DIR / "README.md").read_text()
        assert any(path.name in line and '"auto"' in line for line in readme.splitlines()), (
            f'{path.name} leaves batch values to the Trainer ("auto"); ds_configs/README.md must say so'
        )
        return
    train, micro, accum = values[0], values[1], values[2] or 1
    assert train == micro * accum * world, f"{path.name}: {train} != {micro} x {accum} x {world}"
    if path.name.startswith(("vit_b32_", "siglip_b16_")):  # the contrastive batch in the name: micro x world x K
        size = re.search(r"_(\d+)k_", path.name).group(1)
        assert micro * accum * world == {"32": 32768, "196": 196608}[size]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_passes_validation(path):
    """The planner's checks accept the config without a warning, and read the batch numbers the name promises."""
    config = read_deepspeed_json(path)
    per_device = None
    if config.get("train_micro_batch_size_per_gpu") == "auto":
        per_device = 8
    world = world_size_from_name(path)
    settings = validate_config(config, world, per_device_batch=per_device)  # raises PlanConfigError on a problem
    assert settings.warnings == [], settings.warnings
    assert settings.world == world
    assert settings.train_batch == settings.micro_batch * settings.grad_accum * world
    if per_device is None:
        assert settings.micro_batch == config["train_micro_batch_size_per_gpu"]
        assert settings.train_batch == config["train_batch_size"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_is_explained_in_readme(path):
    assert f"`{path.name}`" in (CONFIG_DIR / "README.md").read_text(), (
        f"ds_configs/README.md does not explain {path.name}"
    )


def test_paper_configs_keep_planner_inputs_explicit():
    for name in ("vit_b32_32k_8gpu.json", "vit_b32_196k_64gpu.json", "vit_b32_196k_8gpu.json"):
        text = (CONFIG_DIR / name).read_text()
        assert '"auto"' not in text, f'{name}: the planner needs every value; no "auto" in the paper configs'
        config = json.loads(text)
        assert config["bf16"]["enabled"] is True and config["zero_optimization"]["stage"] == 2
