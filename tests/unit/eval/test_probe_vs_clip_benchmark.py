"""The linear probe against CLIP_benchmark 1.6.2's own `metrics/linear_probe.py`, on the same features.

CLIP_benchmark runs in a subprocess of this Python with only clip_benchmark added to its path (its wheel fetched with
`pip download --no-deps`, unpacked with `pip install --no-deps --target`; torch, numpy, sklearn and tqdm are this
environment's, nothing is stubbed). It follows its CLI: `torch.manual_seed(seed)`, `random_split` for
`--val_proportion` (or a validation split of its own, `--val_split`), then `evaluate` on its feature cache. In that
subprocess only, `.cuda()` returns the module or tensor as it is and its `train`/`infer` run on "cpu" (its `evaluate`
insists on CUDA), and its `accuracy`'s `float()` of a 1-element array, refused by numpy 2, takes the element
(disco_clip_ds/testing/clip_benchmark_probe.py). On a GPU machine a third test runs it unpatched on CUDA, with its
float16 autocast.

The numbers must be equal, not close: both sides run the same torch ops (Linear, AdamW, cross-entropy, the
DataLoader's shuffling) from the same seeds in the same order, so the float arithmetic is the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.probe import linear_probe
from disco_clip_ds.testing.clip_benchmark_probe import install, run_clip_benchmark, structured_features

pytestmark = pytest.mark.slow
COMPARED = {
    "acc1": "lp_acc1",
    "acc5": "lp_acc5",
    "mean_per_class_recall": "lp_mean_per_class_recall",
    "weight_decay": "weight_decay",
}


@pytest.fixture(scope="session")
def clip_benchmark(tmp_path_factory):
    return install(tmp_path_factory.mktemp("clip_benchmark"))


CASES = [
    {"fewshot_k": -1, "val_proportion": None, "seed": 0},  # CLIP_benchmark's defaults: no sweep, weight decay 0
    {"fewshot_k": -1, "val_proportion": 0.2, "seed": 0},  # the sweep, then train + validation
    {"fewshot_k": 1, "val_proportion": 0.2, "seed": 0},
    {"fewshot_k": 5, "val_proportion": 0.2, "seed": 0},
    {"fewshot_k": 10, "val_proportion": None, "seed": 2},
]


def test_linear_probe_equals_clip_benchmark(clip_benchmark, tmp_path):
    train_x, train_y = structured_features(seed=1, n=240)
    test_x, test_y = structured_features(seed=2, n=120)
    data = {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}
    defaults = {"batch_size": 64, "epochs": 10, "lr": 0.1}
    theirs = run_clip_benchmark(clip_benchmark, [{**data, **defaults, **case} for case in CASES], tmp_path)
    val_x, val_y = structured_features(seed=3, n=60)  # a validation split of its own (--val_split)
    given_val = {"fewshot_k": -1, "val_proportion": None, "seed": 0}
    theirs += run_clip_benchmark(
        clip_benchmark, [{**data, **defaults, **given_val, "val_x": val_x, "val_y": val_y}], tmp_path / "val_split"
    )
    ours_cases = [*CASES, {**given_val, "val_features": val_x, "val_labels": val_y}]
    for case, their in zip(ours_cases, theirs, strict=True):
        ours = linear_probe(train_x, train_y, test_x, test_y, **case)
        for key, their_key in COMPARED.items():
            assert ours[key] == their[their_key], (case, key, ours, their)
    # the features are hard enough for the cases to differ: equal numbers above are not a ceiling effect
    assert len({their["lp_acc1"] for their in theirs}) >= 3 and max(t["lp_acc1"] for t in theirs) < 1
    assert any(their["weight_decay"] > 0 for their in theirs)
    # and the comparison bites: another seed, or no normalisation, gives other numbers than CLIP_benchmark's
    assert (
        linear_probe(train_x, train_y, test_x, test_y, seed=5)["mean_per_class_recall"]
        != theirs[0]["lp_mean_per_class_recall"]
    )
    unnormalised = linear_probe(train_x, train_y, test_x, test_y, normalize=False)
    assert unnormalised["mean_per_class_recall"] != theirs[0]["lp_mean_per_class_recall"]


def test_too_few_samples_for_fewshot_k_is_refused_where_clip_benchmark_gives_nothing(clip_benchmark, tmp_path):
    train_x, train_y = structured_features(seed=3, n=40)
    job = {
        "train_x": train_x,
        "train_y": train_y,
        "test_x": train_x,
        "test_y": train_y,
        "batch_size": 64,
        "epochs": 2,
        "lr": 0.1,
        "seed": 0,
        "fewshot_k": 30,
        "val_proportion": None,
    }
    assert run_clip_benchmark(clip_benchmark, [job], tmp_path) == [None]  # it prints 'insufficient data'
    with pytest.raises(UsageError, match="fewshot_k=30 needs 30 samples per class"):
        linear_probe(train_x, train_y, train_x, train_y, fewshot_k=30, epochs=2)
    assert not math.isnan(linear_probe(train_x, train_y, train_x, train_y, fewshot_k=2, epochs=2)["acc5"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CLIP_benchmark's probe unpatched runs on CUDA")
def test_linear_probe_on_cuda_with_amp_equals_clip_benchmark(clip_benchmark, tmp_path):
    """On a GPU, CLIP_benchmark runs as written (float16 autocast, its default); ours with device="cuda"."""
    train_x, train_y = structured_features(seed=1, n=240)
    test_x, test_y = structured_features(seed=2, n=120)
    data = {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}
    cases = [CASES[0], CASES[1], CASES[3]]
    jobs = [{**data, "batch_size": 64, "epochs": 10, "lr": 0.1, **case} for case in cases]
    theirs = run_clip_benchmark(clip_benchmark, jobs, tmp_path, cuda=True)
    for case, their in zip(cases, theirs):
        ours = linear_probe(train_x, train_y, test_x, test_y, device="cuda", **case)
        for key, their_key in COMPARED.items():
            assert ours[key] == their[their_key], (case, key, ours, their)
