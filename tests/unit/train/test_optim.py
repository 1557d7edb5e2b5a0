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
