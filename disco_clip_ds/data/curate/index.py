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
MAX_PIECE_BITS = 24  # a piece's two tables of bucket starts (int64, base codes' and queries'): 128 MiB each at 24
MAX_FLIPS = 4096  # flip masks a piece is probed with, at most (all masks of up to `radius // pieces` bits)
# What the searches cost, in probes of the multi-index search (a probe comparing one code of its bucket); the plan
# compares them. bench/data/dedup_plans.py times plans against these estimates (its README: a probe's nanoseconds).
FLAT_COST = 0.1  # one comparison of the exhaustive faiss search
SLOT_COST = 0.3  # a second code compared by each probe (hamming_loop.py's slots)
LOOP_COST = 6.0  # a probe whose bucket holds more codes than its slots: the loop over them (a mispredicted branch)
CANDIDATE_COST = 0.2  # a code compared in that loop
BUCKET_COST = 6.0  # a bucket of a piece's tables, one for the base codes and one for the queries (counting sorts)


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
    pieces, flip_bits = plan
    qwords, bwords = _words(queries), _words(base)
    found = [np.zeros(0, np.int64)]
    for start, width in pieces:
        found += _piece_pairs(qwords, bwords, start, width, _flips(width, flip_bits), radius)
    found = np.unique(np.concatenate(found))  # a pair close on several pieces is found by each
    return found // len(base), found % len(base)


def _packed(codes) -> np.ndarray:
    codes = np.ascontiguousarray(codes, np.uint8)
    if codes.ndim != 2:
        raise ValueError(f"expected packed codes (n, bytes), got shape {codes.shape}")
    return codes


def _plan(bits: int, radius: int, nq: int, nb: int):
    """(pieces as (first bit, width) pairs, flip bits) of the cheapest multi-index search, or None when the
    exhaustive search's estimate is lower. With m pieces each query's piece is probed at every flip mask of up to
    radius // m bits; the width sets how full the buckets are (nb / 2**width codes) against the tables' size."""
    best, plan = FLAT_COST * nq * nb, None
    for count in range(1, min(radius + 1, bits) + 1):
        flip_bits = radius // count
        for width in range(1, min(bits // count, MAX_PIECE_BITS) + 1):
            pieces = _pieces(bits, count, width)
            if max(_volume(w, flip_bits) for _, w in pieces) > MAX_FLIPS:
                break  # wider pieces have more masks still
            cost = sum(_piece_cost(w, flip_bits, nq, nb) for _, w in pieces)
            if cost < best:
                best, plan = cost, (pieces, flip_bits)
    return plan


def _piece_cost(width: int, flip_bits: int, nq: int, nb: int) -> float:
    """A piece's search in probes (the costs above): its probes, the loops over buckets fuller than the probe's slots
    and the codes compared there, and its tables."""
    fill = nb / 2**width
    slots = _slots(fill)
    probe = 1 + (slots - 1) * SLOT_COST + _more_than(slots, fill) * LOOP_COST + fill * CANDIDATE_COST
    return nq * _volume(width, flip_bits) * probe + 2**width * BUCKET_COST


def _pieces(bits: int, count: int, width: int) -> list[tuple[int, int]]:
    """`count` disjoint pieces of `width` bits, spread over the code; where they would fill it but for a remainder
    (64 bits in 3 pieces of 21), the last pieces take a bit more each (21, 21, 22): a wider table holds fewer
    candidates per probe."""
    stride = bits // count
    if width < stride:
        return [(k * stride, width) for k in range(count)]
    widths = [width + (k >= count - bits % count and width < MAX_PIECE_BITS) for k in range(count)]
    return [(sum(widths[:k]), widths[k]) for k in range(count)]


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
    the flip masks of each other. Base codes are bucketed by piece and queries sorted by it (counting sorts), so
    that a block of queries probes nearby buckets."""
    from disco_clip_ds.data.curate.hamming_loop import bucket_order  # numba: imported by the searches that compile

    border, starts = bucket_order(_piece(bwords, start, width), width)
    qkeys = _piece(qwords, start, width)
    qorder = bucket_order(qkeys, width)[0]
    slots = _slots(len(bwords) / 2**width)
    qpos, bpos = _probed_pairs(qkeys[qorder], flips, starts, qwords[qorder], bwords[border], radius, slots)
    return [qorder[qpos] * len(bwords) + border[bpos]]


def _slots(fill: float) -> int:
    """The codes of its bucket a probe compares before any branch on the bucket's size (1 or 2, hamming_loop.py),
    from the mean codes per bucket: a second slot costs each probe SLOT_COST and saves the loop over the buckets of
    exactly 2 codes."""
    return 1 if SLOT_COST + _more_than(2, fill) * LOOP_COST >= _more_than(1, fill) * LOOP_COST else 2


def _more_than(slots: int, fill: float) -> float:
    """The probability that a bucket holds more than `slots` codes, for buckets filled at random (Poisson)."""
    return 1 - sum(math.exp(-fill) * fill**k / math.factorial(k) for k in range(slots + 1))


def _probed_pairs(keys, flips, starts, qsorted, bsorted, radius, slots):
    """(query, base) positions in the sorted codes within `radius`, among the buckets of base codes at each flip of
    each query's piece `keys`. The kernel writes into the arrays it is given and returns where it stopped when they
    could overflow: they double, and it goes on from there."""
    from disco_clip_ds.data.curate.hamming_loop import probe_loop

    bsorted = np.concatenate([bsorted, np.zeros((slots, bsorted.shape[1]), np.uint64)])  # the slots' padding
    qpos, bpos = np.empty(max(1024, 2 * len(qsorted)), np.int64), np.empty(max(1024, 2 * len(qsorted)), np.int64)
    found, resume, probe = 0, (0, 0, 0), probe_loop(qsorted.shape[1], slots)
    while True:
        found, resume = probe(keys, flips, starts, qsorted, bsorted, radius, qpos, bpos, found, resume)
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
