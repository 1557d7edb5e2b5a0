"""train/resolution.py and the schedule's checks and FLOPs: each training forward of a step sees the batch at that
step's side (with the position embeddings interpolated), evaluation outside a step the batch as made; the run's side
the schedule's last, under any ZeRO stage (unit/models/test_resolution.py steps at an earlier side under ZeRO-3);
the FLOPs per sample of each stage against the planner's count of a model built at that side, and the logged mean
over a log interval that spans a boundary."""

from types import SimpleNamespace

import pytest
import torch

from disco_clip_ds.models.configs import load_config
from disco_clip_ds.models.resolution import describe_schedule
from disco_clip_ds.plan.flops import at_size, model_shape, training_flops_per_sample
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.train import throughput as tp
from disco_clip_ds.train.resolution import StepResolution
from disco_clip_ds.train.validate.resolution import check_resolution_schedule

TINY = load_config(model_config=str(REPO / "recipes/models/tiny.json"))  # 64 px, 16 px patches
SIGLIP2 = load_config(model_config=str(REPO / "recipes/models/siglip2_tiny.json"))


def _args(schedule, max_steps=10, micro=2, accumulation=1, stage_micro=None, **more):
    return SimpleNamespace(
        resolution_schedule=schedule,
        max_steps=max_steps,
        patch_dropout=0.0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        stage_micro_batch_sizes=stage_micro,
        **more,
    )


def test_each_forward_of_a_step_sees_the_steps_side_and_evaluation_the_batch_as_made():
    resolution = StepResolution(_args("0:32,0.5:64"), TINY)
    batch = {"pixel_values": torch.randn(2, 3, 64, 64), "input_ids": torch.ones(2, 4, dtype=torch.long)}
    assert resolution.resized(batch) is batch  # outside a training step
    with resolution.at_step(4):  # steps 0-4: 32 px
        early = resolution.resized(batch)
    assert early["pixel_values"].shape == (2, 3, 32, 32) and early["interpolate_pos_encoding"] is True
    assert early["input_ids"] is batch["input_ids"] and batch["pixel_values"].shape[-1] == 64  # the batch kept
    with resolution.at_step(5):  # the last stage: the model's own side, no interpolation
        assert resolution.resized(batch) is batch
    assert StepResolution(_args(None), TINY).resized(batch) is batch
    # the patch grid whose masks the step keeps (patch dropout: models/patch_dropout.py `at_grid`)
    assert [resolution.patches_per_image(step) for step in (0, 4, 5, 9)] == [4, 4, 16, 16]
    assert StepResolution(_args(None), TINY).patches_per_image(0) is None


def test_a_steps_forwards_merge_the_micro_batches_its_stage_takes_at_once():
    """--stage_micro_batch_sizes 8,4,2 over micro-batches of 2, K = 4: steps 0-2 run 4 micro-batches a forward, 3-6
    two, 7-9 one; without the flag each runs alone."""
    resolution = StepResolution(_args("0:32,0.3:48,0.7:64", micro=2, accumulation=4, stage_micro="8,4,2"), TINY)
    assert [resolution.merged_at(step) for step in range(10)] == [4, 4, 4, 2, 2, 2, 2, 1, 1, 1]
    assert StepResolution(_args("0:32,0.5:64", accumulation=4), TINY).merged_at(0) == 1
    assert StepResolution(_args(None), TINY).merged_at(0) == 1
    assert describe_schedule("0:32,0.3:48,0.7:64", 10, "8,4,2", 2, 4) == (
        "32 from step 1 (micro-batch 8), 48 from step 4 (micro-batch 4), 64 from step 8 (micro-batch 2)"
    )


def test_a_naflex_step_packs_the_batch_at_its_budget():
    resolution = StepResolution(_args("0:4,0.5:16"), SIGLIP2)
    patch = SIGLIP2.vision_config.patch_size
    batch = {
        "pixel_values": torch.randn(1, 16, patch * patch * 3),
        "pixel_attention_mask": torch.ones(1, 16, dtype=torch.int32),
        "spatial_shapes": torch.tensor([[4, 4]]),
    }
    with resolution.at_step(0):
        early = resolution.resized(batch)
    assert early["pixel_values"].shape == (1, 4, patch * patch * 3) and early["spatial_shapes"].tolist() == [[2, 2]]
    assert early["pixel_attention_mask"].dtype == torch.int32 and "interpolate_pos_encoding" not in early


def test_the_runs_side_is_the_schedules_last():
    model_args = SimpleNamespace(teacher=None, image_size=None, model_name_or_path="some/model", max_num_patches=None)
    assert check_resolution_schedule(_args("0:32,0.5:96"), model_args, TINY, 64, None) == (96, None)  # resized
    assert check_resolution_schedule(_args(None), model_args, TINY, 64, None) == (64, None)


@pytest.mark.slow  # counts five models on the meta device (the planner's first count imports DeepSpeed's init)
def test_each_stages_flops_are_the_planners_count_of_the_model_built_at_that_side():
    at_32 = load_config(model_config=str(REPO / "recipes/models/tiny.json"))
    at_32.vision_config.image_size = 32
    for shape, reference in (
        (at_size(model_shape(TINY), 32), model_shape(at_32)),
        (at_size(model_shape(SIGLIP2, 64), 16), model_shape(SIGLIP2, 16)),
    ):
        # the towers as the images make them (the parameters are the model's: its embeddings at the last side)
        assert (shape.towers, shape.image) == (reference.towers, reference.image)
    per_sample = tp.flops_per_sample(
        TINY, _args("0:32,0.5:64", patch_dropout_until_step=None), size_at=lambda s: 32 if s < 5 else 64
    )
    small, full = (training_flops_per_sample(model_shape(c)) for c in (at_32, TINY))
    assert [per_sample(step) for step in (1, 5, 6, 10)] == [small, small, full, full]  # logged steps: 1-based
    throughput = tp.Throughput(per_sample, peak=1.0)
    throughput.started(0.0, 0)
    figures = throughput.figures(1.0, 6, samples_per_step=1, world=1)  # steps 1-6: five at 32 px, one at 64
    assert figures["tflops_per_device"] == pytest.approx((5 * small + full) / 1e12)
