"""The nearest-neighbour searches of the filter, over faiss-cpu: k-means centres and nearest centres of float
embeddings (the image-based rule, clusters.py), and nearest binary hashes in Hamming distance (copy detection,
copies.py). faiss is imported in this module alone, so its version questions and its thread settings live here."""

from __future__ import annotations

import numpy as np

ONE_THREAD_BELOW = 1 << 24  # distance computations under which a search runs on one thread (a few ms on one core)


def kmeans_centres(sample: np.ndarray, clusters: int, seed: int, niter: int) -> np.ndarray:
    """The (K, d) float32 centres of faiss k-means (`niter` iterations, `seed`) on the rows of `sample`."""
    import faiss

    sample = np.ascontiguousarray(sample, np.float32)
    kmeans = faiss.Kmeans(sample.shape[1], clusters, niter=niter, seed=seed, verbose=False)
    kmeans.train(sample)
    return np.ascontiguousarray(kmeans.centroids, np.float32)


def nearest_rows(base: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Each query's nearest row of `base` (int32), by a flat L2 index (faiss.Kmeans' own assignment)."""
    import faiss

    index = faiss.IndexFlatL2(base.shape[1])
    index.add(np.ascontiguousarray(base, np.float32))
    _, nearest = index.search(np.ascontiguousarray(queries, np.float32), 1)
    return nearest[:, 0].astype(np.int32)


class HashIndex:
    """Packed binary hashes (uint8 rows of `width` bytes) searched by Hamming distance (faiss IndexBinaryFlat)."""

    def __init__(self, width: int):
        import faiss

        self.index = faiss.IndexBinaryFlat(width * 8)

    @property
    def size(self) -> int:
        return self.index.ntotal

    def add(self, hashes: np.ndarray) -> None:
        if len(hashes):
            self.index.add(np.ascontiguousarray(hashes, np.uint8))

    def nearest_distance(self, queries: np.ndarray) -> np.ndarray:
        """The Hamming distance from each of `queries` to its nearest hash in the index. A small search runs on one
        thread: OpenMP's start costs more than such a search (far more on a busy machine)."""
        import faiss

        threads = faiss.omp_get_max_threads()
        if len(queries) * self.size < ONE_THREAD_BELOW:
            faiss.omp_set_num_threads(1)
        try:
            return self.index.search(np.ascontiguousarray(queries, np.uint8), 1)[0][:, 0]
        finally:
            faiss.omp_set_num_threads(threads)
