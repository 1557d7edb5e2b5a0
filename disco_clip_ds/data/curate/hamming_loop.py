"""The compiled loop of the multi-index search (data/curate/index.py), by numba: each distinct query piece probed at
each flip mask, each base code of the bucket found there compared with each query of that piece. A candidate is a
word-wise XOR and bit count, a few nanoseconds compiled where numpy's broadcast expressions over blocks of candidates
cost tens. Compiled at the first search of a process, and cached beside this file (numba's cache) for the next."""

from __future__ import annotations

import numba
from numba import types
from numba.extending import intrinsic

BLOCK = 4096  # query pieces probed together, flip by flip


@intrinsic
def popcount(typingctx, word):
    """The bits set in a uint64 (LLVM's ctpop: one instruction where the CPU has it)."""

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.int64(types.uint64), codegen  # LLVM's integers have no sign


@numba.njit(cache=True, nogil=True)
def probe(keys, qfirst, qcount, flips, starts, qsorted, bsorted, radius, qpos, bpos, found, resume):
    """Write the (query, base) positions within `radius` into `qpos`/`bpos` from `found` on; return (the count
    written, where to resume): (len(keys), 0, 0) when done, else the (block, flip, piece) whose pairs might not fit.

    keys, qfirst, qcount: the distinct query pieces, sorted, and the first position and count of their queries in
    `qsorted`; flips: the masks; starts: each bucket's first position in `bsorted` (2**width + 1 of them);
    qsorted, bsorted: the codes as (n, words) uint64, in piece order. Blocks of sorted pieces are probed flip by
    flip: a block's pieces are near each other, and so are their buckets at one flip (cached reads)."""
    words, (first_block, first_flip, first_key) = qsorted.shape[1], resume
    for block in range(first_block, len(keys), BLOCK):
        for f in range(first_flip if block == first_block else 0, len(flips)):
            resumed = block == first_block and f == first_flip
            for k in range(first_key if resumed else block, min(block + BLOCK, len(keys))):
                bucket = keys[k] ^ flips[f]
                if found + qcount[k] * (starts[bucket + 1] - starts[bucket]) > len(qpos):
                    return found, (block, f, k)
                for b in range(starts[bucket], starts[bucket + 1]):
                    for q in range(qfirst[k], qfirst[k] + qcount[k]):
                        distance = 0
                        for w in range(words):
                            distance += popcount(qsorted[q, w] ^ bsorted[b, w])
                        if distance <= radius:
                            qpos[found], bpos[found] = q, b
                            found += 1
    return found, (len(keys), 0, 0)
