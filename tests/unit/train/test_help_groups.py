"""`disco-clip train --help` in groups (train/help_groups.py): every option in one group, ours where a user looks for
them, the parse unchanged; a mistyped option answered with the nearest one."""

from __future__ import annotations

import pytest

from disco_clip_ds.errors import UsageError
from disco_clip_ds.train.args import parse_args
from disco_clip_ds.train.help_groups import GROUPS, group_of

pytestmark = pytest.mark.slow  # HfArgumentParser over TrainingArguments' 200 fields: beyond the fast tier's budget


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    return capsys.readouterr().out


def test_train_help_lists_each_option_once_under_its_group(capsys):
    text = _help(capsys)
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["options", *(name for name, _, _ in GROUPS)]  # options: --help alone; no "other" left
    sections = {}
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            current = line[:-1]
        elif line.startswith("  --"):
            sections.setdefault(line.split()[0], []).append(current)
    assert all(len(where) == 1 for where in sections.values())
    expected = {
        "--model_config": "model", "--lock_image_tower": "model", "--train_shards": "data",
        "--dataloader_num_workers": "data", "--loss_impl": "loss", "--contrastive_accumulation": "loss",
        "--learning_rate": "optimisation", "--vision_layer_decay": "optimisation", "--ema_decay": "optimisation",
        "--teacher": "distillation", "--teacher_embeddings": "distillation", "--zeroshot_data": "evaluation",
        "--eval_tasks": "evaluation", "--output_dir": "checkpointing", "--resume_from_checkpoint": "checkpointing",
        "--deepspeed": "launch", "--fsdp": "launch", "--logging_steps": "logging",
    }  # fmt: skip
    assert {flag: sections[flag][0] for flag in expected} == expected
    assert group_of("no_ema_warmup") == "optimisation"


def test_a_mistyped_train_option_is_one_line_naming_the_nearest():
    with pytest.raises(UsageError, match=r"^unknown option --learning_rte; did you mean --learning_rate\?"):
        parse_args(["--learning_rte", "1e-3", "--output_dir", "x"])
