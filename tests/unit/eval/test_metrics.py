"""eval/metrics.py: CLIP_benchmark's classification and retrieval metrics, by hand and against CLIP_benchmark's own
formulation, ties included."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.eval.metrics import classification_metrics, retrieval_metrics


@pytest.mark.slow  # beyond the fast tier's time budget
def test_classification_metrics_hand_computed():
    logits = torch.tensor(
        [
            [5, 1, 0, 0, 0, 0],  # target 0: rank 0
            [3, 2, 1, 0, 0, 0],  # target 1: rank 1 (top-5 only)
            [0, 1, 9, 0, 0, 0],  # target 2: rank 0
            [6, 5, 4, 3, 2, 1],  # target 5: rank 5 (missed by top-5)
            [1, 7, 0, 0, 0, 0],  # target 0: rank 1, predicted 1
        ],
        dtype=torch.float,
    )
    metrics = classification_metrics(logits, torch.tensor([0, 1, 2, 5, 0]))
    assert metrics["acc1"] == pytest.approx(2 / 5)
    assert metrics["acc5"] == pytest.approx(4 / 5)
    # per-class recall over classes present: 0 -> 1/2, 1 -> 0/1, 2 -> 1/1, 5 -> 0/1
    assert metrics["mean_per_class_recall"] == pytest.approx((0.5 + 0 + 1 + 0) / 4)


def test_classification_acc5_is_nan_below_five_classes():
    metrics = classification_metrics(torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 1.0]]), torch.tensor([2, 2]))
    assert metrics["acc1"] == pytest.approx(0.5) and math.isnan(metrics["acc5"])


def test_retrieval_metrics_hand_computed():
    # captions 0, 1 -> image 0; caption 2 -> image 1; caption 3 -> image 2
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3], [0.7, 0.6, 0.1], [0.4, 0.0, 0.35]])
    metrics = retrieval_metrics(scores, torch.tensor([0, 0, 1, 2]), ks=(1, 2, 5))
    # caption -> image ranks: 0, 2, 1, 1
    assert metrics["image_retrieval_recall@1"] == pytest.approx(1 / 4)
    assert metrics["image_retrieval_recall@2"] == pytest.approx(3 / 4)
    assert metrics["image_retrieval_recall@5"] == pytest.approx(1.0)
    # image -> best-caption ranks: image 0 -> 0 (caption 0), image 1 -> 1, image 2 -> 1
    assert metrics["text_retrieval_recall@1"] == pytest.approx(1 / 3)
    assert metrics["text_retrieval_recall@2"] == pytest.approx(1.0)


def _clip_benchmark_recall(scores, positives, k, batch_size=3):
    """CLIP_benchmark 1.6's rule, written out as its `recall_at_k` and `batchify` do it: per row the k indices of
    `torch.topk`, one-hot, the positives among them counted; a row is a hit when that count is above 0. Rows go
    through in batches, as there."""
    hits = []
    for start in range(0, len(scores), batch_size):
        x, y = scores[start : start + batch_size], positives[start : start + batch_size]
        topk_indices = torch.topk(x, k, dim=1)[1]
        onehot = torch.nn.functional.one_hot(topk_indices, num_classes=x.shape[1])
        true_positives = (onehot * y.view(len(x), 1, x.shape[1])).sum(dim=(1, 2))
        hits.append(true_positives / y.sum(dim=1) > 0)
    return torch.cat(hits).float().mean().item()


def _positives(text_to_image, n_images):
    positives = torch.zeros(len(text_to_image), n_images, dtype=torch.bool)
    positives[torch.arange(len(text_to_image)), text_to_image] = True
    return positives


def test_retrieval_metrics_match_clip_benchmark_formulation_on_random_scores():
    gen = torch.Generator().manual_seed(1)
    text_to_image = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 6, 6])
    scores = torch.rand(len(text_to_image), 7, generator=gen, dtype=torch.float64)
    positives = _positives(text_to_image, 7)
    metrics = retrieval_metrics(scores, text_to_image)
    for k in (1, 5):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores, positives, k))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores.T, positives.T, k))
    assert metrics["image_retrieval_recall@10"] == pytest.approx(_clip_benchmark_recall(scores, positives, 7))


def test_retrieval_ties_hand_computed():
    # every score equal: topk returns the same k columns for every (equal) row, whichever it picks, so with one
    # positive per row, each column the positive of one row, exactly k of the n rows hit. Counting ties in the
    # model's favour would give 1.
    n = 6
    metrics = retrieval_metrics(torch.zeros(n, n), torch.arange(n), ks=(1, 2, 5))
    for k in (1, 2, 5):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(k / n)
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(k / n)


def test_retrieval_ties_match_clip_benchmark_rule_on_repeated_captions():
    # as in the demo eval split: 40 images, 4 captions each drawn from 10 distinct texts, so many captions are
    # the same text (equal embeddings, equal score rows); scores rounded so that images tie too
    gen = torch.Generator().manual_seed(2)
    n_images, per_image, n_distinct = 40, 4, 10
    distinct = F.normalize(torch.randn(n_distinct, 8, generator=gen), dim=1)
    texts = distinct[torch.randint(n_distinct, (n_images * per_image,), generator=gen)]
    images = F.normalize(torch.randn(n_images, 8, generator=gen), dim=1)
    scores = (texts @ images.T * 4).round() / 4
    text_to_image = torch.arange(n_images).repeat_interleave(per_image)
    positives = _positives(text_to_image, n_images)
    metrics = retrieval_metrics(scores, text_to_image)
    for k in (1, 5, 10):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores, positives, k))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores.T, positives.T, k))
    # the rule this replaced (a positive tied at the top always hits) gives more here: the test bites
    best = scores.T.masked_fill(~positives.T, -math.inf).amax(1, keepdim=True)
    assert metrics["text_retrieval_recall@1"] < ((scores.T > best).sum(1) < 1).double().mean().item()
