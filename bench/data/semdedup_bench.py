"""SemDeDup (`data filter --semdedup_eps`, disco_clip_ds/data/curate/semdedup.py) on planted near-copies: the
fraction of planted copies found and of the other samples removed, at each eps.

The pool is synthetic unit embeddings (--dim, default 256): --distinct samples drawn around --topics topic
directions (each topic direction plus Gaussian noise, so that two samples of a topic sit at a cosine of about
--topic_cosine: semantic neighbours that are not copies), then planted copies of --planted of them (the first of a
seeded permutation for each kind): each original gets one copy of one kind, the copy its embedding plus Gaussian
noise scaled to a cosine with it drawn uniformly in 0.985 to 0.995 (`near`), 0.96 to 0.98 (`mid`) or 0.90 to
0.95 (`far`); and --planted groups of 4 (an original and one copy of each kind).
The pool is shuffled, then `semdedup.semdedup_drops` runs as the filter runs it (faiss k-means of --clusters
centres, seeded, then SemDeDup's rule).

Per eps, one row: `found_<kind>` the fraction of planted pairs of which one is removed (SemDeDup keeps one of a
group, the one least similar to its centre: either the original or the copy), `found_group` the fraction of the
groups' extra members removed (3 per group), `split` the planted pairs k-means put in two clusters (never
compared), and `other` the fraction of the other samples (no copy planted of them, not a copy) removed, with its
count. Computed exactly, seeded, one round; the seconds are the rule's wall and CPU time on this (shared) machine.

    python bench/data/semdedup_bench.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from disco_clip_ds.testing.bench_record import write_rows  # first: the commit is read when the bench starts

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = {"near": (0.985, 0.995), "mid": (0.96, 0.98), "far": (0.9, 0.95)}  # each copy's cosine: uniform in
EPS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15)


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def noisy(rows: np.ndarray, cosine, rng: np.random.Generator) -> np.ndarray:
    """Rows plus Gaussian noise of norm sqrt(1 / cosine^2 - 1) (per unit row): a cosine of about `cosine` (a number,
    or one per row) with each."""
    cosine = np.reshape(cosine, (-1, 1))
    scale = np.sqrt(1 / cosine**2 - 1) / np.sqrt(rows.shape[1])
    return unit(rows + scale * rng.standard_normal(rows.shape))


def planted_pool(args, rng: np.random.Generator):
    """Shuffled (embeddings, the row each copy copies (-1: none), each row's kind ("": not a copy), the groups'
    original rows)."""
    topics = unit(rng.standard_normal((args.topics, args.dim)))
    distinct = noisy(topics[rng.integers(0, args.topics, args.distinct)], np.sqrt(args.topic_cosine), rng)
    rows, original, kind = [distinct], [np.full(args.distinct, -1)], [np.full(args.distinct, "", object)]
    chosen = rng.permutation(args.distinct)
    plan = [
        (name, cosine, chosen[k * args.planted : (k + 1) * args.planted])
        for k, (name, cosine) in enumerate(KINDS.items())
    ]
    groups = chosen[len(KINDS) * args.planted : (len(KINDS) + 1) * args.planted]
    plan += [(f"group_{name}", cosine, groups) for name, cosine in KINDS.items()]
    for name, cosine, of in plan:
        rows.append(noisy(distinct[of], rng.uniform(*cosine, len(of)), rng))
        original.append(of)
        kind.append(np.full(len(of), name, object))
    embeddings, original, kind = np.concatenate(rows).astype(np.float32), np.concatenate(original), np.concatenate(kind)
    order = rng.permutation(len(embeddings))
    position = np.empty_like(order)
    position[order] = np.arange(len(order))  # where each row goes
    shuffled_original = np.where(original[order] >= 0, position[np.maximum(original[order], 0)], -1)
    return embeddings[order], shuffled_original, kind[order], position[groups]


def score(gone: np.ndarray, original: np.ndarray, kind: np.ndarray, groups: np.ndarray) -> dict:
    """One eps's row: found per kind and of the groups, the other samples removed."""
    row = {}
    for name in KINDS:
        copies = np.flatnonzero(kind == name)
        row[f"found_{name}"] = round(float((gone[copies] | gone[original[copies]]).mean()), 4)
    members = np.flatnonzero(np.array([k.startswith("group_") for k in kind]))
    row["found_group"] = round((int(gone[members].sum()) + int(gone[groups].sum())) / (3 * len(groups)), 4)
    other = (original < 0) & ~np.isin(np.arange(len(gone)), original[original >= 0])
    row["other_removed"], row["other_total"] = int(gone[other].sum()), int(other.sum())
    row["other"] = round(row["other_removed"] / row["other_total"], 5)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--distinct", type=int, default=20_000)
    p.add_argument("--planted", type=int, default=300)
    p.add_argument("--topics", type=int, default=200)
    p.add_argument("--topic_cosine", type=float, default=0.8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--clusters", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from disco_clip_ds.data.curate import clusters as cl
    from disco_clip_ds.data.curate import semdedup

    rng = np.random.default_rng(args.seed)
    embeddings, original, kind, groups = planted_pool(args, rng)
    # the pairs k-means separates are never compared: counted once, with the filter's centres
    sample = embeddings[cl.sample_rows(len(embeddings), 1_000_000, args.seed)]
    assigned = cl.nearest_centre(cl.train_centres(sample, args.clusters, args.seed), embeddings)
    copies = np.flatnonzero(original >= 0)
    split = int(np.count_nonzero(assigned[copies] != assigned[original[copies]]))
    rows = []
    for eps in EPS:
        wall, cpu = time.perf_counter(), time.process_time()
        gone = semdedup.semdedup_drops(embeddings, eps, args.clusters, 1_000_000, args.seed)
        seconds = {"wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2)}
        found = score(gone, original, kind, groups)
        row = {"eps": eps, **found, "split_pairs": split, "planted_copies": len(copies), **seconds}
        rows.append({"samples": len(embeddings), "dim": args.dim, "clusters": args.clusters, **row})
        print(rows[-1])
    write_rows(RESULTS / "semdedup.csv", rows, rounds=1)


if __name__ == "__main__":
    main()
