"""The CLIP-score rules: LAION's threshold (`--clip_score_min`, cosine >= S) and DataComp's top fraction
(`--keep_fraction`, the best F of all samples, over every shard at once).

A sample's CLIP score is the cosine of its teacher image and text embeddings (the sidecar's rows), computed in float64
and stored as float32 (4 bytes a sample is what the whole run holds in memory for the scores).

Ties in `keep_fraction`: exactly k = floor(F x n) samples are kept, F read as the decimal it is written as (0.3 x 10
keeps 3, where binary floating point would make it 3.0000000000000004). The kept samples are those of score above the
k-th largest, then, among the samples whose score equals it, the earliest in input order (the shards in --shards
order, the samples in shard order) until k are kept. So the same inputs keep the same samples, whatever the order a
partition or a sort would leave equal scores in.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from disco_clip_ds.errors import UsageError


def clip_scores(image: np.ndarray, text: np.ndarray) -> np.ndarray:
    """Cosine of each row of `image` with the same row of `text` (n, d), as float32; computed in float64 and divided
    by both norms, so that embeddings stored not quite unit-norm still give the cosine."""
    image, text = np.asarray(image, np.float64), np.asarray(text, np.float64)
    dots = np.einsum("nd,nd->n", image, text)
    norms = np.linalg.norm(image, axis=1) * np.linalg.norm(text, axis=1)
    return (dots / norms).astype(np.float32)


def check_score_min(value: float) -> None:
    """A cosine threshold lies in [-1, 1]; else a UsageError in one line."""
    if not -1.0 <= value <= 1.0:
        raise UsageError(f"--clip_score_min {value:g}: give a cosine between -1 and 1 (LAION: 0.28)")


def check_fraction(value: float) -> None:
    """A fraction to keep lies in (0, 1]; else a UsageError in one line."""
    if not 0.0 < value <= 1.0:
        raise UsageError(f"--keep_fraction {value:g}: give a fraction above 0 and at most 1 (DataComp: 0.3)")


def above_min(scores: np.ndarray, score_min: float) -> np.ndarray:
    """LAION's rule: keep a sample whose score is at least `score_min` (a NaN score is never kept)."""
    return np.asarray(scores) >= np.float32(score_min)


def keep_count(n: int, fraction: float) -> int:
    """How many of `n` samples `keep_fraction` keeps: floor(F x n), F exact as written in decimal."""
    return math.floor(Fraction(repr(float(fraction))) * n)


def top_fraction(scores: np.ndarray, fraction: float) -> np.ndarray:
    """DataComp's rule: a mask keeping exactly `keep_count` samples, the best scores, ties to the earliest (see the
    module's docstring). NaN scores rank last. Memory: one float32 copy of the scores and the mask."""
    scores = np.nan_to_num(np.asarray(scores, np.float32), nan=-np.inf)
    n, k = len(scores), keep_count(len(scores), fraction)
    keep = np.zeros(n, bool)
    if k == 0:
        return keep
    kth = np.partition(scores, n - k)[n - k]  # the k-th largest score
    keep[scores > kth] = True
    equal = np.flatnonzero(scores == kth)  # in input order
    keep[equal[: k - int(keep.sum())]] = True
    return keep
