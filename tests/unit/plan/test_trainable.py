"""The planner with locked towers (`disco_clip_ds.plan.trainable`): the parameters that train counted by hand from
the tiny configs' shapes, against the planner's count and the real model's after train/locking.py; frozen parameters
with weights but no gradients or optimizer state in every stage's model states; the flags on the command line."""

from __future__ import annotations

import json

import pytest

from disco_clip_ds import plan as P
from disco_clip_ds.commands import plan as plan_command
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.launch import REPO

CLIP, SIGLIP = REPO / "recipes/models/tiny.json", REPO / "recipes/models/siglip_tiny.json"
CFG_32K = REPO / "ds_configs/vit_b32_32k_8gpu.json"

# The tiny recipes, by hand: hidden h = 64, MLP m = 256, 2 encoder layers a tower, 64 x 64 images of 16 x 16 patches.
H, M = 64, 256
NORM = 2 * H  # a LayerNorm's gain and bias
LAYER = 4 * (H * H + H) + 2 * NORM + (H * M + M) + (M * H + H)  # q, k, v, out; 2 LayerNorms; fc1, fc2: 49984
CLIP_VISION_EMBEDDINGS = 3 * 16 * 16 * H + H + (16 + 1) * H  # patch conv (no bias), class token, 17 positions
CLIP_TEXT = 539 * H + 32 * H + 2 * LAYER + NORM  # tokens, 32 positions, layers, final LayerNorm
SIGLIP_VISION_EMBEDDINGS = 3 * 16 * 16 * H + H + 16 * H  # patch conv with a bias, 16 positions
SIGLIP_HEAD = H + (3 * H * H + 3 * H + H * H + H) + NORM + (H * M + M) + (M * H + H)  # probe, attention, norm, MLP
SIGLIP_TEXT = 539 * H + 64 * H + 2 * LAYER + NORM + (H * H + H)  # tokens, 64 positions, layers, norm, head

# (config, locking flags, trainable parameters by hand, the largest of them)
CASES = {
    "clip vision 1 layer": (
        CLIP,
        {"lock_image_tower": True, "lock_image_tower_unlocked_layers": 1},
        LAYER + NORM + H * H + CLIP_TEXT + H * H + 1,  # layer 1, post-norm, projection; the text tower; logit_scale
        539 * H,  # the token embedding
    ),
    "clip vision 1 layer, norms frozen": (
        CLIP,
        {"lock_image_tower": True, "lock_image_tower_unlocked_layers": 1, "lock_image_tower_freeze_norm": True},
        LAYER - 2 * NORM + H * H + CLIP_TEXT + H * H + 1,
        539 * H,
    ),
    "clip both, text whole": (
        CLIP,
        {"lock_image_tower": True, "lock_image_tower_unlocked_layers": 2, "lock_text_tower": True},
        2 * LAYER + NORM + H * H + 1,  # the vision layers, post-norm and projection; no pre-LayerNorm, embeddings
        H * M,  # an MLP weight: the patch and token embeddings are frozen
    ),
    "siglip vision 1 layer, norms frozen": (
        SIGLIP,
        {"lock_image_tower": True, "lock_image_tower_unlocked_layers": 1, "lock_image_tower_freeze_norm": True},
        LAYER - 2 * NORM + SIGLIP_HEAD - NORM + SIGLIP_TEXT + 2,  # no post-norm, nor the head's; logit scale, bias
        539 * H,
    ),
    "siglip text 0 layers": (
        SIGLIP,
        {"lock_text_tower": True, "lock_text_tower_unlocked_layers": 0},
        SIGLIP_VISION_EMBEDDINGS + 2 * LAYER + NORM + SIGLIP_HEAD + 2,  # the vision tower whole; logit scale, bias
        3 * 16 * 16 * H,  # the patch embedding
    ),
}


def _model_count(config, flags: dict) -> int:
    from types import SimpleNamespace

    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.plan.trainable import LOCK_ARGUMENTS
    from disco_clip_ds.train.locking import lock_towers

    model = build_model(model_config=str(config))
    lock_towers(model, SimpleNamespace(**{**{name: None for name in LOCK_ARGUMENTS}, **flags}))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("case", list(CASES))
