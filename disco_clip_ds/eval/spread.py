"""The evaluation's work split across ranks: each rank encodes every N-th batch of a set, and every rank gets all
the outputs back in the set's order. In one process (no process group, or a group of one) everything runs here.

The batches are the set's own, cut over its global order at fixed `batch_size` boundaries whatever the number of
ranks: a batch is encoded with the same samples in the same shape on whichever rank owns it, so the features, and
every metric computed from them, are the same bits on N ranks as on one (at the same torch threads per rank).

Under ZeRO-3 a forward is a collective that every rank must join, so the work runs in rounds of N batches, one per
rank: a rank without a batch of its own in the last round encodes the round's first batch again and drops it. A
batch that fails to decode (a damaged image) does not leave the others waiting in a forward: its rank goes on
forwarding a stand-in (its last decoded batch) to the end of the set, and then every rank raises that batch's error.
There is no other collective than the forwards' until the set's end, where one all-gather brings the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from disco_clip_ds.distributed.ranks import all_gathered, rank, world_size
from disco_clip_ds.errors import DiscoClipError


def interleaved(per_rank: Sequence[Sequence], n: int) -> list:
    """Items 0..n-1 in order from `per_rank[r]`, which holds items r, r + N, r + 2N, ... (N ranks)."""
    world = len(per_rank)
    return [per_rank[i % world][i // world] for i in range(n)]


def across_ranks(work: Callable, items: Sequence, first: int = 0) -> list:
    """[work(item) for item in items], dealt out in turn from rank `first`: rank (first + j) % N computes item j. The
    results on every rank, in order. For work without collectives inside (a probe's trainings); an error is raised
    where it happened."""
    world, here = world_size(), rank()
    if world == 1:
        return [work(item) for item in items]
    owners = [(first + j) % world for j in range(len(items))]
    per_rank = all_gathered([work(item) for item, owner in zip(items, owners) if owner == here])
    taken = [iter(results) for results in per_rank]
    return [next(taken[owner]) for owner in owners]


def spread(items: Iterable, prepare: Callable, forward: Callable) -> list:
    """[forward(prepare(item)) for item in items], each rank doing every N-th item (rank r: items r, r + N, ...),
    in rounds (module docstring); the results, picklable, on every rank in the items' order.

    `items` must be the same sequence on every rank (each rank reads the set whole; reading is cheap, `prepare`,
    the decoding, is done for this rank's items only). `prepare` may raise a DiscoClipError or an OSError: it is
    raised on every rank at the end of the set (this rank's own, else the first other rank's)."""
    world, here = world_size(), rank()
    items = iter(items)
    mine, count, stand_in, error = [], 0, None, None
    while chunk := list(islice(items, world)):
        count += len(chunk)
        own = here < len(chunk)
        if error is None:
            try:
                inputs = prepare(chunk[here] if own else chunk[0])  # no item of its own: the round's first, dropped
            except (DiscoClipError, OSError) as e:
                if world == 1:
                    raise
                error, inputs = e, stand_in if stand_in is not None else _first_prepared(chunk, prepare, e)
            stand_in = inputs
        result = forward(stand_in)  # every rank forwards in every round (ZeRO-3), a failed rank on a stand-in
        if own:
            mine.append(result)
    if world == 1:
        return mine
    gathered = all_gathered((None if error else mine, error))
    _raise_any(error, [e for _, e in gathered])
    return interleaved([results for results, _ in gathered], count)


def _first_prepared(chunk: list, prepare: Callable, error: BaseException):
    """A stand-in input for a rank whose own item failed before any succeeded: the round's first item that
    prepares. Decoding is deterministic, so when none does, every rank's own item of this round failed too and
    every rank raises here, together."""
    for item in chunk:
        try:
            return prepare(item)
        except (DiscoClipError, OSError):
            continue
    raise error


def _raise_any(error: BaseException | None, errors: list) -> None:
    """Raise this rank's error, else another rank's; nothing when no rank has one."""
    first = error or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
