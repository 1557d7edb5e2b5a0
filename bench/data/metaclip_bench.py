"""MetaCLIP's balancing (`data filter --metadata --balance_t`, disco_clip_ds/data/curate/balance.py) on a synthetic
pool: the matching's throughput with a large metadata list, and the balanced distribution against the raw one.

The metadata list: --entries distinct entries (default 500,000, MetaCLIP's list has 500k), pseudo-words of 2 to 4
syllables, one in 5 a two-word entry, so that the automaton holds a list of MetaCLIP's size. The pool: --captions
captions of 8 to 16 words (LAION's alt-texts run about 10 words), each naming 1, 2 or 3 entries (in 60, 30, 10 %
of the captions) drawn from a Zipf law over the entries (P(rank r) proportional to 1 / r^--zipf: a long tail, as
the paper's Figure 2 shows for CommonCrawl), among filler words that are no entry, with MetaCLIP's punctuation
(commas, full stops) after some.

Measured, --rounds rounds: `Matcher.match` over every caption of the pool, in this process, one thread: captions per
second of wall time and of this process's CPU time (the machine is shared: the CPU rate is what a process with a
core of its own reaches); the automaton's build once a round. Computed (seeded, exact): the entry counts of the pool
and of the balanced pool (the draw at --t, the pool cut in shards of 10,000 as a filter's shards) for
`results/metaclip_balance.csv` (the counts of the entries at 200 log-spaced ranks) and the plot
`results/metaclip_balance.png`, per entry: the pool's count; the samples the entry's own draw keeps (min(count, t) in
expectation: the head flattened to t, the tail kept whole); and the kept samples that match the entry, which a
head entry gains from the samples another of their entries keeps (a caption naming a tail entry is always kept).

With --scan_captions N, instead: the first N captions of the pool written as webdataset shards of 10,000 (each
sample a 1-byte .jpg and its .txt), and `balance.shard_matches` timed over them, --rounds rounds: what a filter's
scan adds per sample with --metadata (each caption found among the members the scan located for the write, read,
decoded and matched; the header walk itself is the scan's own cost, not timed), in `results/metaclip_scan.csv`.

    python bench/data/metaclip_bench.py --rounds 3
    python bench/data/metaclip_bench.py --rounds 3 --scan_captions 50000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from disco_clip_ds.testing.bench_record import bench_row, write_rows  # first: the commit is read when the bench starts

RESULTS = Path(__file__).resolve().parent / "results"
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["qua", "thi", "sho", "cre", "pla"]
SHARD = 10_000
NAMED = [0.6, 0.3, 0.1]  # how often a caption names 1, 2 or 3 entries


def entries(n: int, rng: np.random.Generator) -> list[str]:
    """`n` distinct pseudo-words (2 to 4 syllables), one in 5 of two words."""
    made: dict[str, None] = {}
    while len(made) < n:
        word = "".join(rng.choice(SYLLABLES, rng.integers(2, 5)))
        if rng.random() < 0.2:
            word += " " + "".join(rng.choice(SYLLABLES, rng.integers(2, 4)))
        made[word] = None
    return list(made)


def captions(listed: list[str], n: int, zipf: float, rng: np.random.Generator) -> list[str]:
    """`n` captions of 8 to 16 words naming 1 to 3 (NAMED) Zipf-drawn entries among filler words (no entry)."""
    ranks = np.arange(1, len(listed) + 1, dtype=np.float64)
    weights = ranks**-zipf
    named = rng.choice(len(listed), size=(n, 3), p=weights / weights.sum())
    fillers = [f"x{s}" for s in SYLLABLES]
    out = []
    for i in range(n):
        words = list(rng.choice(fillers, rng.integers(6, 13)))
        for e in named[i, : rng.choice([1, 2, 3], p=NAMED)]:
            words.insert(int(rng.integers(0, len(words) + 1)), listed[e] + rng.choice(["", "", ",", "."]))
        out.append(" ".join(words))
    return out


def matched(matcher, pool: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids, starts = [], [0]
    for caption in pool:
        ids += matcher.match(caption)
        starts.append(len(ids))
    return np.array(ids, np.int32), np.array(starts, np.int64)


def balanced_counts(ids, starts, size: int, t: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per entry: the pool's count, the samples its own draw keeps (balance.py's `entry_hits`: about min(count, t)),
    and the kept samples that match it (kept by it or by another of their entries: balance.py's `draw_shard`)."""
    from disco_clip_ds.data.curate.balance import draw_shard, entry_hits, keep_probability

    raw = np.bincount(ids, minlength=size)
    probability = keep_probability(raw, t)
    drawn, kept_counts = np.zeros(size, np.int64), np.zeros(size, np.int64)
    for shard, start in enumerate(range(0, len(starts) - 1, SHARD)):
        end = min(start + SHARD, len(starts) - 1)
        piece = starts[start : end + 1]
        local_ids = ids[piece[0] : piece[-1]]
        drawn += np.bincount(local_ids[entry_hits(local_ids, probability, seed, shard)], minlength=size)
        kept = draw_shard(local_ids, piece - piece[0], probability, seed, shard)
        kept_counts += np.bincount(local_ids[np.repeat(kept, np.diff(piece))], minlength=size)
    return raw, drawn, kept_counts