def test_trainable_parameters_by_hand_the_planners_and_the_models(case):
    config, flags, by_hand, largest = CASES[case]
    shape = P.ModelShape.from_json(config, flags)
    assert shape.trainable == by_hand == _model_count(config, flags)
    assert shape.largest_trainable == largest
    assert shape.params == P.ModelShape.from_json(config).params == P.ModelShape.from_json(config).trainable


def test_without_locks_the_hand_counts_are_the_whole_models():
    """The hand counts above hold the whole models too (CLIP adds its vision pre-LayerNorm)."""
    clip_vision = CLIP_VISION_EMBEDDINGS + NORM + 2 * LAYER + NORM + H * H
    assert P.ModelShape.from_json(CLIP).params == clip_vision + CLIP_TEXT + H * H + 1
    siglip_vision = SIGLIP_VISION_EMBEDDINGS + 2 * LAYER + NORM + SIGLIP_HEAD
    assert P.ModelShape.from_json(SIGLIP).params == siglip_vision + SIGLIP_TEXT + 2


def test_frozen_parameters_have_weights_but_no_gradients_or_optimizer_state():
    p, t, largest, n = 1_000_000, 250_000, 10_000, 8
    # stage 0, fp32: 4 B weights of all; 4 B gradients and 8 B Adam states of the trainable ones
    assert P.model_state_bytes(p, largest, 0, "fp32", n, trainable=t) == {
        "params": 4 * p,
        "grads": 4 * t,
        "optimizer": 8 * t,
    }
    # ZeRO-1, bf16: 16-bit weights of all; 16-bit gradients and the fp32 gradient, master and Adam partitions
    one = P.model_state_bytes(p, largest, 1, "bf16", n, trainable=t)
    assert one == {"params": 2 * p, "grads": pytest.approx(2 * t + 4 * t / n), "optimizer": pytest.approx(12 * t / n)}
    # ZeRO-2: DeepSpeed's estimate for the trainable ones (2T + 18T/N) plus the frozen ones' 16-bit weights
    two = P.model_state_bytes(p, largest, 2, "bf16", n, trainable=t)
    assert sum(two.values()) == pytest.approx(2 * (p - t) + 2 * t + int(18 * t / n))
    # ZeRO-3: its estimate (4 x largest + 18T/N) plus the frozen ones' 16-bit partitions
    three = P.model_state_bytes(p, largest, 3, "bf16", n, trainable=t)
    assert sum(three.values()) == pytest.approx(4 * largest + int(18 * t / n) + 2 * (p - t) / n)
    assert three["params"] == pytest.approx(2 * p / n + 4 * largest)
    for stage in (0, 1, 2, 3):  # trainable = params is the model without locks
        assert P.model_state_bytes(p, largest, stage, "bf16", n, trainable=p) == P.model_state_bytes(
            p, largest, stage, "bf16", n
        )


def test_the_plan_command_takes_trains_locking_flags(tmp_path, capsys):
    argv = ["--deepspeed", str(CFG_32K), "--model", str(CLIP), "--gpus", "8", "--json", str(tmp_path / "p.json")]
    plan_command.main(argv)
    plain = json.loads((tmp_path / "p.json").read_text())
    capsys.readouterr()
    plan_command.main([*argv, "--lock_image_tower", "--lock_image_tower_unlocked_layers", "1"])
    locked = json.loads((tmp_path / "p.json").read_text())
    assert locked["model"]["trainable"] == CASES["clip vision 1 layer"][2]
    assert "0.3 M parameters (0.2 M trainable: gradients and Adam states for those only)" in capsys.readouterr().out
    frozen = plain["model"]["params"] - locked["model"]["trainable"]
    terms, plain_terms = locked["memory"]["tiled"]["terms"], plain["memory"]["tiled"]["terms"]
    assert terms["params"] == plain_terms["params"]  # frozen weights are still there
    assert plain_terms["optimizer"] - terms["optimizer"] == pytest.approx(12 * frozen / 8)  # ZeRO-2, bf16, 8 GPUs
    # a count the model does not have: one line, exit 2, as every planner refusal
    bad = [*argv, "--lock_text_tower", "--lock_text_tower_unlocked_layers", "5"]
    assert run_main(plan_command.main, bad, "disco-clip plan") == 2
    err = capsys.readouterr().err
    assert "--lock_text_tower_unlocked_layers 5: the text tower has 2 encoder layers" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
