"""The finite check (`disco_clip_ds.train.finite`): the one line that stops a diverged step, and weights that are
not finite stopping the save. (Launched runs: tests/launched/test_divergence.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from disco_clip_ds.train import finite as numerics


@pytest.mark.parametrize(
    "loss, norm, shown",
    [(math.nan, 1.0, "loss nan"), (2.0, math.inf, "gradient norm inf"), (-math.inf, None, "loss -inf")],
)
def test_a_non_finite_loss_or_norm_is_one_line_naming_the_step_and_what_to_try(loss, norm, shown):
    message = numerics.divergence_message(7, loss, norm)
    assert "\n" not in message and "at step 7" in message and shown in message
    assert "--learning_rate" in message and "fp32" in message and "without saving step 7" in message


@pytest.mark.parametrize("loss, norm", [(2.0, 1.0), (0.0, None), (1e30, 1e30)])
def test_finite_numbers_train_on(loss, norm):
    assert numerics.divergence_message(3, loss, norm) is None


def test_weights_that_are_not_finite_stop_the_save():
    message = numerics.divergence_message(4, 1.5, 2.0, weights_finite=False)
    assert "at step 4: loss 1.5, gradient norm 2, weights not finite" in message
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    assert numerics.non_finite_parameters(model) == 0
    with torch.no_grad():
        model[1].bias.fill_(math.inf)
    assert numerics.non_finite_parameters(model) == 1
