"""Locked towers (`disco_clip_ds.train.locking`): which parameters of CLIP and SigLIP stay frozen for 0, 1 and all
unlocked layers and under --lock_image_tower_freeze_norm, against the rule written out by name; the optimizer holds
the trainable ones only; and the refusals of flags that mean nothing, on the command line. (Trained runs: launched/
test_accumulated_runs.py; the planner's count: unit/plan/test_trainable.py.)"""

import re
from types import SimpleNamespace

import pytest

from disco_clip_ds.testing.launch import REPO

CLIP, SIGLIP = REPO / "recipes/models/tiny.json", REPO / "recipes/models/siglip_tiny.json"
MODEL = ["--model_config", str(CLIP)]
TOK = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]
UNSET = dict(
    lock_image_tower=False, lock_image_tower_unlocked_layers=None, lock_image_tower_freeze_norm=False,
    lock_text_tower=False, lock_text_tower_unlocked_layers=None,
)  # fmt: skip


def flags(**given) -> SimpleNamespace:
    return SimpleNamespace(**{**UNSET, **given})


def trainable(config, **given) -> set[str]:
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.locking import lock_towers

    model = build_model(model_config=str(config))
    lock_towers(model, flags(**given))
    return {name for name, param in model.named_parameters() if param.requires_grad}


# The rule, by name, for the tiny recipes' 2-layer towers: a locked tower's parameters train only in its last N layers
# (layers.1 for N = 1; both for N = 2) and after them (post-norm, SigLIP's head, CLIP's projection).
PROJECTION = {"vision": "visual_projection.", "text": "text_projection."}


def after_layers(tower: str) -> tuple[str, ...]:
    """The names a tower's modules after its encoder layers start with, in CLIP and SigLIP."""
    return (
        f"{tower}_model.post_layernorm.",
        f"{tower}_model.final_layer_norm.",
        f"{tower}_model.head.",
        PROJECTION[tower],
    )


def tower_params(every: set[str], tower: str) -> set[str]:
    return {n for n in every if n.startswith((f"{tower}_model.", PROJECTION[tower]))}


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("config", [CLIP, SIGLIP], ids=["clip", "siglip"])
def test_a_locked_tower_trains_its_last_n_layers_and_what_follows_them(config):
    every = trainable(config)  # nothing locked
    vision, text = tower_params(every, "vision"), tower_params(every, "text")
    shared = every - vision - text
    assert shared == ({"logit_scale", "logit_bias"} if config == SIGLIP else {"logit_scale"})
    # N unset or 0: the whole tower, with its projection (open_clip's unlocked groups 0)
    assert trainable(config, lock_image_tower=True) == every - vision
    assert trainable(config, lock_image_tower=True, lock_image_tower_unlocked_layers=0) == every - vision
    assert trainable(config, lock_text_tower=True) == every - text
    # N = 1: layer 1 and what follows; layer 0, the embeddings (and CLIP's pre-LayerNorm) stay frozen
    after = {n for n in vision if n.startswith(after_layers("vision"))}
    layer1 = {n for n in vision if n.startswith("vision_model.encoder.layers.1.")}
    assert after and layer1
    assert (
        trainable(config, lock_image_tower=True, lock_image_tower_unlocked_layers=1) == every - vision | after | layer1
    )
    # N = all layers: only what runs before the layers stays frozen
    before = {n for n in text if re.match(r"text_model\.embeddings\.", n)}
    assert trainable(config, lock_text_tower=True, lock_text_tower_unlocked_layers=2) == every - before
    # both towers at once
    both = trainable(
        config, lock_image_tower=True, lock_image_tower_unlocked_layers=1, lock_text_tower=True,
        lock_text_tower_unlocked_layers=2,
    )  # fmt: skip
    assert both == shared | after | layer1 | (text - before)


def test_clip_keeps_its_vision_pre_layernorm_frozen_and_siglip_trains_its_heads():
    clip = trainable(CLIP, lock_image_tower=True, lock_image_tower_unlocked_layers=2)
    assert "vision_model.pre_layrnorm.weight" not in clip and "vision_model.embeddings.class_embedding" not in clip
    assert {"vision_model.encoder.layers.0.mlp.fc1.weight", "visual_projection.weight"} <= clip
    siglip = trainable(SIGLIP, lock_image_tower=True, lock_image_tower_unlocked_layers=1, lock_text_tower=True,
                       lock_text_tower_unlocked_layers=1)  # fmt: skip
    assert {"vision_model.head.probe", "vision_model.head.attention.in_proj_weight", "text_model.head.weight"} <= siglip
    assert "vision_model.encoder.layers.0.self_attn.q_proj.weight" not in siglip


