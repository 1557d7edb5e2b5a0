"""plan/stages.py: a progressive resolution schedule in the planner: each stage's share and FLOPs against the
planner's count of the model built at that side, the schedule's FLOPs ratio by hand from those, bad schedules in one
line."""

import pytest

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.models.configs import load_config
from disco_clip_ds.plan.memory import ModelShape
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
    result = plan_stages(stages, final, lambda shape: {"tiled": 0.0})
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