def plot(raw: np.ndarray, drawn: np.ndarray, kept: np.ndarray, t: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = np.argsort(-raw, kind="stable")
    order = order[raw[order] > 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    rank = np.arange(1, len(order) + 1)
    ax.loglog(rank, raw[order], label="pool (before balancing)", lw=1.5)
    ax.loglog(rank, np.maximum(drawn[order], 0.8), label=f"drawn by the entry itself, t = {t:g}", lw=1.0, alpha=0.8)
    ax.loglog(rank, np.maximum(kept[order], 0.8), label="kept samples matching the entry", lw=1.0, alpha=0.8)
    ax.axhline(t, color="grey", ls="--", lw=0.8, label="t")
    ax.set_xlabel("entry, by its count in the pool (rank)")
    ax.set_ylabel("samples matching the entry")
    ax.set_title("MetaCLIP balancing of a Zipf pool (bench/data/metaclip_bench.py)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def scan_bench(matcher, pool: list[str], args) -> None:
    """Time `balance.shard_matches` over `pool` written as shards (see the module docstring)."""
    import tempfile

    from disco_clip_ds.data.curate.balance import shard_matches
    from disco_clip_ds.data.tarcopy import sample_members
    from disco_clip_ds.testing.images import write_samples

    with tempfile.TemporaryDirectory() as folder:
        write_samples(Path(folder), [{"jpg": b"x", "txt": c} for c in pool], SHARD)
        urls = sorted(Path(folder).glob("*.tar"))
        located = [sample_members(str(url)) for url in urls]  # the scan locates the members anyway, for the write
        samples = {"scan_captions_per_s_wall": [], "scan_captions_per_s_cpu": []}
        for _ in range(args.rounds):
            wall, cpu = time.perf_counter(), time.process_time()
            for shard, url in enumerate(urls):
                count = min(SHARD, len(pool) - shard * SHARD)
                keys = [f"s{i:05d}" for i in range(shard * SHARD, shard * SHARD + count)]
                shard_matches(str(url), located[shard], keys, np.zeros(count, np.int64), matcher)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            samples["scan_captions_per_s_wall"].append(len(pool) / wall)
            samples["scan_captions_per_s_cpu"].append(len(pool) / cpu)
    settings = {"entries": args.entries, "captions": len(pool), "shards": len(urls), "zipf": args.zipf}
    write_rows(RESULTS / "metaclip_scan.csv", [bench_row(settings, samples)])
    print(settings, {k: np.median(v) for k, v in samples.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=500_000)
    p.add_argument("--captions", type=int, default=200_000)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--t", type=float, default=200.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan_captions", type=int, help="time the scan's caption path over this many captions instead")
    args = p.parse_args()
    from disco_clip_ds.data.curate.balance import Matcher

    rng = np.random.default_rng(args.seed)
    listed = entries(args.entries, rng)
    pool = captions(listed, args.captions, args.zipf, rng)
    if args.scan_captions:
        scan_bench(Matcher(listed), pool[: args.scan_captions], args)
        return
    samples = {"build_s_wall": [], "build_s_cpu": [], "captions_per_s_wall": [], "captions_per_s_cpu": []}
    result = None
    for _ in range(args.rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        matcher = Matcher(listed)
        samples["build_s_wall"].append(time.perf_counter() - wall)
        samples["build_s_cpu"].append(time.process_time() - cpu)
        wall, cpu = time.perf_counter(), time.process_time()
        found = matched(matcher, pool)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        samples["captions_per_s_wall"].append(len(pool) / wall)
        samples["captions_per_s_cpu"].append(len(pool) / cpu)
        assert result is None or all(np.array_equal(a, b) for a, b in zip(found, result))
        result = found
    ids, starts = result
    raw, drawn, kept = balanced_counts(ids, starts, args.entries, args.t, args.seed)
    head, tail = raw > args.t, (raw > 0) & (raw <= args.t)
    settings = {
        "entries": args.entries,
        "captions": args.captions,
        "zipf": args.zipf,
        "t": args.t,
        "mean_caption_chars": round(float(np.mean([len(c) for c in pool])), 1),
        "matches_per_caption": round(len(ids) / args.captions, 3),
        "unmatched_captions": int(np.count_nonzero(np.diff(starts) == 0)),
        "head_entries": int(head.sum()),
        "head_max_raw": int(raw.max()),
        "head_drawn_min": int(drawn[head].min()),
        "head_drawn_max": int(drawn[head].max()),
        "head_max_kept": int(kept[head].max()),
        "head_median_kept_over_t": round(float(np.median(kept[head] / args.t)), 3),
        "tail_entries": int(tail.sum()),
        "tail_kept_whole": int(np.count_nonzero(kept[tail] == raw[tail])),
        "pool_matches": int(raw.sum()),
        "kept_matches": int(kept.sum()),
    }
    write_rows(RESULTS / "metaclip_throughput.csv", [bench_row(settings, samples)])
    order = np.argsort(-raw, kind="stable")
    order = order[raw[order] > 0]
    ranks = np.unique(np.geomspace(1, len(order), 200).astype(int)) - 1  # log-spaced ranks, as the plot shows them
    rows = [
        {"rank": int(r) + 1, "raw": int(raw[order[r]]), "drawn": int(drawn[order[r]]), "kept": int(kept[order[r]])}
        for r in ranks
    ]
    write_rows(RESULTS / "metaclip_balance.csv", rows, rounds=1)
    plot(raw, drawn, kept, args.t, RESULTS / "metaclip_balance.png")
    print(settings, {k: np.median(v) for k, v in samples.items()})


if __name__ == "__main__":
    main()
