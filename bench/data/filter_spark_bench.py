"""Samples/s of `disco-clip data filter` per Spark executor core against one process, and the hours a 12.8B-sample
pool would take on N Spark workers at those rates.

The pool: LAION-like 256 px JPEG shards (input_pipeline.py's) with sidecars of random unit rows of width 512
(embed_filter_bench.py's). Sides, each a process of its own (one thread for numpy and torch):
- `processes1`: `--processes 1`, the one-machine filter;
- `spark_local1`, `spark_local2`: `--spark local[1]` / `local[2]`: one Spark worker with 1 or 2 executor cores.
A side starts (its Spark session, not timed: `session_s`), filters a small warm-up set (imports, Spark's Python
workers), then each rule set once, timed: `--keep_fraction 0.3` (the score path: tar headers, sidecars, a copy of the
kept members) and `--keep_fraction 0.3 --dedup` (every image decoded for its fingerprint). Sides interleave, their
order turned every round. Each side's output is hashed: `identical` says whether every side wrote the same bytes.

Hours on N workers of C cores: 12.8e9 / (rate per core * C * N) / 3600, assuming that the scan and write tasks
(a shard each, no shared state) scale with the cores as local[2] against local[1] shows here, the same per-core rate
on the cluster's cores, and the driver's decisions (a threshold over a float32 score a sample) small against them.

    python bench/data/filter_spark_bench.py --shards 4 --per_shard 500 --rounds 2

Writes bench/data/results/filter_spark.csv (a row per side and rule set) and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
OUT = REPO / "outputs" / "bench_filter_spark"
SIDES = {"processes1": [], "spark_local1": ["--spark", "local[1]"], "spark_local2": ["--spark", "local[2]"]}
RULES = {"score": ["--keep_fraction", "0.3"], "score_dedup": ["--keep_fraction", "0.3", "--dedup"]}
POOL = 12.8e9
WORKERS = (10, 100, 1000)
CORES_PER_WORKER = 16


def make_data(shards: int, per_shard: int) -> dict[str, Path]:
    from embed_filter_bench import _random_sidecar
    from input_pipeline import make_shards

    folders = {"data": OUT / f"laion256_{shards}x{per_shard}", "warm": OUT / "warm256"}
    for name, (count, size) in {"data": (shards, per_shard), "warm": (2, 32)}.items():
        for index, url in enumerate(make_shards(folders[name], count, size, 256, seed=1 if name == "warm" else 0)):
            _random_sidecar(url, seed=index)
    return folders


def child(args) -> None:
    """One side: its session up, a warm-up, then each rule set of `args.rules` timed; JSON on the last line."""
    from disco_clip_ds.commands.data import filter_main

    side = SIDES[args.child]
    started = time.perf_counter()
    session = None
    if side:
        from disco_clip_ds.data.prep.spark import spark_session

        session = spark_session(side[1], 1)
        session.__enter__()
    times = {"session_s": time.perf_counter() - started}
    out = Path(args.output)
    filter_main(["--shards", args.warm, "--output", str(out) + "_warm", *RULES["score"], *side])
    for name in args.rules:
        rule = RULES[name]
        shutil.rmtree(out / name, ignore_errors=True)
        started = time.perf_counter()
        filter_main(["--shards", args.data, "--output", str(out / name), *rule, *side, "--samples_per_shard", "1000"])
        times[name] = time.perf_counter() - started
    if session is not None:
        session.__exit__(None, None, None)
    print(json.dumps(times))


def run_side(side: str, data: dict[str, Path], rules: list[str]) -> tuple[dict, dict[str, str]]:
    out = OUT / "run"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--output", str(out)]
    command += ["--data", str(data["data"]), "--warm", str(data["warm"]), "--rules", *rules]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{side} failed: {done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), {name: _digest(out / name) for name in rules}


def _digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and ".filter" not in path.parts:
            digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def measure(args) -> list[dict]:
    from disco_clip_ds.testing.bench_record import bench_row

    data = make_data(args.shards, args.per_shard)
    samples = args.shards * args.per_shard
    rates = {side: {rule: [] for rule in args.rules} for side in SIDES}
    starts = {side: [] for side in SIDES}
    digests = {rule: set() for rule in args.rules}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else list(SIDES)[::-1]:
            times, digest = run_side(side, data, args.rules)
            starts[side].append(times["session_s"])
            for rule in args.rules:
                rates[side][rule].append(samples / times[rule])
                digests[rule].add(digest[rule])
            print(round_, side, {rule: round(rates[side][rule][-1], 1) for rule in args.rules}, flush=True)
    rows = []
    for side in SIDES:
        cores = 2 if side == "spark_local2" else 1
        for rule in args.rules:
            per_core = [rate / cores for rate in rates[side][rule]]
            settings = {"side": side, "rules": " ".join(RULES[rule]), "samples": samples, "cores": cores}
            settings["identical"] = len(digests[rule]) == 1
            measured = {"samples_per_s": rates[side][rule], "samples_per_s_per_core": per_core}
            measured["session_s"] = starts[side]
            row = bench_row(settings, measured, 2)
            median = row["samples_per_s_per_core_median"]
            for workers in WORKERS:  # the 12.8B pool on N workers of CORES_PER_WORKER cores at this per-core rate
                row[f"hours_12.8B_on_{workers}x{CORES_PER_WORKER}_cores"] = round(
                    POOL / (median * CORES_PER_WORKER * workers) / 3600, 1
                )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--per_shard", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    parser.add_argument("--csv", type=Path, default=HERE / "results" / "filter_spark.csv")
    parser.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--warm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from disco_clip_ds.testing.bench_record import write_rows

    rows = measure(args)
    write_rows(args.csv, rows)
    print("| side | rules | samples/s (min / median / max) | per core (median) | same bytes |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        spread = " / ".join(str(row[f"samples_per_s_{s}"]) for s in ("min", "median", "max"))
        print(
            f"| {row['side']} | {row['rules']} | {spread} | {row['samples_per_s_per_core_median']} | "
            f"{row['identical']} |"
        )


if __name__ == "__main__":
    main()
