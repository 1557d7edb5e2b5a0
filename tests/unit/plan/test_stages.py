"""plan/stages.py: a progressive resolution schedule in the planner: each stage's share and FLOPs against the
planner's count of the model built at that side, the schedule's FLOPs ratio by hand from those, bad schedules in one
line."""

import re

import pytest

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.models.configs import load_config
from disco_clip_ds.plan.memory import ModelShape, Settings
from disco_clip_ds.plan.stages import format_stages, plan_stages, schedule_stages
from disco_clip_ds.testing.launch import REPO

VIT_B32 = REPO / "recipes/models/vit_b32.json"


def _shape_at(side: int) -> ModelShape:
    config = load_config(model_config=str(VIT_B32))
    config.vision_config.image_size = side
    return ModelShape.from_config(config)


@pytest.mark.slow  # counts four ViT-B/32 models on the meta device
def test_the_schedules_flops_are_each_stages_share_of_the_model_built_at_its_side():
    final = _shape_at(320)
    stages = schedule_stages("0:96,0.35:160,0.7:224,0.95:320", final)
    assert [size for _, size in stages] == [96, 160, 224, 320]
    assert [share for share, _ in stages] == pytest.approx([0.35, 0.35, 0.25, 0.05])
    settings = Settings(
        world=8, micro_batch=64, grad_accum=4, train_batch=2048, stage=2, precision="bf16", comm_bytes=2
    )
    result = plan_stages(stages, final, lambda shape, batch: {"tiled": (0.0, True)}, settings, [256, 128, 64, 64])
    assert [(row["micro_batch"], row["grad_accum"]) for row in result["stages"]] == [(256, 1), (128, 2), (64, 4)] + [
        (64, 4)
    ]
    flops = {side: sum(_shape_at(side).training_flops_per_sample().values()) for side in (96, 160, 224, 320)}
    assert [row["flops_per_sample"] for row in result["stages"]] == [flops[s] for s in (96, 160, 224, 320)]
    assert [row["vision_tokens"] for row in result["stages"]] == [10, 26, 50, 101]  # (side / 32)^2 + class token
    by_hand = (0.35 * flops[96] + 0.35 * flops[160] + 0.25 * flops[224] + 0.05 * flops[320]) / flops[320]
    assert result["flops_vs_fixed"] == pytest.approx(by_hand)
    assert "x those of every step at the last size" in format_stages(result, 2**30)[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "says"),
    [("0:98,0.5:224", "side 98 is not a multiple of the patch size 32; use 96 or 128"), ("0:224,0.5:96", "increase")],
)
def test_a_bad_schedule_is_one_line(text, says):
    with pytest.raises(PlanConfigError, match=says) as error:
        schedule_stages(text, _shape_at(224))
    assert "\n" not in str(error.value)


@pytest.mark.slow  # plans ViT-B/32 three times
def test_a_stages_micro_batch_is_planned_as_a_run_at_that_side_and_micro_batch(tmp_path):
    """--stage_micro_batch_sizes: the 96 px stage at 12288 x K 2 of the 196K config's 3072 x 8 plans as a run of a
    model built at 96 px whose DeepSpeed config says 12288 x 2; the last stage as the run itself; a stage past the
    GPU's memory is marked OOM."""
    import json

    from disco_clip_ds.plan.report import plan

    config = json.loads((REPO / "ds_configs/vit_b32_196k_8gpu.json").read_text())
    at_96 = json.loads(VIT_B32.read_text())
    at_96["vision_config"]["image_size"] = 96
    (tmp_path / "vit_b32_96.json").write_text(json.dumps(at_96))
    merged = {**config, "train_micro_batch_size_per_gpu": 12288, "gradient_accumulation_steps": 2}
    (tmp_path / "merged.json").write_text(json.dumps(merged))
    common = {"gpus": 8, "gpu_memory": "40GB", "activation_checkpointing": True, "loss_impls": ("tiled",)}
    staged = plan(
        REPO / "ds_configs/vit_b32_196k_8gpu.json",
        VIT_B32,
        resolution_schedule="0:96,0.35:160,0.7:224",
        stage_micro_batch_sizes="12288,6144,3072",
        **common,
    )
    first, _, last = staged["resolution_stages"]["stages"]
    run_at_96 = plan(tmp_path / "merged.json", tmp_path / "vit_b32_96.json", **common)["memory"]["tiled"]["total"]
    # the stage keeps the model's parameters (position embeddings for 224 px, 40 more than at 96): their states alone
    # differ, 0.13 MB of 41 GiB; a stage planned at the run's micro-batch would be 28 GiB off
    assert first["memory"]["tiled"] == pytest.approx(run_at_96, rel=1e-5) and first["memory"]["tiled"] > run_at_96
    assert last["memory"]["tiled"] == staged["memory"]["tiled"]["total"]
    assert (first["fits"]["tiled"], last["fits"]["tiled"]) == (False, True)
    lines = format_stages(staged["resolution_stages"], 2**30)
    assert "12288 x 2" in lines[1] and lines[1].endswith("(OOM)") and "3072 x 8" in lines[3]


@pytest.mark.slow  # plans ViT-B/32 twice
def test_plan_exits_1_when_a_stage_does_not_fit_at_its_micro_batch(capsys):
    from disco_clip_ds.commands.plan import main

    argv = ["--deepspeed", str(REPO / "ds_configs/vit_b32_196k_8gpu.json"), "--model", str(VIT_B32), "--gpus", "8"]
    argv += ["--gpu_memory", "40GB", "--activation_checkpointing", "--loss_impl", "tiled"]
    argv += ["--resolution_schedule", "0:96,0.35:160,0.7:224", "--stage_micro_batch_sizes"]
    assert main([*argv, "6144,6144,3072"]) == 0
    assert main([*argv, "12288,6144,3072"]) == 1  # the run itself fits: the 96 px stage does not
    assert capsys.readouterr().out.count("(OOM)") == 1


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "--stage_micro_batch_sizes sets each --resolution_schedule stage's: give the schedule"),
        (
            ["--resolution_schedule", "0:96,0.5:224", "--no_contrastive_accumulation"],
            "with contrastive accumulation off (--contrastive_accumulation false) a larger micro-batch would contrast",
        ),
        (["--resolution_schedule", "0:96,0.5:224"], "micro-batch 5000: each stage's must be a multiple of"),
    ],
)
def test_plan_refuses_stage_micro_batches_it_cannot_plan_in_one_line(extra, says):
    from disco_clip_ds.commands.plan import main

    argv = ["--deepspeed", str(REPO / "ds_configs/vit_b32_196k_8gpu.json"), "--model", str(VIT_B32), "--gpus", "8"]
    sizes = "5000,3072" if "--no_contrastive_accumulation" not in extra and extra else "6144,3072"
    with pytest.raises(PlanConfigError, match=re.escape(says)) as error:
        main([*argv, "--gpu_memory", "40GB", *extra, "--stage_micro_batch_sizes", sizes])
    assert "\n" not in str(error.value)
