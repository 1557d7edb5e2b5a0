"""Weighted mixtures of training sources (`--train_shards 'a::b::c' --train_data_weights 0.6 0.3 0.1`), as
open_clip's `--train-data-upsampling-factors`, big_vision's data mixtures and MobileCLIP 2's caption ratios mix data.

Each source is read as its own stream (a `ShardStream` over that source's shards, with its own shuffle and its own
position), and each sample of a reader's output draws the source it comes from: sample `index` of reader `reader`
comes from source `draw_source(seed, reader, index)`, a function of those three numbers only. A reader is the run's
data reader (rank x DataLoader worker of the run that started it), which a resume on another world size keeps
(streams/base.py's split readers), so the draws survive gradient accumulation, a resume and a change of GPU count:
the same samples in the same order. The position of a mixture's reader is its count (the draws made: each draw
yields one sample) and, per source, the samples it drew from that source and that source's own position.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

from disco_clip_ds.data.streams.base import ReaderStream
from disco_clip_ds.data.streams.shards import ShardStream

SOURCE_FIELDS = ("seen", "epoch", "shard", "member", "offset")  # per source: samples drawn, then its ShardStream place


@dataclass(frozen=True)
class Mixture:
    """The sources of a weighted mixture: each one's shards, its public description (data/redact.py), and its
    weight (normalised to sum 1)."""

    sources: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "weights", normalised(self.weights))


def normalised(weights) -> tuple[float, ...]:
    """`weights` scaled to sum 1; ValueError unless each is a positive finite number and each share stays positive
    and finite once normalised. Scaled by the largest first, so that huge weights (1e308 1e308) do not overflow
    their sum; a weight so small beside another that its share underflows to 0 is refused (that source would never
    be drawn) rather than left out in silence."""
    weights = tuple(map(_number, weights))
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        given = " ".join(f"{w:g}" for w in weights)
        raise ValueError(f"data weights {given}: each must be a positive finite number")
    top = max(weights)
    scaled = [w / top for w in weights]  # each in (0, 1]: their sum is at most len(weights)
    total = math.fsum(scaled)
    shares = tuple(w / total for w in scaled)
    if not all(math.isfinite(w) and w > 0 for w in shares):
        small = min(range(len(weights)), key=lambda i: shares[i])
        raise ValueError(
            f"data weights {' '.join(f'{w:g}' for w in weights)}: source {small}'s share underflows to 0 beside the "
            "largest; give weights within a range a float can divide"
        )
    return shares


def _number(weight) -> float:
    """A weight as a float; nan (refused) for what is none, or an integer beyond a float's range."""
    try:
        return float(weight)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def upsampling_weights(factors: list[float], num_shards: list[int]) -> tuple[float, ...]:
    """open_clip's `--train-data-upsampling-factors` as source weights: open_clip gives each shard its source's
    factor and draws shards with probability proportional to it, so a source's share of the samples is
    factor x its shards (shards of equal size), normalised. The factors are normalised first, so that a huge
    factor times a shard count does not overflow (1e308 x 2 shards is inf); ValueError as `normalised`."""
    return normalised([f * n for f, n in zip(normalised(factors), num_shards)])


def draw_source(seed: int, reader: int, index: int, cumulative: list[float]) -> int:
    """The source of sample `index` (0-based) of `reader`'s output: a uniform number seeded by (seed, reader, index)
    alone, placed among the `cumulative` weights (ending at 1)."""
    u = random.Random(f"{seed}/mix/{reader}/{index}").random()
    return min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)


def cumulative_weights(weights: tuple[float, ...]) -> list[float]:
    return list(itertools.accumulate(weights))


class MixtureStream(ReaderStream):
    """Endless stream of (uint8 pixels, caption, position) drawn from several sources with the mixture's weights.

    `mixture`: the sources and weights; `sample_ids`, `resampled`, `reinforcement`: as ShardStream's, for every
    source; `options`: ReaderStream's. A position row is (reader, count, then per source SOURCE_FIELDS); `seen` 0
    means the source was not drawn yet (it starts afresh on resume). Skipped samples of every source count in this
    stream's `skipped`."""

    def __init__(
        self,
        mixture: Mixture,
        image_size: int,
        sample_ids: bool = False,
        resampled: bool = False,
        reinforcement=None,
        **options,
    ):
        super().__init__(image_size, **options)
        sources = {"reinforcement": reinforcement}
        self.mixture, self.resampled = mixture, resampled
        self.cumulative = cumulative_weights(mixture.weights)
        self.sources = [
            ShardStream(list(urls), image_size, sample_ids=sample_ids, resampled=resampled, **sources, **options)
            for urls in mixture.sources
        ]
        for source in self.sources:  # one skip counter for the mixture, shared with the DataLoader's workers
            source.skipped, source.reader_skips = self.skipped, self.reader_skips
        self.position_fields = ("reader", "count", "skipped") + tuple(
            f"source{s}_{name}" for s in range(len(self.sources)) for name in SOURCE_FIELDS
        )

    def state_facts(self) -> dict:
        """A position means nothing under other readers, seed, block size, sources or weights: a resume with others
        is refused in one line (streams/state.py)."""
        facts = {
            "num_readers": self.num_readers,
            "seed": self.seed,
            "shuffle_buffer": self.block,
            "sources": list(self.mixture.names),
            "weights": [round(w, 12) for w in self.mixture.weights],
        }
        return {**facts, "resampled": True} if self.resampled else facts

    def restore(self, positions: dict[int, tuple[int, ...]], consumed_batches: int) -> None:
        super().restore(positions, consumed_batches)
        for source in self.sources:  # their error messages name the reader as this stream does
            source.worker_shift = consumed_batches

    def seen_per_source(self, rows: dict[int, list[int]]) -> list[int]:
        """Samples drawn from each source over the readers' position `rows` ({reader: row}, the newest each)."""
        width = len(SOURCE_FIELDS)
        first = len(self.position_fields) - width * len(self.sources)
        return [sum(row[first + s * width] for row in rows.values()) for s in range(len(self.sources))]

    def _passes(self, reader: int, num_readers: int, start: list[int]):
        """(place, item) of the reader's samples, each from the source drawn for its index, from `start` (per source
        SOURCE_FIELDS, or [] for the beginning) on."""
        width = len(SOURCE_FIELDS)
        saved = [start[s * width : (s + 1) * width] if start else [0] * width for s in range(len(self.sources))]
        seen = [entry[0] for entry in saved]
        places = [list(entry[1:]) for entry in saved]
        # a source not drawn yet starts at its beginning; a drawn one right after its last sample
        streams = [
            source._checked(source._passes(reader, num_readers, place if n else []), place if n else [])
            for source, n, place in zip(self.sources, seen, places)
        ]
        for index in itertools.count(sum(seen)):
            s = draw_source(self.seed, reader, index, self.cumulative)
            place, item = next(streams[s])
            seen[s], places[s] = seen[s] + 1, list(place)
            yield [v for n, p in zip(seen, places) for v in (n, *p)], item

    def _resumed_mid_pass(self, start: list[int]) -> bool:
        return False  # the sources check their own passes

    def _empty_pass(self):  # never reached: the mixture yields no pass ends of its own
        raise NotImplementedError
