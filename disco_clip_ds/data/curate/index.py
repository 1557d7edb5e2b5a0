"""The nearest-neighbour searches of the filter: k-means centres and nearest centres of float embeddings (the
image-based rule, clusters.py), over faiss-cpu; the pairs of binary hashes within a Hamming distance (copy
detection, copies.py), by multi-index hashing (its loop compiled by numba) or faiss's exhaustive search. faiss is
imported in this module alone, so its version questions and its thread settings live here."""

from __future__ import annotations

import itertools
import math

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


# Hamming-radius search ---------------------------------------------------------------------------------------------
MAX_PIECE_BITS = 24  # a piece's bucket table holds 2**bits counts and starts (int64): 256 MiB at 24 bits
MAX_FLIPS = 4096  # flip masks a piece is probed with, at most (all masks of up to `radius // pieces` bits)
FLAT_COST = 0.1  # one comparison of the exhaustive search, in units of one multi-index probe or candidate
TABLE_BITS = 5  # a piece's table has at most 2**TABLE_BITS buckets per base code


def hamming_pairs(queries: np.ndarray, base: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (query row, base row) pair of packed binary codes (uint8 rows of one width) whose Hamming distance is
    at most `radius`, as two int64 arrays sorted by query then base row. Exact: multi-index hashing (Norouzi et al.)
    when its estimated cost is lower, else the exhaustive faiss search. Multi-index hashing cuts the code into m
    disjoint pieces and probes, for each piece, every code within radius // m bits of the query's piece: a pair
    within `radius` has at least one piece that close (m * (radius // m + 1) > radius), so every such pair is a
    candidate, and each candidate is kept by its full distance alone."""
    queries, base = _packed(queries), _packed(base)
    if queries.shape[1] != base.shape[1]:
        raise ValueError(f"codes of {queries.shape[1]} bytes against codes of {base.shape[1]} bytes")
    if not len(queries) or not len(base):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    plan = _plan(queries.shape[1] * 8, radius, len(queries), len(base))
    if plan is None:
        return _flat_pairs(queries, base, radius)
    pieces, flips, width = plan
    qwords, bwords = _words(queries), _words(base)
    stride = queries.shape[1] * 8 // pieces
    found = [np.zeros(0, np.int64)]
    for k in range(pieces):
        found += _piece_pairs(qwords, bwords, k * stride, width, flips, radius)
    found = np.unique(np.concatenate(found))  # a pair close on several pieces is found by each
    return found // len(base), found % len(base)


def _packed(codes) -> np.ndarray:
    codes = np.ascontiguousarray(codes, np.uint8)
    if codes.ndim != 2:
        raise ValueError(f"expected packed codes (n, bytes), got shape {codes.shape}")
    return codes


def _plan(bits: int, radius: int, nq: int, nb: int):
    """(pieces, flip masks, piece width) of the cheapest multi-index search, or None when the exhaustive search's
    estimate (FLAT_COST per comparison) is lower. Each distinct query piece is probed once per mask; a probe's
    bucket holds nb / 2**width base codes on average, each a candidate of each query with that piece. A table has
    at most 32 buckets per base code (TABLE_BITS): few codes take small tables, quick to build."""
    best, plan = FLAT_COST * nq * nb, None
    for pieces in range(1, min(radius + 1, bits) + 1):
        width = min(bits // pieces, MAX_PIECE_BITS, nb.bit_length() + TABLE_BITS)
        probes = _volume(width, radius // pieces)
        if probes > MAX_FLIPS:
            continue
        cost = pieces * probes * (min(nq, 2**width) + nq * nb / 2**width)
        if cost < best:
            best, plan = cost, (pieces, radius // pieces, width)
    if plan is None:
        return None
    pieces, flip_bits, width = plan
    return pieces, _flips(width, flip_bits), width


def _volume(width: int, radius: int) -> int:
    return sum(math.comb(width, k) for k in range(min(radius, width) + 1))


def _flips(width: int, radius: int) -> np.ndarray:
    """Every mask of `width` bits with at most `radius` bits set (int64)."""
    masks = [sum(1 << b for b in bits) for k in range(radius + 1) for bits in itertools.combinations(range(width), k)]
    return np.array(masks, np.int64)


def _words(codes: np.ndarray) -> np.ndarray:
    """(n, W) uint64 little-endian words of packed codes, zero-padded to whole words (padding adds no distance)."""
    pad = -codes.shape[1] % 8
    if pad:
        codes = np.concatenate([codes, np.zeros((len(codes), pad), np.uint8)], axis=1)
    return np.ascontiguousarray(codes).view("<u8")


def _piece(words: np.ndarray, start: int, width: int) -> np.ndarray:
    """Bits [start, start + width) of each code, as int64 keys."""
    word, shift = divmod(start, 64)
    key = words[:, word] >> np.uint64(shift)
    if shift + width > 64:
        key = key | (words[:, word + 1] << np.uint64(64 - shift))
    return (key & np.uint64((1 << width) - 1)).astype(np.int64)


def _piece_pairs(qwords, bwords, start: int, width: int, flips: np.ndarray, radius: int) -> list[np.ndarray]:
    """The pairs within `radius` (query row * len(base) + base row) among those whose piece at `start` is within
    the flip masks of each other. Base codes are bucketed by piece (a counting sort: a table of 2**width + 1 bucket
    starts); queries are grouped by piece, so each distinct piece is probed once, in sorted order."""
    bkeys = _piece(bwords, start, width)
    border = np.argsort(bkeys, kind="stable")
    counts = np.bincount(bkeys, minlength=1 << width)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32 if len(bwords) < 2**31 else np.int64)
    qkeys = _piece(qwords, start, width)
    qorder = np.argsort(qkeys, kind="stable")
    keys, qfirst, qcount = np.unique(qkeys[qorder], return_index=True, return_counts=True)
    qpos, bpos = _probed_pairs(keys, qfirst, qcount, flips, starts, qwords[qorder], bwords[border], radius)
    return [qorder[qpos] * len(bwords) + border[bpos]]


def _probed_pairs(keys, qfirst, qcount, flips, starts, qsorted, bsorted, radius):
    """(query, base) positions in the sorted codes within `radius`, among the blocks of queries of each piece `keys`
    and the buckets of base codes at each flip of it. The kernel writes into the arrays it is given and returns where
    it stopped when they could overflow: they double, and it goes on from there."""
    from disco_clip_ds.data.curate.hamming_loop import probe  # numba: imported by the searches that compile

    qpos, bpos = np.empty(max(1024, 2 * len(qsorted)), np.int64), np.empty(max(1024, 2 * len(qsorted)), np.int64)
    found, resume = 0, (0, 0, 0)
    while True:
        found, resume = probe(keys, qfirst, qcount, flips, starts, qsorted, bsorted, radius, qpos, bpos, found, resume)
        if resume[0] == len(keys):
            return qpos[:found], bpos[:found]
        qpos, bpos = (np.concatenate([a, np.empty_like(a)]) for a in (qpos, bpos))


def _flat_pairs(queries: np.ndarray, base: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """The exhaustive search: faiss's IndexBinaryFlat, every query against every base code (range_search keeps
    distances below its radius, hence radius + 1)."""
    import faiss

    index = faiss.IndexBinaryFlat(queries.shape[1] * 8)
    index.add(base)
    threads = faiss.omp_get_max_threads()
    if len(queries) * len(base) < ONE_THREAD_BELOW:
        faiss.omp_set_num_threads(1)
    try:
        lims, _, labels = index.range_search(queries, radius + 1)
    finally:
        faiss.omp_set_num_threads(threads)
    rows = np.repeat(np.arange(len(queries), dtype=np.int64), np.diff(lims.astype(np.int64)))
    order = np.lexsort((labels, rows))
    return rows[order], labels.astype(np.int64)[order]
