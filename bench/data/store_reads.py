"""What one DataLoader worker's EmbeddingStore reads and holds (data/embeddings.py), per 1,000 samples drawn from a
mixture of 1, 4 and 8 sources: sidecars opened (a whole sidecar loaded, at the base), bytes read from the sidecars,
and the process's peak RSS above what it held before its first lookup; this tree against --base (a checkout of
the commit before sidecars were read by block: `git worktree add /tmp/base9b 9b87829`).

The sidecars: DataCompDR's row shape (K = 30 augmentations, two teachers of width 768 in float16, 6 captions: the
real one and 5 synthetic; 111,072 bytes a sample) with shards scaled from DataCompDR's 10,000 samples to
--shard_samples (1,000 by default: 111 MB a sidecar, against 1.1 GB), random values, --shards_per_source shards a
source. Each side writes its own with its own writer (the base: format 2; this tree: format 3) and reads them back.
The reads: as a worker of the training stream reads them (data/streams/shards.py, data/mix.py): each sample's
source drawn uniformly (seeded), each source's shards in order, cut into blocks of --shuffle_buffer consecutive
samples (training's default 1,000), each block permuted (seeded); the same key sequence for both sides. A lookup is
`store.lookup(shard, key)`, as `Reinforcement.lookup` makes it.

Counting: this tree's `store.stats` (opens, bytes); at the base, every `read_reinforced` the store calls is wrapped
and counts one open and the sidecar's size (it reads the whole file; its header a second time is left out). Each
(side, sources) measurement is a fresh process (its peak RSS its own), sides interleaved, --rounds rounds; the opens
and bytes are deterministic, the RSS varies a little.

    python bench/data/store_reads.py --base /tmp/base9b --rounds 3   # writes results/store_reads.csv
    python bench/data/store_reads.py --sides this --warmup --rounds 3 --results bench/data/results/store_reads_bound.csv

The second: this tree alone, each process first reading a 2-sample sidecar of its own (`--warmup`), so that its
peak RSS above the start is what the store holds (not the libraries' first use of their code), against the bound
`store_memory_bound(sources, row_bytes, shard_samples)` in the column bound_bytes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WIDTHS, K, CAPTIONS = [768, 768], 30, ["txt"] + [f"syn{i}.txt" for i in range(5)]


def shards_of(root: Path, source: int, shards: int) -> list[str]:
    return [str(root / f"source{source}" / f"{i:05d}.tar") for i in range(shards)]


def write_sidecars(root: Path, sources: int, shards: int, samples: int) -> None:
    """Every source's shards (1-byte stand-ins: the store reads only their sidecars) and their sidecars."""
    import torch

    from disco_clip_ds.data.embeddings import Reinforced, TeacherFacts, shard_facts, sidecar_path, write_reinforced

    gen = torch.Generator().manual_seed(0)
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1).half()  # noqa: E731
    images = [unit(samples, K, d) for d in WIDTHS]  # L2-normalised, as a teacher's: the reader checks it
    texts = [{c: unit(samples, d) for c in CAPTIONS} for d in WIDTHS]
    boxes = torch.randint(0, 200, (samples, K, 4), generator=gen, dtype=torch.int32)
    teachers = [TeacherFacts("a" * 16, "A", "clip", 100.0), TeacherFacts("b" * 16, "B", "clip", 100.0)]
    for source in range(sources):
        for shard in shards_of(root, source, shards):
            Path(shard).parent.mkdir(parents=True, exist_ok=True)
            Path(shard).write_bytes(b"x")
            keys = [f"{Path(shard).stem}{i:06d}" for i in range(samples)]
            stored = Reinforced(keys, teachers, images, texts, boxes, CAPTIONS, K, "float16", 0, shard_facts(shard))
            write_reinforced(sidecar_path(root / "emb", shard), stored)


