"""The compiled loops of the multi-index search (data/curate/index.py), by numba: the counting sort that buckets the
codes by piece, and the probe loop: each query's piece probed at each flip mask, the base codes of the bucket found
there compared with the query. Compiled at the first search of a process, and cached beside this file (numba's
cache) for the next.

Why the probe loop is shaped as it is: a bucket holds a random count of codes (Poisson, about one where the table
is full), so a loop over a bucket's codes ends at an unpredictable point, and the CPU's mispredicted branch costs
more than the compares. The first `slots` codes of a bucket are therefore compared without a branch on its size
(their pairs counted only when in the bucket), and the loop over the bucket runs only when one of them is close
or the bucket holds more: rarely, with `slots` chosen from the table's fill (index.py)."""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

BLOCK = 4096  # queries probed together, flip by flip


@intrinsic
def popcount(typingctx, word):
    """The bits set in a uint64 (LLVM's ctpop: one instruction where the CPU has it)."""

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.int64(types.uint64), codegen  # LLVM's integers have no sign


@numba.njit(cache=True, nogil=True, inline="always")
def distance(qcodes, q, bcodes, b, words):
    """The Hamming distance between query code `q` and base code `b` ((n, words) uint64 rows)."""
    total = 0
    for w in range(words):
        total += popcount(qcodes[q, w] ^ bcodes[b, w])
    return total


@numba.njit(cache=True, nogil=True)
def bucket_order(keys, width):
    """(order, starts): the positions of `keys` (ints below 2**width) sorted by key, stably, and each key's first
    position in that order (2**width + 1 of them). A counting sort: linear where a comparison sort is not."""
    table = np.zeros((1 << width) + 2, np.int64)
    for key in keys:  # counts two places on, so that placing each key below leaves its bucket's start one place on
        table[key + 2] += 1
    for bucket in range(2, len(table)):
        table[bucket] += table[bucket - 1]
    order = np.empty(len(keys), np.int64)
    for position, key in enumerate(keys):
        order[table[key + 1]] = position
        table[key + 1] += 1
    return order, table[:-1]


@functools.cache
def probe_loop(words: int, slots: int):
    """The probe loop for codes of `words` uint64 words, comparing `slots` (1 or 2) codes of a bucket before any
    branch on its size (module docstring): constants of the compiled function, so that its loops over them unroll;
    numba caches each (words, slots) apart."""

    @numba.njit(cache=True, nogil=True)
    def probe(keys, flips, starts, qsorted, bsorted, radius, qpos, bpos, found, resume):
        """Write the (query, base) positions within `radius` into `qpos`/`bpos` from `found` on; return (the count
        written, where to resume): (len(keys), 0, 0) when done, else the (block, flip, query) whose pairs might not
        fit.

        keys: each query's piece, in sorted order; flips: the masks; starts: each bucket's first position in
        `bsorted` (2**width + 1 of them); qsorted, bsorted: the codes as (n, words) uint64 in piece order, `bsorted`
        followed by `slots` rows of padding (read, never counted). Blocks of sorted queries are probed flip by flip:
        a block's pieces are near each other, and so are their buckets at one flip (cached reads)."""
        first_block, first_flip, first_key = resume
        for block in range(first_block, len(keys), BLOCK):
            for f in range(first_flip if block == first_block else 0, len(flips)):
                resumed = block == first_block and f == first_flip
                for q in range(first_key if resumed else block, min(block + BLOCK, len(keys))):
                    bucket = keys[q] ^ flips[f]
                    first, size = starts[bucket], starts[bucket + 1] - starts[bucket]
                    if found + size > len(qpos):
                        return found, (block, f, q)
                    near = size > slots
                    for slot in range(slots):  # unrolled: `slots` is a constant
                        near |= (distance(qsorted, q, bsorted, first + slot, words) <= radius) & (size > slot)
                    if near:
                        found = _bucket_pairs(q, first, size, qsorted, bsorted, words, radius, qpos, bpos, found)
        return found, (len(keys), 0, 0)

    return probe


@numba.njit(cache=True, nogil=True, inline="never")  # kept out of the probe loop, which it would slow
def _bucket_pairs(q, first, size, qsorted, bsorted, words, radius, qpos, bpos, found):
    """Write query `q`'s pairs among the bucket's `size` codes from `first` on; return the new count written."""
    for b in range(first, first + size):
        if distance(qsorted, q, bsorted, b, words) <= radius:
            qpos[found], bpos[found] = q, b
            found += 1
    return found
