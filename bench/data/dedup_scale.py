"""How the copy rules' search scales: `copies.copies_of_reference` (`data filter --dedup_against`) and
`copies.copies_within` (`--dedup`) on synthetic fingerprints, this tree's multi-index hashing (its compiled loop)
against the code of three earlier commits, extracted with `git archive`: the exhaustive faiss search of
--exhaustive_commit, at the sizes it can reach, and at the two largest the numpy multi-index hashing of
--numpy_commit and the first compiled loop of --compiled_commit.

Fingerprints are shaped as copies.py makes them: 64-bit hashes with 32 bits set (a pHash has as many bits set as
clear); a pool sample has its image's hash and its mirror's; an eval image has 20 (the image, its mirror, 9 windows
and their mirrors), each window's hash its image's with 2, 4 or 6 bits changed. Planted in the pool: 2 % copies of
an eval hash and 2 % copies of an earlier pool sample, each with 0 to 10 bits changed (so some just past the
default threshold, 8), and 0.5 % exact duplicates (an earlier sample's digest and hashes). Each measurement is a
fresh process (both sides alike), rounds interleaved; the timed part is the rule's call alone, wall and CPU time of
the process, after a call on 25,000 other samples that pays the one-time costs (imports, numba's compiled loop
loaded: `warmup_s`); decisions_sha is the SHA-256 of the decisions, equal for both sides at equal sizes and seed.

    python bench/data/dedup_scale.py --rounds 2 --csv bench/data/results/dedup_scale.csv
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# (rule, side, pool samples, eval images): this tree at the size and a quarter of it, against the first
# compiled loop and the numpy multi-index hashing there, and against the exhaustive search where it runs in reasonable
# time
CASES = [
    ("against", "new", 1_000_000, 100_000),
    ("against", "compiled", 1_000_000, 100_000),
    ("against", "numpy", 1_000_000, 100_000),
    ("against", "new", 250_000, 25_000),
    ("against", "compiled", 250_000, 25_000),
    ("against", "numpy", 250_000, 25_000),
    ("against", "new", 100_000, 10_000),
    ("against", "exhaustive", 100_000, 10_000),
    ("against", "new", 25_000, 2_500),
    ("against", "exhaustive", 25_000, 2_500),
    ("within", "new", 1_000_000, 0),
    ("within", "compiled", 1_000_000, 0),
    ("within", "numpy", 1_000_000, 0),
    ("within", "new", 250_000, 0),
    ("within", "compiled", 250_000, 0),
    ("within", "numpy", 250_000, 0),
    ("within", "new", 50_000, 0),
    ("within", "exhaustive", 50_000, 0),
    ("within", "new", 25_000, 0),
    ("within", "exhaustive", 25_000, 0),
]


def balanced(rng, n: int) -> np.ndarray:
    """(n, 64) bits, 32 of each row set."""
    bits = np.zeros((n, 64), np.uint8)
    bits[:, :32] = 1
    return rng.permuted(bits, axis=1)


def flipped(rng, bits: np.ndarray, flips: np.ndarray) -> np.ndarray:
    """`bits` with flips[i] bits of row i changed, half set ones cleared and half clear ones set (stays balanced)."""
    noise = rng.random(bits.shape) + 2 * bits  # ones rank after zeros
    rank_zero = np.argsort(np.argsort(noise, axis=1), axis=1)  # zeros take ranks 0..31, ones 32..63
    half = (flips // 2)[:, None]
    change = (rank_zero < half) | ((rank_zero >= 32) & (rank_zero < 32 + half))
    return bits ^ change.astype(np.uint8)


def synthetic(pool: int, eval_images: int, seed: int):
    """(digests (n, 16) uint8, pool fingerprints (n, 2, 8), eval fingerprints (m, 20, 8))."""
    rng = np.random.default_rng(seed)
    reference = np.zeros((eval_images, 20, 8), np.uint8)
    if eval_images:
        image, mirror = balanced(rng, eval_images), balanced(rng, eval_images)
        rows = [image, mirror]
        for _ in range(9):
            change = rng.choice([2, 4, 6], eval_images)
            rows += [flipped(rng, image, change), flipped(rng, mirror, change)]
        reference = np.stack([np.packbits(r, axis=1) for r in rows], axis=1)
    train = np.stack([balanced(rng, pool), balanced(rng, pool)], axis=1)  # (n, 2, 64) bits
    digests = rng.integers(0, 256, (pool, 16), dtype=np.uint8)
    n_copies = pool // 50
    if eval_images:  # copies of an eval hash
        rows = rng.choice(pool, n_copies, replace=False)
        source = np.unpackbits(reference[rng.integers(0, eval_images, n_copies), rng.integers(0, 20, n_copies)], axis=1)
        train[rows, 0] = flipped(rng, source, rng.integers(0, 6, n_copies) * 2)
    later = rng.choice(np.arange(1, pool), n_copies, replace=False)  # copies of an earlier pool sample
    earlier = (rng.random(n_copies) * later).astype(np.int64)
    for side in (0, 1):
        train[later, side] = flipped(rng, train[earlier, side], rng.integers(0, 6, n_copies) * 2)
    later = rng.choice(np.arange(1, pool), pool // 200, replace=False)  # exact duplicates
    earlier = (rng.random(len(later)) * later).astype(np.int64)
    train[later], digests[later] = train[earlier], digests[earlier]
    return digests, np.packbits(train, axis=2), reference


def child(args) -> None:
    from disco_clip_ds.data.curate import copies

    def rule(digests, train, reference):
        if args.rule == "against":
            return copies.copies_of_reference(train, reference, args.threshold)
        return copies.copies_within([d.tobytes() for d in digests], train, args.threshold)  # bytes, as the filter has

    # one-time costs off the clock, timed apart: the rule on 25,000 samples (numba's import and compiled loop load)
    warm = time.perf_counter()
    rule(*synthetic(25_000, 2_500 if args.eval_images else 0, args.seed + 1))
    warm = time.perf_counter() - warm
    inputs = synthetic(args.pool, args.eval_images, args.seed)
    wall, cpu = time.perf_counter(), time.process_time()
    dropped = rule(*inputs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sha = hashlib.sha256(np.packbits(dropped).tobytes()).hexdigest()[:16]
    result = {"warmup_s": warm, "wall_s": wall, "cpu_s": cpu, "dropped": int(dropped.sum()), "decisions_sha": sha}
    print(json.dumps(result))


def extract(commit: str, into: str) -> None:
    """The package at `commit`, from `git archive`, under `into`."""
    archive = subprocess.run(["git", "archive", commit, "disco_clip_ds"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=__import__("io").BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")


def measure(case, seed: int, threshold: int, trees: dict, timeout: int) -> dict:
    rule, side, pool, eval_images = case
    env = dict(os.environ, PYTHONPATH=trees[side], OMP_NUM_THREADS="1")
    command = [sys.executable, __file__, "--child", "--rule", rule, "--pool", str(pool)]
    command += ["--eval_images", str(eval_images), "--seed", str(seed), "--threshold", str(threshold)]
    load = os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=True)
    return {"load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1), **json.loads(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=int, default=8)
    parser.add_argument("--exhaustive_commit", default="9b87829", help="the exhaustive faiss search")
    parser.add_argument("--numpy_commit", default="4c6b4bb", help="multi-index hashing in numpy alone")
    parser.add_argument("--compiled_commit", default="5bac64f", help="the first compiled loop (a branch per bucket)")
    parser.add_argument("--rules", nargs="+", default=["against", "within"])
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--csv", default="bench/data/results/dedup_scale.csv")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rule", help=argparse.SUPPRESS)
    parser.add_argument("--pool", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--eval_images", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from disco_clip_ds.testing.bench_record import write_rows

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    rows = []
    commits = {"new": commit.stdout.strip(), "exhaustive": args.exhaustive_commit, "numpy": args.numpy_commit}
    commits["compiled"] = args.compiled_commit
    with tempfile.TemporaryDirectory() as before:
        trees = {"new": str(ROOT)}
        for side in ("exhaustive", "numpy", "compiled"):
            trees[side] = os.path.join(before, side)
            extract(commits[side], trees[side])
        for round_ in range(args.rounds):
            for case in [c for c in CASES if c[0] in args.rules]:
                result = measure(case, args.seed, args.threshold, trees, args.timeout)
                rule, side, pool, eval_images = case
                row = {"rule": rule, "side": side, "commit": commits[side]}
                row.update(pool=pool, eval_images=eval_images, reference_hashes=20 * eval_images, round=round_)
                row.update(threshold=args.threshold, **result)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_rows(args.csv, rows, rounds=1)  # one row a round; rewritten after each: a partial run is kept


if __name__ == "__main__":
    main()
