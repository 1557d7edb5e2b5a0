"""Every shipped DeepSpeed config parses, adds up for the world size in its name and is explained in the README."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from disco_clip_ds.plan import load_config, validate_config
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import run_training, train_command

CONFIG_DIR = Path(__file__).resolve().parents[1] / "ds_configs"
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
    config = load_config(path)
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


# The TrainingArguments that recipes/train_vit_b32.sh passes with the paper configs: the optimizer's values (the
# configs leave the optimizer to the Trainer) and those the HF Trainer checks against the JSON's explicit values.
PAPER_TRAINER_FLAGS = (
    "--bf16 --learning_rate 5e-4 --adam_beta1 0.9 --adam_beta2 0.98 --adam_epsilon 1e-6 --weight_decay 0.2 "
    "--max_grad_norm 0"
)


@pytest.mark.slow
def test_paper_config_settings_run_under_deepspeed_and_the_trainer(tmp_path):
    """Everything but the batch numbers, on 2 CPU ranks x 4 samples x K=2, 2 steps of the tiny model: bf16, ZeRO-2
    with overlap_comm, fp32 gradient reduction, torch AdamW, activation checkpointing, the README's flags, and the
    196K-on-8-GPU run's contrastive accumulation (its JSON is the 32K one's but for the batch numbers)."""
    root = CONFIG_DIR.parent
    recipe = " ".join((root / "recipes/train_vit_b32.sh").read_text().replace("\\\n", " ").split())
    for pair in re.findall(r"--\w+(?: [^-\s]\S*)?", PAPER_TRAINER_FLAGS):
        assert pair in recipe, f"recipes/train_vit_b32.sh does not pass {pair}"
    assert '--gradient_accumulation_steps "$ACCUM"' in recipe
    for config, accum in re.findall(
        r"DS_CONFIG=ds_configs/(\S+)\s+PER_GPU=\d+ ACCUM=(\d+)", recipe
    ):  # each RUN's K = its JSON's
        assert json.loads((CONFIG_DIR / config).read_text())["gradient_accumulation_steps"] == int(accum), config
    write_shards(tmp_path / "shards", 2, 8)
    config = json.loads((CONFIG_DIR / "vit_b32_196k_8gpu.json").read_text())
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert {k: v for k, v in config.items() if k not in batch_keys} == {
        k: v for k, v in json.loads((CONFIG_DIR / "vit_b32_32k_8gpu.json").read_text()).items() if k not in batch_keys
    }
    config.update(train_batch_size=16, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    cmd = [
        *train_command("deepspeed", 2),
        "--model_config",
        str(root / "recipes/models/tiny.json"),
        "--tokenizer_name",
        str(root / "recipes/tokenizer"),
        "--train_shards",
        str(tmp_path / "shards"),
        "--output_dir",
        str(tmp_path / "out"),
        "--max_steps",
        "2",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--dataloader_num_workers",
        "1",
        "--shuffle_buffer",
        "8",
        "--save_steps",
        "100",
        "--deepspeed",
        str(tmp_path / "ds.json"),
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "1",
        "--activation_checkpointing",
        *PAPER_TRAINER_FLAGS.split(),
    ]
    run_training(cmd, timeout=240)
    state = json.loads((tmp_path / "out/trainer_state.json").read_text())
    assert state["global_step"] == 2 and all(
        math.isfinite(h["train_loss"]) for h in state["log_history"] if "train_loss" in h
    )
    first = state["log_history"][0]
    assert first["global_contrastive_batch"] == 4 * 2 * 2
    # at the fresh model CLIP's loss is about ln(pairs) (measured 3.09): all 16 of the step, not a micro-step's 4
    assert abs(first["loss"] - math.log(16)) < abs(first["loss"] - math.log(4)), first
