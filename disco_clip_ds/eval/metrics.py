"""Zero-shot metrics with CLIP_benchmark's conventions: acc1, acc5 and mean per-class recall for classification,
image/text retrieval recall@k for retrieval.

Recall@k counts equal scores as CLIP_benchmark's code does (its `torch.topk` picks among them, see
`retrieval_metrics`), not in the model's favour: with repeated captions the numbers match CLIP_benchmark's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

RECALL_KS = (1, 5, 10)


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """acc1, acc5 and mean_per_class_recall of (n, n_classes) logits, as CLIP_benchmark reports them.

    acc5 is NaN with fewer than 5 classes (CLIP_benchmark's convention); mean_per_class_recall is the mean
    over the classes present in `targets` of the fraction of their images predicted right.
    """
    from sklearn.metrics import balanced_accuracy_score

    targets = targets.long()
    n_classes = logits.shape[1]
    # rank of the true class = number of classes scored strictly higher (ties count in the model's favour)
    true_scores = logits.gather(1, targets[:, None])
    rank = (logits > true_scores).sum(1)
    metrics = {"acc1": (rank < 1).double().mean().item()}
    metrics["acc5"] = (rank < 5).double().mean().item() if n_classes >= 5 else float("nan")
    with warnings.catch_warnings():  # predicting a class absent from the targets is normal here, not a problem
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        metrics["mean_per_class_recall"] = float(balanced_accuracy_score(targets.numpy(), logits.argmax(1).numpy()))
    return metrics


def hits_in_top_k(scores: torch.Tensor, positives: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, whether one of its positive columns is among the `k` that `torch.topk` returns for it (all
    columns when `k` exceeds them): CLIP_benchmark's `recall_at_k` rule, on the same scores."""
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return positives.gather(1, top).any(1)


def retrieval_metrics(
    scores: torch.Tensor, text_to_image: torch.Tensor, ks: Sequence[int] = RECALL_KS
) -> dict[str, float]:
    """CLIP_benchmark's image/text_retrieval_recall@k from (n_texts, n_images) similarity `scores`.

    `text_to_image[t]` is the image that caption t describes (an image may have several captions).
    image_retrieval_recall@k: fraction of captions whose image is among their top-k images;
    text_retrieval_recall@k: fraction of images with at least one of their captions among their top-k texts.

    Equal scores follow CLIP_benchmark's convention (`recall_at_k` in clip_benchmark/metrics/zeroshot_retrieval.py):
    the top-k of a row are the k columns that `torch.topk` returns, so of a positive tied with negatives at the k-th
    place only the ones topk picks count, never all of them in the model's favour. Repeated captions make such ties
    common in text retrieval. Which of equal scores topk picks is torch's choice (on CPU not the lowest index), so
    the numbers match CLIP_benchmark's on the same scores and torch build. A k above the number of candidates counts
    them all (CLIP_benchmark refuses it).
    """
    n_texts, n_images = scores.shape
    positives = torch.zeros_like(scores, dtype=torch.bool)
    positives[torch.arange(n_texts), text_to_image] = True
    metrics = {}
    for k in ks:
        metrics[f"image_retrieval_recall@{k}"] = hits_in_top_k(scores, positives, k).double().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = hits_in_top_k(scores.T, positives.T, k).double().mean().item()
    return metrics
