"""The paper configs' settings run under DeepSpeed and the Trainer (scaled down to 2 CPU ranks)."""

from __future__ import annotations

import json
import math
import re

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO, run_training, train_command

CONFIG_DIR = REPO / "ds_configs"

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
