"""The image-based rule's pieces (data/curate/clusters.py): the centres are faiss.Kmeans' own on the seeded sample, the
assignment is faiss's own search, and the chosen clusters of a hand-placed case."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from disco_clip_ds.data.curate.clusters import (
    NITER,
    check_clusters,
    in_clusters,
    nearest_centre,
    sample_rows,
    target_clusters,
    train_centres,
)
from disco_clip_ds.errors import UsageError


def _points(n=600, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((n, dim)).astype(np.float32)
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def test_centres_and_assignment_are_faiss_kmeans_own():
    points = _points()
    reference = faiss.Kmeans(points.shape[1], 12, niter=NITER, seed=3, verbose=False)
    reference.train(points)
    centres = train_centres(points, 12, seed=3)
    np.testing.assert_array_equal(centres, reference.centroids)
    _, expected = reference.index.search(points, 1)
    np.testing.assert_array_equal(nearest_centre(centres, points), expected[:, 0])


def test_the_assignment_is_the_nearest_centre_by_hand():
    centres = np.array([[0, 0], [10, 0], [0, 10]], np.float32)
    points = np.array([[1, 1], [9, -1], [6, 0], [2, 7], [4.9, 0]], np.float32)
    assert nearest_centre(centres, points).tolist() == [0, 1, 1, 2, 0]


def test_the_target_chooses_the_nearest_centre_of_each_of_its_rows():
    centres = np.array([[0, 0], [10, 0], [0, 10]], np.float32)
    assert target_clusters(centres, np.array([[9, 1], [8, 0]], np.float32)).tolist() == [1]
    assert target_clusters(centres, np.array([[0, 9], [1, 0]], np.float32)).tolist() == [0, 2]
    assert in_clusters(np.array([0, 1, 2, 1], np.int32), np.array([1])).tolist() == [False, True, False, True]


def test_a_target_of_another_dimension_is_refused():
    with pytest.raises(UsageError, match="--target: embeddings of dimension 3, the shards' are 2: .*another model"):
        target_clusters(np.zeros((2, 2), np.float32), np.zeros((1, 3), np.float32))


def test_the_sample_is_seeded_sorted_and_at_most_its_size():
    assert sample_rows(5, 10, seed=0).tolist() == [0, 1, 2, 3, 4]
    rows = sample_rows(1000, 100, seed=1)
    assert len(rows) == len(set(rows.tolist())) == 100 and (np.diff(rows) > 0).all()
    assert rows.tolist() == sample_rows(1000, 100, seed=1).tolist() != sample_rows(1000, 100, seed=2).tolist()
    expected = np.sort(np.random.default_rng(1).choice(1000, size=100, replace=False))
    assert rows.tolist() == expected.tolist()


def test_the_centres_are_the_same_on_every_run():
    points = _points(seed=1)
    np.testing.assert_array_equal(train_centres(points, 7, seed=0), train_centres(points, 7, seed=0))


def test_too_few_embeddings_or_clusters_are_refused():
    with pytest.raises(UsageError, match="--clusters 0: give a positive"):
        check_clusters(0, 10)
    with pytest.raises(UsageError, match="--kmeans_sample 5: k-means needs at least --clusters \\(10\\)"):
        check_clusters(10, 5)
    with pytest.raises(UsageError, match="only 4 samples have embeddings"):
        train_centres(_points(4), 5, seed=0)
