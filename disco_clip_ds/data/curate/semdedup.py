"""SemDeDup (Abbas et al., "SemDeDup: Data-efficient learning at web-scale through semantic deduplication", 2023;
facebookresearch/SemDeDup): semantic near-copies found among the stored image embeddings, within k-means clusters.

As SemDeDup's code does it (clustering/sort_clusters.py, semdedup.py, with its default `which_to_keep: hard`):

1. k-means of the embeddings (faiss, seeded; data/curate/clusters.py, the one the image-based rule trains: L2 on
   the unit embeddings, where SemDeDup's configuration runs faiss's spherical k-means), each sample assigned its
   nearest centre;
2. within a cluster, the samples ordered by cosine similarity to their centre, least similar first (SemDeDup sorts by
   distance to the centroid, descending; ties here by input order);
3. a sample is removed when its cosine with any sample before it in that order is above 1 - eps (the column maximum
   of the upper triangle of the cluster's similarity matrix).

So of a group of near-copies the one least similar to the cluster's centre is kept (SemDeDup's "hard" example).
The rule is SemDeDup's, not a grouping: in a chain a ~ b ~ c where a and c are not within 1 - eps, b and c are
both removed (c is near b, though b goes too). Cosines are computed in float64 of the L2-normalised embeddings
(a cluster at a time, a block of columns of its similarity matrix at a time), so that float16 or float32 rounding
of the stored embeddings' products does not decide a pair.

What it holds: the pool's image embeddings as stored in float32 (n x d x 4 B), and one cluster's rows in float64
with a block of its similarity matrix (BLOCK x cluster size x 8 B). What it costs: the pairs within each cluster,
about n^2 / K products of d values for K clusters of equal size.
"""

from __future__ import annotations

import numpy as np

from disco_clip_ds.errors import UsageError

BLOCK = 1024  # columns of a cluster's similarity matrix computed at once: BLOCK x cluster size float64


def check_semdedup(eps: float | None, clusters: int, kmeans_sample: int) -> None:
    """eps in (0, 1) and at least one cluster, sampled from at least as many embeddings; else a UsageError."""
    if eps is None:
        return
    if not 0 < eps < 1:
        raise UsageError(f"--semdedup_eps {eps}: give a number between 0 and 1 (a pair above cosine 1 - E is a copy)")
    if clusters < 1:
        raise UsageError(f"--semdedup_clusters {clusters}: give a positive number of clusters")
    if kmeans_sample < clusters:
        raise UsageError(
            f"--kmeans_sample {kmeans_sample}: k-means needs at least --semdedup_clusters ({clusters}) embeddings"
        )


def unit_rows(embeddings: np.ndarray) -> np.ndarray:
    """The rows as float64 unit vectors (a zero row stays zero)."""
    rows = np.asarray(embeddings, np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1.0)


def removed(embeddings: np.ndarray, assigned: np.ndarray, centres: np.ndarray, eps: float) -> np.ndarray:
    """The mask of the rows SemDeDup removes, given each row's cluster (`assigned`, ids into `centres`)."""
    centres = unit_rows(centres)
    gone = np.zeros(len(embeddings), bool)
    order = np.argsort(assigned, kind="stable")
    bounds = np.flatnonzero(np.diff(assigned[order])) + 1
    for members in np.split(order, bounds):
        if len(members) > 1:
            gone[members] = _removed_in_cluster(
                unit_rows(embeddings[members]), centres[assigned[members[0]]], 1.0 - eps
            )
    return gone


def _removed_in_cluster(rows: np.ndarray, centre: np.ndarray, threshold: float) -> np.ndarray:
    """One cluster's removals: its rows (in input order) ordered least similar to `centre` first, each removed when
    its cosine with an earlier one is above `threshold`."""
    order = np.lexsort((np.arange(len(rows)), rows @ centre))  # ascending similarity, then input order
    ranked = rows[order]
    gone = np.zeros(len(rows), bool)
    for start in range(1, len(ranked), BLOCK):
        end = min(start + BLOCK, len(ranked))
        sims = ranked[:end] @ ranked[start:end].T  # (earlier rows, this block's columns)
        earlier = np.arange(end)[:, None] < np.arange(start, end)[None, :]
        gone[order[start:end]] = np.any((sims > threshold) & earlier, axis=0)
    return gone


def pool_embeddings(sidecar_rows, pool: np.ndarray) -> np.ndarray:
    """The float32 image embeddings of the pool's samples (`pool`, a mask over every sample in input order), from
    `sidecar_rows`: (sidecar, its row of each of the shard's samples, -1 for none) per shard, a sidecar read at a
    time."""
    from disco_clip_ds.data.embeddings import read_sidecar

    parts, start = [], 0
    for sidecar, rows in sidecar_rows:
        chosen = rows[pool[start : start + len(rows)]]
        start += len(rows)
        if len(chosen):
            parts.append(read_sidecar(sidecar)[1].numpy()[chosen])
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros((0, 1), np.float32)


def semdedup_drops(embeddings: np.ndarray, eps: float, clusters: int, kmeans_sample: int, seed: int) -> np.ndarray:
    """The mask of the rows of `embeddings` (the pool's image embeddings, in input order) SemDeDup removes: k-means
    with `clusters` centres trained on a seeded sample of at most `kmeans_sample` rows, then `removed`."""
    from disco_clip_ds.data.curate import clusters as cl

    if not len(embeddings):  # every sample dropped before: nothing to compare
        return np.zeros(0, bool)
    if len(embeddings) < clusters:
        raise UsageError(
            f"--semdedup_clusters {clusters}: only {len(embeddings)} samples reach SemDeDup; give fewer clusters"
        )
    sample = embeddings[cl.sample_rows(len(embeddings), kmeans_sample, seed)]
    centres = cl.train_centres(np.ascontiguousarray(sample, np.float32), clusters, seed)
    assigned = cl.nearest_centre(centres, np.ascontiguousarray(embeddings, np.float32))
    return removed(embeddings, assigned, centres, eps)
