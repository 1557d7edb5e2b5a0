"""Samples/s of `disco-clip data download` under Spark local mode vs multiprocessing, same input.

A loopback image server (disco_clip_ds.testing's ImageServer, in a process of its own so that it does not share
the GIL with the driver) serves N small JPEGs, each after a fixed delay that stands in for network latency.
Each configuration (processes x threads) is downloaded by both distributors, interleaved (mp, spark,
mp, spark, ...) within one run so that load from other jobs on the machine hits both alike. Each
download is a fresh CLI process, timed end to end: Spark's JVM start is part of what a user waits for.

    .venv/bin/python bench/data/spark_bench.py --images 3000 --rounds 2 --configs 1x16 2x16 2x32

Writes bench/data/results/spark_bench.csv (one row per download) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.download import download_args, write_url_list
from disco_clip_ds.testing.images import image_bytes
from disco_clip_ds.testing.imageserver import ImageServer


def _serve(n_images: int, delay: float, ready, stop) -> None:
    with ImageServer() as server:
        for i in range(n_images):
            image = image_bytes("JPEG", "RGB", (64 + i % 64, 48), (i % 256, (7 * i) % 256, 100), quality=90)
            server.add(f"/{i}.jpg", body=image, delay=delay)
        ready.put(server.base_url)
        stop.wait()


def _download(url_list: Path, output: Path, distributor: str, processes: int, threads: int, shard: int) -> dict:
    options = dict(
        image_size=64, processes=processes, threads=threads, samples_per_shard=shard, distributor=distributor
    )
    cmd = [sys.executable, "-m", "disco_clip_ds.cli", "data", "download", *download_args(url_list, output, **options)]
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "no_proxy": "127.0.0.1,localhost"}
    started, spark_ready, lines = time.perf_counter(), None, []
    with (
        tempfile.TemporaryFile() as err,
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        for line in proc.stdout:  # prep prints "spark: master ..." once the session is up
            lines.append(line)
            if spark_ready is None and line.startswith("spark: master"):
                spark_ready = time.perf_counter() - started
        seconds = time.perf_counter() - started
        if proc.wait() != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(lines)[-2000:]}\n{err.read()[-2000:]}")
    summary = json.loads((output / "summary.json").read_text())
    return {
        "seconds": round(seconds, 3),
        "spark_start_s": None if spark_ready is None else round(spark_ready, 3),
        "successes": summary["successes"],
        "count": summary["count"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--delay", type=float, default=0.02, help="server-side seconds before each answer")
    p.add_argument("--samples_per_shard", type=int, default=250)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=["1x16", "2x16", "2x32"], help="PROCESSESxTHREADS")
    p.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "spark_bench.csv")
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(args.images, args.delay, ready, stop), daemon=True)
    server.start()
    base_url = ready.get(timeout=300)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="spark_bench_") as tmp:
            urls = [(f"{base_url}/{i}.jpg", f"image {i}") for i in range(args.images)]
            url_list = write_url_list(Path(tmp) / "urls.parquet", urls)
            for rnd in range(args.rounds):
                for config in args.configs:
                    processes, threads = map(int, config.split("x"))
                    for distributor in ("multiprocessing", "pyspark"):
                        out = Path(tmp) / f"{rnd}_{config}_{distributor}"
                        r = _download(url_list, out, distributor, processes, threads, args.samples_per_shard)
                        row = {
                            "round": rnd,
                            "processes": processes,
                            "threads": threads,
                            "distributor": distributor,
                            **r,
                            "samples_per_s": round(r["successes"] / r["seconds"], 1),
                        }
                        print(row, flush=True)
                        rows.append(row)
    finally:
        stop.set()
        server.join(timeout=10)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.csv, rows, rounds=1)
    print(
        f"\n{args.images} images, {args.delay}s server delay each, {args.samples_per_shard}/shard, "
        f"{args.rounds} interleaved rounds; medians\n"
    )
    print(
        "| processes x threads | multiprocessing samples/s | Spark local samples/s | Spark / mp | Spark extra s "
        "| of which session start s |"
    )
    print("|---|---|---|---|---|---|")
    for config in args.configs:
        processes, threads = map(int, config.split("x"))

        def med(dist, key, processes=processes, threads=threads):
            return statistics.median(
                r[key] for r in rows if (r["processes"], r["threads"], r["distributor"]) == (processes, threads, dist)
            )

        mp_rate, sp_rate = med("multiprocessing", "samples_per_s"), med("pyspark", "samples_per_s")
        extra = med("pyspark", "seconds") - med("multiprocessing", "seconds")
        start = med("pyspark", "spark_start_s")
        print(f"| {config} | {mp_rate:.0f} | {sp_rate:.0f} | {sp_rate / mp_rate:.2f} | {extra:+.1f} | {start:.1f} |")


if __name__ == "__main__":
    main()