def key_sequence(root: Path, sources: int, shards: int, samples: int, buffer: int, count: int, seed: int = 0):
    """(shard, key) of the first `count` samples a worker reads from a mixture of `sources` sources."""

    def source_reader(source: int):
        order = [
            (shard, f"{Path(shard).stem}{i:06d}") for shard in shards_of(root, source, shards) for i in range(samples)
        ]
        for start in range(0, len(order), buffer):
            block = order[start : start + buffer]
            random.Random(f"{seed}/{source}/{start}").shuffle(block)
            yield from block

    readers = [source_reader(s) for s in range(sources)]
    draw = random.Random(f"{seed}/mix")
    return [next(readers[draw.randrange(sources)]) for _ in range(count)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    """One measurement, in this process: the store of the tree on PYTHONPATH reads the key sequence."""
    from disco_clip_ds.data import embeddings

    root = Path(args.root)
    counted = {"opens": 0, "bytes": 0}
    if not hasattr(embeddings, "store_memory_bound"):  # the base: count each whole load
        whole = embeddings.read_reinforced

        def counting(path):
            counted["opens"] += 1
            counted["bytes"] += os.path.getsize(path)
            return whole(path)

        embeddings.read_reinforced = counting
    keys = key_sequence(
        root, args.sources, args.shards_per_source, args.shard_samples, args.shuffle_buffer, args.samples
    )
    extra = {"sources": args.sources} if "sources" in inspect.signature(embeddings.EmbeddingStore).parameters else {}
    if args.warmup:
        warm_up(root / "warmup", embeddings, extra)
    store = embeddings.EmbeddingStore(root / "emb", ["a" * 16, "b" * 16], **extra)
    before, started = rss_bytes(), time.perf_counter()
    for shard, key in keys:
        store.lookup(shard, key)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = getattr(store, "stats", None)
    if stats is not None:
        counted = {"opens": stats.opens, "bytes": stats.bytes}
    print(json.dumps({**counted, "peak_rss_above_start": peak - before, "peak_rss": peak, "seconds": seconds}))


def warm_up(folder: Path, embeddings, extra: dict) -> None:
    """Every code path a lookup takes, once, on a sidecar of 2 samples of its own (written by the side's own
    writer), so that the RSS counted after it is what the store holds, not the libraries' first use of their code."""
    import gc

    write_sidecars(folder, 1, 1, 2)
    store = embeddings.EmbeddingStore(folder / "emb", ["a" * 16, "b" * 16], **extra)
    for shard, key in key_sequence(folder, 1, 1, 2, 2, 2):
        store.lookup(shard, key)
    del store
    gc.collect()


def run_child(tree: Path, args, root: Path, sources: int, write: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--child", "--root", str(root), "--sources", str(sources)]
    argv += ["--shard_samples", str(args.shard_samples), "--shards_per_source", str(args.shards_per_source)]
    argv += ["--shuffle_buffer", str(args.shuffle_buffer), "--samples", str(args.samples)]
    argv += ["--warmup"] * getattr(args, "warmup", False)
    out = subprocess.run([*argv, *(["--write"] if write else [])], env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1]) if not write else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="a checkout of the base commit (e.g. /tmp/base9b)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--shard_samples", type=int, default=1000)
    parser.add_argument("--shards_per_source", type=int, default=2)
    parser.add_argument("--shuffle_buffer", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--results", default=str(HERE / "results" / "store_reads.csv"))
    parser.add_argument("--sides", nargs="+", default=["this", "base"], help="this, base (needs --base), or both")
    parser.add_argument(
        "--warmup", action="store_true", help="first read a 2-sample sidecar of its own (the RSS is then the store's)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.sources = args.sources[0]
        if args.write:
            write_sidecars(Path(args.root), args.sources, args.shards_per_source, args.shard_samples)
        else:
            child(args)
        return
    measure(args)


def measure(args) -> None:
    from disco_clip_ds.data.embeddings import store_memory_bound, stored_row_bytes
    from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows

    trees = {"this": REPO, "base": Path(args.base).resolve() if args.base else None}
    sides = {side: trees[side] for side in args.sides}
    most = max(args.sources)
    with tempfile.TemporaryDirectory(prefix="store_reads_") as tmp:
        roots = {side: Path(tmp) / side for side in sides}
        for side, tree in sides.items():  # the most sources' sidecars serve every mixture
            run_child(tree, args, roots[side], most, write=True)
        results = {(side, s): [] for side in sides for s in args.sources}
        for r in range(args.rounds):
            for s in args.sources:
                for side in sides if r % 2 == 0 else list(sides)[::-1]:
                    results[(side, s)].append(run_child(sides[side], args, roots[side], s))
                    print(side, s, results[(side, s)][-1], flush=True)
    row_bytes = stored_row_bytes(WIDTHS, K, len(CAPTIONS), "float16")
    rows = []
    for s in args.sources:
        per = {
            side: {
                q: [m.get(q) for m in results[(side, s)]] for q in ("opens", "bytes", "peak_rss_above_start", "seconds")
            }
            for side in sides
        }
        scale = 1000 / args.samples
        settings = {
            "sources": s,
            "samples_read": args.samples,
            "shard_samples": args.shard_samples,
            "shuffle_buffer": args.shuffle_buffer,
            "row_bytes": row_bytes,
            "bound_bytes": store_memory_bound(s, row_bytes, args.shard_samples),
        }
        measured = {}
        for side in sides:
            measured[f"{side}_opens_per_1000"] = [v * scale for v in per[side]["opens"]]
            measured[f"{side}_mb_read_per_1000"] = [v * scale / 1e6 for v in per[side]["bytes"]]
            measured[f"{side}_peak_rss_mb"] = [v / 1e6 for v in per[side]["peak_rss_above_start"]]
            measured[f"{side}_lookup_s_per_1000"] = [v * scale for v in per[side]["seconds"]]
        if len(sides) == 2:
            measured["time_ratio"] = ratios(measured["this_lookup_s_per_1000"], measured["base_lookup_s_per_1000"])
            measured["rss_ratio"] = ratios(measured["this_peak_rss_mb"], measured["base_peak_rss_mb"])
            measured["read_ratio"] = ratios(measured["this_mb_read_per_1000"], measured["base_mb_read_per_1000"])
        rows.append(bench_row({**settings, "warmup": args.warmup}, measured, digits=3))
    write_rows(args.results, rows)
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
