"""The CLIP-score rules (data/curate/scores.py) against hand-computed cases: the cosine, LAION's threshold at its
boundary, DataComp's top fraction with ties (earliest kept) and its count read in decimal."""

from __future__ import annotations

import numpy as np
import pytest

from disco_clip_ds.data.curate.scores import (
    above_min,
    check_fraction,
    check_score_min,
    clip_scores,
    keep_count,
    top_fraction,
)
from disco_clip_ds.errors import UsageError


def test_the_score_is_the_cosine_of_the_two_rows_whatever_their_norms():
    image = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    text = np.array([[0.6, 0.8], [3.0, 4.0], [0.0, -1.0]])  # 3-4-5 triangles: cosines 0.6, 0.6, -1
    assert clip_scores(image, text).tolist() == pytest.approx([0.6, 0.6, -1.0], abs=1e-7)
    assert clip_scores(image, text).dtype == np.float32


def test_the_threshold_keeps_a_score_equal_to_it_and_never_a_nan():
    scores = np.array([0.28, 0.2799, 0.5, np.nan], np.float32)
    assert above_min(scores, 0.28).tolist() == [True, False, True, False]


@pytest.mark.parametrize("n, fraction, k", [(10, 0.3, 3), (10, 0.7, 7), (3, 0.3, 0), (7, 0.5, 3), (4, 1.0, 4)])
def test_the_fraction_keeps_floor_of_f_times_n_with_f_read_in_decimal(n, fraction, k):
    # 0.3 * 10 is 3.0000000000000004 in binary floating point and 0.7 * 10 is 7.000000000000001: 3 and 7 here
    assert keep_count(n, fraction) == k


def test_ties_at_the_cut_keep_the_earliest_samples():
    scores = np.array([0.5, 0.2, 0.5, 0.9, 0.5, 0.1], np.float32)
    # k = 3: 0.9 above the cut, then the first two of the three 0.5s in input order
    assert top_fraction(scores, 0.5).tolist() == [True, False, True, True, False, False]
    assert top_fraction(np.full(5, 0.3, np.float32), 0.4).tolist() == [True, True, False, False, False]


def test_without_ties_the_fraction_keeps_the_top_k_by_a_full_sort():
    rng = np.random.default_rng(0)
    scores = rng.permutation(1000).astype(np.float32) / 1000  # distinct
    keep = top_fraction(scores, 0.3)
    reference = np.zeros(1000, bool)
    reference[np.argsort(-scores.astype(np.float64))[:300]] = True
    assert keep.sum() == 300 and (keep == reference).all()


def test_a_nan_score_ranks_last():
    scores = np.array([np.nan, 0.1, -0.5], np.float32)
    assert top_fraction(scores, 0.67).tolist() == [False, True, True]


@pytest.mark.parametrize("value", [-1.01, 1.5, float("nan")])
def test_a_threshold_out_of_range_is_refused(value):
    with pytest.raises(UsageError, match="--clip_score_min .*between -1 and 1"):
        check_score_min(value)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.2, float("nan")])
def test_a_fraction_out_of_range_is_refused(value):
    with pytest.raises(UsageError, match="--keep_fraction .*above 0 and at most 1"):
        check_fraction(value)
