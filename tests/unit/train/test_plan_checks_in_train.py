"""`disco-clip train` runs the planner's checks before it builds anything: a DeepSpeed JSON that DeepSpeed or
transformers would refuse with a traceback (ZeRO stage 4, an unknown key, fp16 with bf16), a model config that
cannot be built (a negative width, heads that do not divide it, a patch of 0 or larger than the image, a projection
of 0, a NaN logit scale) and a model whose weights cannot fit the node are one line and exit 2, in `train` and
`plan` alike."""

import json

import pytest

from disco_clip_ds.commands import plan as plan_command
from disco_clip_ds.errors import UsageError, run_main
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO

TINY = REPO / "recipes/models/tiny.json"
ZERO2 = REPO / "ds_configs/cpu_zero2.json"

DEEPSPEED = {
    "zero stage 4": ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    "unknown key": ({"train_micro_batch_size": 4}, 'unknown top-level key "train_micro_batch_size"'),
    "fp16 with bf16": ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled"),
}


@pytest.mark.parametrize("case", list(DEEPSPEED))
def test_a_deepspeed_json_deepspeed_would_refuse_is_named_before_parsing(case, train_main, tmp_path, capsys):
    config, message = DEEPSPEED[case]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    argv = ["--model_config", str(TINY), "--train_shards", str(tmp_path / "none"), "--deepspeed", str(path)]
    assert train_main(*argv) == 2
    err = capsys.readouterr().err
    assert f"disco-clip train: --deepspeed {path}: DeepSpeed config problems:" in err and message in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


MODELS = {
    "negative width": (("vision_config", "hidden_size", -64), "vision_config.hidden_size -64: give a positive"),
    "heads not dividing": (("text_config", "num_attention_heads", 3), "not a multiple of the number of attention"),
    "patch 0": (("vision_config", "patch_size", 0), "vision_config.patch_size 0: give a positive whole number"),
    "patch above image": (("vision_config", "patch_size", 1000), "vision_config.image_size 64: give a whole number"),
    "projection 0": ((None, "projection_dim", 0), "projection_dim 0: give a positive whole number"),
    "nan logit scale": ((None, "logit_scale_init_value", float("nan")), "logit_scale_init_value nan: give a finite"),
}


def _bad_model(tmp_path, change) -> str:
    (section, key, value) = change
    config = json.loads(TINY.read_text())
    (config[section] if section else config)[key] = value
    path = tmp_path / "model.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("case", list(MODELS))
def test_an_unbuildable_model_config_is_one_line_in_plan_and_train(case, train_main, tmp_path, capsys):
    change, message = MODELS[case]
    model = _bad_model(tmp_path, change)
    argv = ["--deepspeed", str(ZERO2), "--model", model, "--gpus", "2", "--per_device_batch", "4"]
    assert run_main(plan_command.main, argv, "disco-clip plan") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    argv = ["--model_config", model, "--tokenizer_name", str(REPO / "recipes/tokenizer"), "--max_steps", "1"]
    assert train_main(*argv, "--train_shards", str(tmp_path / "data")) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(said) == 1 and message in said[0], said
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_model_whose_weights_exceed_the_node_is_refused_with_the_planners_figures(tmp_path):
    """A config of ~10 trillion parameters is sized on the meta device and refused before any allocation; the
    arithmetic is the planner's parameter count x 4 bytes, checked here by hand for the tiny model."""
    from disco_clip_ds.models.configs import load_config
    from disco_clip_ds.plan.memory import ModelShape
    from disco_clip_ds.train.validate.model import check_fits_host

    huge = json.loads(TINY.read_text())
    for tower in ("text_config", "vision_config"):
        huge[tower].update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=192, num_attention_heads=512)
    huge["projection_dim"] = 65536
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    with pytest.raises(UsageError, match=r"the model has [\d,.]+ billion parameters: its fp32 weights take"):
        check_fits_host(load_config(model_config=str(tmp_path / "huge.json")), None)
    tiny = load_config(model_config=str(TINY))
    params = ModelShape.from_config(tiny).params
    check_fits_host(tiny, None, host_bytes=4 * params)  # exactly fits
    with pytest.raises(UsageError, match="more than its"):
        check_fits_host(tiny, None, host_bytes=4 * params - 1)
    check_fits_host(tiny, {"zero_optimization": {"stage": 3}}, host_bytes=4 * params)  # a share under ZeRO-3
