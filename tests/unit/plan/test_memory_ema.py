"""The planner's EMA term (`disco-clip plan --ema`, `train --ema_decay`): fp32, one copy of the trainable weights,
partitioned over the ranks under ZeRO as train/ema.py keeps it (each rank averages its part of the fp32 masters)."""

import json

import pytest

from disco_clip_ds.testing.launch import REPO


@pytest.mark.parametrize("stage,world", [(0, 2), (2, 2), (3, 4), (1, 8)])
def test_the_ema_term_is_four_bytes_per_trainable_weight_over_the_ranks_that_share_it(tmp_path, stage, world):
    from disco_clip_ds.plan.report import plan

    config = json.loads((REPO / "ds_configs/cpu_zero2.json").read_text())
    config["zero_optimization"]["stage"] = stage
    (tmp_path / "ds.json").write_text(json.dumps(config))
    args = (tmp_path / "ds.json", REPO / "recipes/models/tiny.json", world, "40GB", 8, "fp32")
    with_ema, without = plan(*args, loss_impls=["tiled"], ema=True), plan(*args, loss_impls=["tiled"])
    trainable = with_ema["model"]["trainable"]
    terms = with_ema["memory"]["tiled"]["terms"]
    assert terms["ema"] == 4 * trainable / (world if stage else 1)
    assert with_ema["memory"]["tiled"]["total"] == pytest.approx(without["memory"]["tiled"]["total"] + terms["ema"])
    assert "ema" not in without["memory"]["tiled"]["terms"]


def test_plan_ema_flag_prints_the_term(capsys):
    from disco_clip_ds.commands.plan import main

    argv = ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"), "--model", str(REPO / "recipes/models/tiny.json")]
    assert main([*argv, "--gpus", "2", "--per_device_batch", "8", "--precision", "fp32", "--ema"]) == 0
    assert any(line.split()[:1] == ["ema"] for line in capsys.readouterr().out.splitlines())
