"""DataComp's image-based rule: k-means of the image embeddings, and the clusters a target set points at.

As DataComp does it: faiss k-means is trained on a seeded random sample of the embeddings (at most `--kmeans_sample`
of them; every sample of a large pool is not needed to place K centres), then every sample is assigned its nearest
centre (L2 on unit vectors, the cosine's order) with a faiss flat index. A sample is kept when its centre is the
nearest centre of at least one embedding of the target set (ImageNet's training images, in DataComp).

The searches are faiss's (data/curate/index.py).
"""

from __future__ import annotations

import numpy as np

from disco_clip_ds.data.curate.index import kmeans_centres, nearest_rows
from disco_clip_ds.errors import UsageError

NITER = 20  # faiss.Kmeans' iterations, DataComp's clustering.py's


def check_clusters(clusters: int, kmeans_sample: int) -> None:
    """K at least 1, a sample of at least K embeddings; else a UsageError in one line."""
    if clusters < 1:
        raise UsageError(f"--clusters {clusters}: give a positive number of clusters")
    if kmeans_sample < clusters:
        raise UsageError(f"--kmeans_sample {kmeans_sample}: k-means needs at least --clusters ({clusters}) embeddings")


def sample_rows(total: int, size: int, seed: int) -> np.ndarray:
    """The sorted global row indices of the k-means sample: all rows when `total` <= `size`, else `size` rows drawn
    without replacement by numpy's Generator seeded with `seed`."""
    if total <= size:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, size=size, replace=False))


def train_centres(sample: np.ndarray, clusters: int, seed: int) -> np.ndarray:
    """The (K, d) float32 centres of faiss k-means on the rows of `sample`."""
    if len(sample) < clusters:
        raise UsageError(f"--clusters {clusters}: only {len(sample)} samples have embeddings; give fewer clusters")
    return kmeans_centres(sample, clusters, seed, NITER)


def nearest_centre(centres: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    """Each row's nearest centre (int32), by a faiss flat L2 index over `centres` (faiss.Kmeans' own assignment)."""
    return nearest_rows(centres, embeddings)


def target_clusters(centres: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The sorted ids of the centres that are the nearest centre of at least one row of `target`; a UsageError when
    the target's dimension is not the sidecars' (a target embedded by another model)."""
    if target.ndim != 2 or target.shape[1] != centres.shape[1]:
        raise UsageError(
            f"--target: embeddings of dimension {target.shape[-1]}, the shards' are {centres.shape[1]}: the target "
            "was embedded by another model; embed it with the shards' teacher"
        )
    return np.unique(nearest_centre(centres, target))


def in_clusters(assigned: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The mask of the samples whose assigned centre is one of `chosen`."""
    return np.isin(assigned, chosen)
