"""A run's training FLOPs per sample (`plan/flops.py`, over the planner's count): hand counts for the tiny CLIP
(with patch dropout and a live teacher) and the tiny SigLIP 2 at a NaFlex budget, and the forward against torch's
own FLOP counter on the real model."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPConfig, CLIPModel, Siglip2Config

from disco_clip_ds.plan.flops import forward_flops_per_sample, model_shape, training_flops_per_sample
from disco_clip_ds.testing.launch import REPO

TINY = REPO / "recipes/models/tiny.json"


def _macs(layers: int, tokens: int, hidden: int, mlp: int) -> int:
    """Per layer and token: q, k, v, out (4 h^2), the MLP (2 h m), scores and values (2 t h)."""
    return layers * tokens * (4 * hidden * hidden + 2 * hidden * mlp + 2 * tokens * hidden)


# tiny.json: both towers 2 layers of width 64, MLP 256; 64 px images of 16 px patches (16 patches + the class
# token), 32 text positions. Training = 3 x the forward, a multiply-add = 2 FLOPs.
TINY_VISION = _macs(2, 17, 64, 256) + 16 * (3 * 16 * 16) * 64  # and the patch embedding over every patch
TINY_TEXT = _macs(2, 32, 64, 256)


def test_tiny_clip_by_hand():
    shape = model_shape(CLIPConfig.from_json_file(str(TINY)))
    assert TINY_VISION == 2_531_584 and TINY_TEXT == 3_407_872
    assert training_flops_per_sample(shape) == 6 * (TINY_VISION + TINY_TEXT) == 35_636_736
    assert forward_flops_per_sample(shape) == 2 * (TINY_VISION + TINY_TEXT)


def test_patch_dropout_and_a_live_teacher():
    shape = model_shape(CLIPConfig.from_json_file(str(TINY)))
    # half the 16 patches kept: the layers see 8 + the class token; the patch embedding still sees all 16
    dropped = _macs(2, 9, 64, 256) + 16 * (3 * 16 * 16) * 64
    assert training_flops_per_sample(shape, 0.5) == 6 * (dropped + TINY_TEXT)
    # a teacher runs its forward only, over every patch: 2 FLOPs per multiply-add
    teacher = shape
    assert training_flops_per_sample(shape, 0.5, teacher) == 6 * (dropped + TINY_TEXT) + 2 * (TINY_VISION + TINY_TEXT)
    # an ensemble: each member's forward, a wider member's more
    wide = model_shape(CLIPConfig.from_json_file(str(TINY)))
    wide.towers["vision"]["layers"] *= 2
    both = training_flops_per_sample(shape, 0.5, [teacher, wide]) - training_flops_per_sample(shape, 0.5)
    assert both == 2 * (TINY_VISION + TINY_TEXT) + forward_flops_per_sample(wide) > 4 * (TINY_VISION + TINY_TEXT)


def test_siglip2_counts_its_naflex_budget():
    config = Siglip2Config.from_json_file(str(REPO / "recipes/models/siglip2_tiny.json"))
    # 4 px patches of 3 channels (48 values each), no class token; 64 text positions
    text = _macs(2, 64, 64, 256)
    for budget in (64, 256):
        vision = _macs(2, budget, 64, 256) + budget * 48 * 64
        assert training_flops_per_sample(model_shape(config, budget)) == 6 * (vision + text)


def test_the_forward_agrees_with_torchs_flop_counter_on_the_real_model():
    """torch.utils.flop_counter counts every matrix product of the real forward (eager attention: its products are
    visible): the layers' (addmm, bmm) and the patch convolution are exactly the planner's forward; the rest (mm) is
    the two projections to the embedding and the logits, which the planner leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    config = CLIPConfig.from_json_file(str(TINY))
    config._attn_implementation = "eager"
    model = CLIPModel(config).eval()
    inputs = {"pixel_values": torch.zeros(1, 3, 64, 64), "input_ids": torch.zeros(1, 32, dtype=torch.long)}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    counts = {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["convolution"] + counts["addmm"] + counts["bmm"] == forward_flops_per_sample(model_shape(config))
    assert counts["mm"] == 2 * (2 * 64 * 64 + 64)  # projections 64 -> 64 on one token each, one 1 x 1 logit


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_flops_do_not_depend_on_how_the_config_was_read(dropout, tmp_path):
    """The config object goes through the planner's own JSON reader: the same count as `disco-clip plan` reads."""
    from disco_clip_ds.plan.memory import ModelShape

    direct = ModelShape.from_json(TINY).with_patch_dropout(dropout).training_flops_per_sample()
    assert training_flops_per_sample(model_shape(CLIPConfig.from_json_file(str(TINY))), dropout) == sum(direct.values())