@pytest.mark.parametrize("config", [CLIP, SIGLIP], ids=["clip", "siglip"])
def test_freeze_norm_keeps_the_vision_towers_layernorms_frozen_in_the_unlocked_layers(config):
    unlocked = dict(lock_image_tower=True, lock_image_tower_unlocked_layers=1)
    plain, frozen_norms = (
        trainable(config, **unlocked),
        trainable(config, **unlocked, lock_image_tower_freeze_norm=True),
    )
    norms = {"layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight", "layer_norm2.bias"}
    expected = {f"vision_model.encoder.layers.1.{n}" for n in norms} | {
        "vision_model.post_layernorm.weight",
        "vision_model.post_layernorm.bias",
    }
    if config == SIGLIP:  # its attention-pooling head has a LayerNorm of its own
        expected |= {"vision_model.head.layernorm.weight", "vision_model.head.layernorm.bias"}
    assert plain - frozen_norms == expected
    assert "vision_model.encoder.layers.1.mlp.fc2.weight" in frozen_norms  # the layer itself still trains


def test_model_arguments_lock_a_whole_tower_by_default():
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.args import ModelArguments
    from disco_clip_ds.train.locking import lock_towers

    model = build_model(model_config=str(CLIP))
    lock_towers(model, ModelArguments(lock_image_tower=True))
    left = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("vision_model.", "visual_projection.")) for n in left)
    assert {"logit_scale", "text_projection.weight"} <= left and any(n.startswith("text_model.") for n in left)
    lock_towers(model, ModelArguments(lock_text_tower=True))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"logit_scale"}


def test_the_optimizer_holds_the_trainable_parameters_only(tmp_path):
    """The Trainer's own two groups, and our per-tower groups (train/optim.py), leave frozen parameters out."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.args import DiscoTrainingArguments
    from disco_clip_ds.train.locking import lock_towers
    from disco_clip_ds.train.trainer import DiscoTrainer

    lock = flags(lock_image_tower=True, lock_image_tower_unlocked_layers=1, lock_text_tower=True)
    for towers in ({}, {"vision_layer_decay": 0.5}):
        model = build_model(model_config=str(CLIP))
        lock_towers(model, lock)
        args = DiscoTrainingArguments(output_dir=str(tmp_path), report_to="none", **towers)
        trainer = DiscoTrainer(model=model, args=args)
        trainer.create_optimizer()
        held = [id(p) for group in trainer.optimizer.param_groups for p in group["params"]]
        assert len(held) == len(set(held))
        assert set(held) == {id(p) for p in model.parameters() if p.requires_grad}, towers
        assert len(held) < len(list(model.parameters()))


# (arguments added to a valid command line, the refusal to expect)
REFUSED = {
    "count without the lock": (
        ["--lock_image_tower_unlocked_layers", "1"],
        "--lock_image_tower_unlocked_layers 1 says how much of a locked tower trains: add --lock_image_tower",
    ),
    "negative count": (
        ["--lock_text_tower", "--lock_text_tower_unlocked_layers", "-1"],
        "--lock_text_tower_unlocked_layers -1: the text tower has 2 encoder layers: give 0 (the whole tower frozen) "
        "to 2 (only the embeddings frozen)",
    ),
    "count above the layers": (
        ["--lock_image_tower", "--lock_image_tower_unlocked_layers", "3"],
        "--lock_image_tower_unlocked_layers 3: the vision tower has 2 encoder layers: give 0",
    ),
    "freeze norm without unlocked layers": (
        ["--lock_image_tower", "--lock_image_tower_freeze_norm"],
        "--lock_image_tower_freeze_norm keeps the LayerNorms of the vision tower's unlocked layers frozen: it needs "
        "--lock_image_tower --lock_image_tower_unlocked_layers N with N >= 1",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_locking_flags_that_mean_nothing_are_refused_in_one_line(bad_arguments_setup, train_main, capsys, case):
    extra, message = REFUSED[case]
    assert train_main("--train_shards", bad_arguments_setup["data"], *MODEL, *TOK, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_layer_count_is_the_models_own():
    """The refusal reads the config: SigLIP's tiny towers have 2 layers, a 12-layer config allows 12."""
    from disco_clip_ds.models.build import load_config
    from disco_clip_ds.plan.trainable import lock_problem

    over = flags(lock_text_tower=True, lock_text_tower_unlocked_layers=12)
    assert "the text tower has 2 encoder layers" in lock_problem(over, load_config(model_config=str(SIGLIP)))
    assert lock_problem(over, load_config(model_config=str(REPO / "recipes/models/vit_b32.json"))) is None
    assert lock_problem(flags(), load_config(model_config=str(SIGLIP))) is None
