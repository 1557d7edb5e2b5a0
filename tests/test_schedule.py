"""The learning-rate warmup starts at lr / warmup on the first optimizer step, as OpenCLIP's does."""

import math

import pytest
import torch
from transformers import get_scheduler

from disco_clip_ds.train import warmup_from_first_step

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
    expected = [LR * (s + 1) / WARMUP if s < WARMUP else 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (STEPS - WARMUP))) * LR
                for s in range(STEPS)]
    opt = optimizer()
    stock = get_scheduler("cosine", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    assert stock.get_last_lr()[0] == 0.0  # what the shift fixes: transformers' first step would not train
    assert lrs(warmup_from_first_step(stock, WARMUP), STEPS) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_only_the_warmup_moves_and_the_state_resumes():
    opt = optimizer()
    stock = lrs(get_scheduler("linear", optimizer(), num_warmup_steps=WARMUP, num_training_steps=STEPS), STEPS)
    shifted = warmup_from_first_step(get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS), WARMUP)
    first = lrs(shifted, 30)
    assert first[:WARMUP] == pytest.approx(stock[1 : WARMUP + 1]) and first[WARMUP:] == pytest.approx(stock[WARMUP:30])
    # a resumed run rebuilds the scheduler and loads its state: it continues where the first one stopped
    resumed = warmup_from_first_step(get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS), WARMUP)
    resumed.load_state_dict(shifted.state_dict())
    assert lrs(resumed, STEPS - 30) == pytest.approx(stock[30:])
