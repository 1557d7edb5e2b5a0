"""OpenCLIP's optimizer set-up: warmup from the first step, on the Trainer's schedules."""

import math

import pytest
import torch
from transformers import get_scheduler

from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.train.optim import warmup_from_first_step

LR, WARMUP, STEPS = 1e-3, 10, 100


def lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])  # the lr the coming optimizer step uses
        scheduler.optimizer.step()
        scheduler.step()
    return out


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)


def test_cosine_warmup_is_open_clips_schedule_step_for_step():
    # open_clip_train.scheduler.cosine_lr, written out: (s + 1) / warmup, then a cosine over the remaining steps
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (STEPS - WARMUP))) * LR
    expected = [LR * (s + 1) / WARMUP if s < WARMUP else cosine(s) for s in range(STEPS)]
    opt = optimizer()
    stock = get_scheduler("cosine", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    assert stock.get_last_lr()[0] == 0.0  # what the shift fixes: transformers' first step would not train
    assert lrs(warmup_from_first_step(stock, WARMUP), STEPS) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_only_the_warmup_moves_and_the_state_resumes():
    opt = optimizer()
    linear = lambda opt: get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    stock = lrs(linear(optimizer()), STEPS)
    shifted = warmup_from_first_step(linear(opt), WARMUP)
    first = lrs(shifted, 30)
    assert first[:WARMUP] == pytest.approx(stock[1 : WARMUP + 1]) and first[WARMUP:] == pytest.approx(stock[WARMUP:30])
    # a resumed run rebuilds the scheduler and loads its state: it continues where the first one stopped
    resumed = warmup_from_first_step(linear(opt), WARMUP)
    resumed.load_state_dict(shifted.state_dict())
    assert lrs(resumed, STEPS - 30) == pytest.approx(stock[30:])


def test_weight_decay_goes_where_open_clip_puts_it():
    from transformers import Trainer

    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.optim import without_clip_no_decay

    model = build_model(model_config=str(REPO / "recipes/models/tiny.json"))
    stock = Trainer.get_decay_parameter_names(None, model)  # the Trainer's list (it does not use `self`)
    # open_clip_train/main.py: no decay for ndim < 2, gains, biases or logit_scale. In CLIPModel's layout every
    # such parameter is the 1-dim (or 0-dim) one, so OpenCLIP's set is exactly the >= 2-dim parameters.
    open_clip_decays = {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert set(without_clip_no_decay(stock)) == open_clip_decays
    assert set(stock) - open_clip_decays == {"logit_scale", "vision_model.embeddings.class_embedding"}


# EVA-CLIP's rule written out for the tiny recipes (2 encoder layers a tower): --vision_lr 2e-3
# --vision_layer_decay 0.5, --text_layer_decay 0.25 --text_weight_decay 0.3, --learning_rate 1e-3 --weight_decay 0.1.
# Embeddings decay^3, layer 0 decay^2, layer 1 decay^1, after the last layer decay^0. (name: (lr, weight decay))
TOWER_ARGS = dict(
    learning_rate=1e-3, weight_decay=0.1, vision_lr=2e-3, vision_layer_decay=0.5, text_layer_decay=0.25,
    text_weight_decay=0.3,
)  # fmt: skip
CLIP_RATES = {
    "vision_model.embeddings.patch_embedding.weight": (2.5e-4, 0.1),
    "vision_model.embeddings.class_embedding": (2.5e-4, 0.0),
    "vision_model.pre_layrnorm.weight": (2.5e-4, 0.0),
    "vision_model.encoder.layers.0.self_attn.q_proj.weight": (5e-4, 0.1),
    "vision_model.encoder.layers.1.mlp.fc2.bias": (1e-3, 0.0),
    "vision_model.post_layernorm.weight": (2e-3, 0.0),
    "visual_projection.weight": (2e-3, 0.1),
    "text_model.embeddings.token_embedding.weight": (1.5625e-5, 0.3),
    "text_model.embeddings.position_embedding.weight": (1.5625e-5, 0.3),
    "text_model.encoder.layers.0.mlp.fc1.weight": (6.25e-5, 0.3),
    "text_model.encoder.layers.1.layer_norm1.weight": (2.5e-4, 0.0),
    "text_model.final_layer_norm.bias": (1e-3, 0.0),
    "text_projection.weight": (1e-3, 0.3),
    "logit_scale": (1e-3, 0.0),
}
SIGLIP_RATES = {
    "vision_model.embeddings.patch_embedding.weight": (2.5e-4, 0.1),
    "vision_model.encoder.layers.1.self_attn.out_proj.weight": (1e-3, 0.1),
    "vision_model.post_layernorm.weight": (2e-3, 0.0),
    "vision_model.head.probe": (2e-3, 0.1),
    "vision_model.head.mlp.fc1.weight": (2e-3, 0.1),
    "text_model.encoder.layers.0.self_attn.k_proj.bias": (6.25e-5, 0.0),
    "text_model.head.weight": (1e-3, 0.3),
    "logit_scale": (1e-3, 0.0),
    "logit_bias": (1e-3, 0.0),
}


def _trainer(tmp_path, recipe: str, **args):
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.args import DiscoTrainingArguments
    from disco_clip_ds.train.trainer import DiscoTrainer

    model = build_model(model_config=str(REPO / "recipes/models" / recipe))
    training = DiscoTrainingArguments(
        output_dir=str(tmp_path), report_to="none", lr_scheduler_type="linear", warmup_steps=2, **args
    )
    return DiscoTrainer(model=model, args=training)


def _rates(optimizer, model) -> dict[str, tuple[float, float]]:
    """{parameter name: (its group's lr, weight decay)}; every trainable parameter in exactly one group."""
    group_of = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) not in group_of
            group_of[id(param)] = (group.get("initial_lr", group["lr"]), group["weight_decay"])
    named = dict(model.named_parameters())
    assert set(group_of) == {id(p) for p in named.values()}
    return {name: group_of[id(p)] for name, p in named.items()}


@pytest.mark.parametrize("recipe, expected", [("tiny.json", CLIP_RATES), ("siglip_tiny.json", SIGLIP_RATES)])
def test_tower_rates_and_layer_decay_follow_eva_clips_rule(tmp_path, recipe, expected):
    trainer = _trainer(tmp_path, recipe, **TOWER_ARGS)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    rates = _rates(trainer.optimizer, trainer.model)
    for name, (lr, wd) in expected.items():
        assert rates[name] == pytest.approx((lr, wd), rel=1e-12), name
    # the schedule scales every group alike: warmup 2 of 10, linear
    for _ in range(4):
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        factors = {round(g["lr"] / g["initial_lr"], 12) for g in trainer.optimizer.param_groups}
        assert len(factors) == 1, factors


def test_without_tower_settings_the_trainers_two_groups_stay(tmp_path):
    trainer = _trainer(tmp_path, "tiny.json", learning_rate=1e-3, weight_decay=0.1)
    trainer.create_optimizer()
    assert [(g["lr"], g["weight_decay"]) for g in trainer.optimizer.param_groups] == [(1e-3, 0.1), (1e-3, 0.0)]


def test_text_lr_and_vision_weight_decay_set_their_towers_alone(tmp_path):
    trainer = _trainer(
        tmp_path, "tiny.json", learning_rate=1e-3, weight_decay=0.1, text_lr=5e-4, vision_weight_decay=0.05
    )
    trainer.create_optimizer()
    rates = _rates(trainer.optimizer, trainer.model)
    assert rates["text_projection.weight"] == (5e-4, 0.1) and rates["text_model.embeddings.token_embedding.weight"] == (
        5e-4,
        0.1,
    )
    assert rates["visual_projection.weight"] == (1e-3, 0.05) and rates["vision_model.post_layernorm.bias"] == (
        1e-3,
        0.0,
    )
    assert rates["logit_scale"] == (1e-3, 0.0)
