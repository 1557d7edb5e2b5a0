"""The linear probe's protocol on hand-checkable cases; its agreement with CLIP_benchmark's own code is
test_probe_vs_clip_benchmark.py."""

from __future__ import annotations

import math

import pytest
import torch

from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.probe import choose_weight_decay, fewshot_indices, linear_probe, weight_decay_grid


def _separable(per_class: int = 6, n_classes: int = 3):
    """Each class a one-hot direction: after normalisation every sample of class c is exactly e_c."""
    labels = torch.arange(n_classes).repeat(per_class)
    features = torch.eye(n_classes)[labels] * torch.linspace(1, 2, len(labels))[:, None]
    return features, labels


def _clusters(seed: int, n: int, n_classes: int = 6, dim: int = 8, noise: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_classes, dim, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(n_classes).repeat(n // n_classes)
    return centres[labels] + noise * torch.randn(len(labels), dim, generator=gen), labels


def test_separable_case_is_classified_perfectly():
    x, y = _separable()
    result = linear_probe(x, y, x, y, epochs=5)
    assert result["acc1"] == 1.0
    assert result["mean_per_class_recall"] == 1.0
    assert math.isnan(result["acc5"])  # test labels below 5: CLIP_benchmark reports no acc5
    assert result["weight_decay"] == 0.0 and result["n_train"] == len(y)


def test_fewshot_indices_keep_the_first_k_of_each_class_in_the_order():
    labels = torch.tensor([0, 1, 0, 1, 0, 2, 2])
    # in the order 6, 5, 4, ...: classes 2, 2, 0, 1, 0, 1, 0; the third 0 (index 0) is one too many
    assert fewshot_indices(labels, 2, torch.arange(6, -1, -1)) == [6, 5, 4, 3, 2, 1]
    assert fewshot_indices(labels, -1, torch.arange(6, -1, -1)) == [6, 5, 4, 3, 2, 1, 0]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_fewshot_takes_k_per_class_drawn_by_the_seed():
    x, y = _clusters(seed=1, n=48)
    seeds = {}
    for seed in (0, 1):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
        chosen = fewshot_indices(y, 3, order)
        assert torch.bincount(y[chosen]).tolist() == [3] * 6
        seeds[seed] = sorted(chosen)
    assert seeds[0] != seeds[1]
    result = linear_probe(x, y, x, y, fewshot_k=3, seed=0, epochs=2)
    assert result["n_train"] == 18 and result["fewshot_k"] == 3
    assert linear_probe(x, y, x, y, fewshot_k=3, seed=0, epochs=2) == result  # a fixed seed repeats


def test_weight_decay_search_follows_clip_benchmark_grid_search():
    grid, first = weight_decay_grid()
    assert len(grid) == 97 and first == [0, 16, 32, 48, 64, 80, 96]
    assert grid[0] == pytest.approx(1e-6) and grid[12] == pytest.approx(1e-5) and grid[-1] == pytest.approx(100)
    index = {wd: i for i, wd in enumerate(grid)}
    tried = []

    def score(wd):  # peaked at grid index 41
        tried.append(index[wd])
        return 1 / (1 + (index[wd] - 41) ** 2)

    # coarse: 48 (7 away) beats 32 (9 away); +-8: 40; +-4: 40; +-2: 40 and 42 tie, the first stays; +-1: 41
    assert choose_weight_decay(score) == grid[41]
    assert tried == [0, 16, 32, 48, 64, 80, 96, 40, 56, 36, 44, 38, 42, 39, 41]
    assert choose_weight_decay(lambda wd: 0.0) == grid[0]  # nothing above 0: CLIP_benchmark keeps index 0


@pytest.mark.slow  # beyond the fast tier's time budget
def test_given_weight_decays_are_tried_one_by_one():
    assert choose_weight_decay(lambda wd: {0.5: 0.2, 0.1: 0.9, 0.01: 0.9}[wd], [0.5, 0.1, 0.01]) == 0.1
    x, y = _clusters(seed=2, n=48)
    result = linear_probe(x, y, x, y, val_proportion=0.25, weight_decays=[1e-4, 1e-2], epochs=2)
    assert result["weight_decay"] in (1e-4, 1e-2)
    assert result["n_train"] == 48  # full data: the final layer trains on train + validation


def test_fewshot_with_validation_trains_on_the_shots_alone():
    x, y = _clusters(seed=3, n=48)
    vx, vy = _clusters(seed=4, n=18)
    result = linear_probe(x, y, x, y, fewshot_k=2, val_features=vx, val_labels=vy, weight_decays=[0.0], epochs=2)
    assert result["n_train"] == 12


@pytest.mark.slow  # beyond the fast tier's time budget
def test_features_are_normalised_and_the_callers_random_state_is_kept():
    x, y = _clusters(seed=5, n=36)
    scale = torch.linspace(0.5, 3, len(y))[:, None]
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    a = linear_probe(x, y, x, y, epochs=2)
    assert torch.equal(torch.rand(3), expected_next)
    assert linear_probe(x * scale, y, x, y, epochs=2) == a
    assert linear_probe(x * scale, y, x, y, epochs=2, normalize=False) != a


def _relabelled(missing: int) -> torch.Tensor:
    """_clusters' 24 labels (classes 0..5) with class `missing` relabelled 0: a train split without that class."""
    labels = torch.arange(6).repeat(4)
    return labels.masked_fill(labels == missing, 0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fewshot_k": 5}, "fewshot_k=5 needs 5 samples per class in the train split; class 0: 4"),
        ({"train_labels": torch.zeros(3, dtype=torch.long)}, "train labels must be one per feature row"),
        ({"test_features": torch.zeros(24, 3)}, "test features have dimension 3, train features 8"),
        ({"fewshot_k": 0}, "fewshot_k must be a number of samples per class"),
        ({"train_labels": torch.zeros(24)}, "train labels must be integer class ids"),
        ({"test_labels": torch.full((24,), 9)}, "test labels include class 9, which no sample of the train split"),
        # issue 54: a class missing from train/ below the highest label was probed and reported without a word
        ({"train_labels": _relabelled(3)}, "test labels include class 3, which no sample of the train split has"),
        ({"train_labels": _relabelled(5)}, "test labels include class 5, which no sample of the train split has"),
        (
            {"val_proportion": 0.5, "val_features": torch.zeros(2, 8), "val_labels": torch.zeros(2, dtype=torch.long)},
            "not both",
        ),
        ({"val_proportion": 1.0}, "val_proportion must lie strictly between 0 and 1"),
        ({"val_features": torch.zeros(2, 8)}, "the val split needs both features and labels"),
    ],
)
def test_bad_input_is_one_line(change, message):
    x, y = _clusters(seed=6, n=24)
    args = {"train_features": x, "train_labels": y, "test_features": x, "test_labels": y, **change}
    with pytest.raises(UsageError) as error:
        linear_probe(**args)
    assert message in str(error.value) and "\n" not in str(error.value)
