"""The nearest-neighbour searches of the filter: k-means centres and nearest centres of float embeddings (the
image-based rule, clusters.py), over faiss-cpu; the pairs of binary hashes within a Hamming distance (copy
detection, copies.py), by multi-index hashing in numpy or faiss's exhaustive search. faiss is imported in this
module alone, so its version questions and its thread settings live here."""

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
_STEP = 1 << 22  # probes, then candidates, handled per numpy step: bounds the memory of a search


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
    the flip masks of each other. Base codes are bucketed by piece (a counting sort: a table of 2**width counts);
    queries are grouped by piece, so each distinct piece is probed once, in sorted order (near-sequential reads)."""
    bkeys = _piece(bwords, start, width)
    border = np.argsort(bkeys, kind="stable")
    counts = np.bincount(bkeys, minlength=1 << width)
    firsts = np.cumsum(counts) - counts
    qkeys = _piece(qwords, start, width)
    qorder = np.argsort(qkeys, kind="stable")
    keys, qfirst, qcount = np.unique(qkeys[qorder], return_index=True, return_counts=True)
    qsorted, bsorted = _codes(qwords[qorder]), _codes(bwords[border])
    filled, keys, flips = counts > 0, keys.astype(np.int32), flips.astype(np.int32)  # small tables: cached reads
    found, step = [], max(1, _STEP // len(flips))
    for a in range(0, len(keys), step):
        probes = (keys[a : a + step, None] ^ flips[None, :]).ravel()
        hit = np.flatnonzero(filled[probes])
        key, probes = hit // len(flips) + a, probes[hit]  # a bucket pair: a query piece and a base piece near it
        blocks = qfirst[key], qcount[key], firsts[probes], counts[probes]
        for part in _parts(blocks[1] * blocks[3]):  # runs of about _STEP candidates
            qpos, bpos = _verified(qsorted, bsorted, *(b[part] for b in blocks), radius)
            found.append(qorder[qpos] * len(bwords) + border[bpos])
    return found


def _codes(words: np.ndarray) -> np.ndarray:
    return words[:, 0] if words.shape[1] == 1 else words  # one word: a flat array, no sum over words


def _verified(qsorted, bsorted, qfirst, qcount, bfirst, bcount, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """The (query, base) positions within `radius` among the blocks [qfirst, + qcount) x [bfirst, + bcount) of the
    sorted codes: the blocks of one shape are compared by one broadcast numpy expression, candidate by candidate."""
    shape = qcount * (int(bcount.max()) + 1) + bcount
    # numpy's stable sort of 16-bit integers is a radix sort, two passes; shapes past that are rare (skewed codes)
    order = np.argsort(shape.astype(np.uint16) if shape.max() < 1 << 16 else shape, kind="stable")
    sizes = np.bincount(shape)
    shapes = np.flatnonzero(sizes)
    ends = np.cumsum(sizes[shapes])
    qpos, bpos = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for s, lo, hi in zip(shapes.tolist(), (ends - sizes[shapes]).tolist(), ends.tolist()):
        rows, columns = divmod(s, int(bcount.max()) + 1)
        block = order[lo:hi]
        q = qfirst[block, None] + np.arange(rows)
        b = bfirst[block, None] + np.arange(columns)
        distance = np.bitwise_count(qsorted[q][:, :, None] ^ bsorted[b][:, None])
        if distance.ndim == 4:
            distance = distance.sum(axis=3)
        n, i, j = np.nonzero(distance <= radius)
        qpos.append(q[n, i])
        bpos.append(b[n, j])
    return np.concatenate(qpos), np.concatenate(bpos)


def _parts(candidates: np.ndarray) -> list[slice]:
    """Consecutive slices of `candidates` (counts per bucket pair) each summing to about _STEP."""
    ends = np.searchsorted(np.cumsum(candidates), np.arange(_STEP, int(candidates.sum()) + _STEP, _STEP), "left")
    bounds = np.unique(np.concatenate([[0], np.minimum(ends + 1, len(candidates)), [len(candidates)]]))
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


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
