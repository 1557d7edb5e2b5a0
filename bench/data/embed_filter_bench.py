"""`data embed` and a score-only `data filter` on LAION-like 256 px JPEGs, this tree against a base commit
(a `git worktree` of it, `--base`), interleaved in one invocation: each round runs base then this (this then base
every other round), each side in its own process with its own `disco_clip_ds` on PYTHONPATH, one thread
(OMP_NUM_THREADS=1), its command's main called after a warm-up call on a small shard set (imports, page cache).

- embed: `data embed` of 1,000 samples with the quickstart's tiny teacher (random weights, 64 px input, so the
  decode and crop dominate, which is what decoding in workers overlaps); this tree with `--num_workers 2`, the base
  as it runs (decoding in its one process). Wall-clock samples/s, and the CPU milliseconds a sample of the
  embedding process alone (`main`: what cannot overlap) and with its workers (`all`: the work, wherever done).
- filter: `data filter --keep_fraction 0.7 --samples_per_shard 1000` over 5 shards of 1,000 samples with sidecars
  (random unit embeddings of width 512), `--processes 1`: samples/s of wall-clock time and of the process's CPU time
  (user + system: what one process does on a core of its own; the machine's other load slows the wall clock).

Both sides write to the same output folder (the sidecars record the output shards' absolute paths), and each run's
output files are hashed: `identical_to_base` says whether every file of this tree's output is byte for byte the
base's (the filter's state folder and filter.json's timing aside). A sidecar's file format may differ between the
commits (its header, block checksums, tensor names), so `stored_values_equal_to_base` compares what embed stored:
the set of the sidecars' tensors, each by dtype, shape and bytes, whatever their names and the header.

    git worktree add /tmp/base_ef 9b87829
    python bench/data/embed_filter_bench.py --base /tmp/base_ef --rounds 3
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
OUT = REPO / "outputs" / "bench_embedfilter"
TOKENIZER = REPO / "recipes" / "tokenizer"
FILTER = ["--keep_fraction", "0.7", "--samples_per_shard", "1000"]


def make_data() -> dict[str, Path]:
    """LAION-like 256 px shards (input_pipeline.py's) with sidecars of random unit rows, a small warm-up set, and the
    tiny teacher."""
    from input_pipeline import make_shards

    folders = {"data": OUT / "laion256", "warm": OUT / "warm256"}
    for name, (shards, per_shard) in {"data": (5, 1000), "warm": (1, 64)}.items():
        urls = make_shards(folders[name], shards, per_shard, 256, seed=1 if name == "warm" else 0)
        for index, url in enumerate(urls):
            _random_sidecar(url, seed=index)
    teacher = OUT / "teacher"
    if not (teacher / "config.json").is_file():
        from disco_clip_ds.models.build import build_model

        build_model(model_config=str(REPO / "recipes" / "models" / "tiny.json"), seed=0).save_pretrained(teacher)
    return {**folders, "teacher": teacher}


def _random_sidecar(url: str, seed: int) -> None:
    import numpy as np
    import torch

    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_sidecar
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    path = sidecar_path(Path(url).parent, url)
    if path.is_file():
        return
    keys = [s["__key__"] for s in raw_samples(url, read=False)]
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((len(keys), 512)) for _ in range(2)]
    image, text = (torch.from_numpy(r / np.linalg.norm(r, axis=1, keepdims=True)).float() for r in rows)
    meta = {"teacher": "f00dfeedf00dfeed", "teacher_name": "random", "model_type": "clip", "logit_scale": "100.0"}
    write_sidecar(path, keys, image, text, {**meta, "logit_bias": "", **shard_facts(url)})


def child(args) -> None:
    """One side's measured call (this process imports that side's package): JSON {wall, cpu} on the last line."""
    from disco_clip_ds.commands.data import embed_main, filter_main

    data, out = OUT / "laion256", Path(args.output)
    if args.child == "embed":
        teacher = ["--teacher", str(OUT / "teacher"), "--tokenizer_name", str(TOKENIZER)]
        workers = ["--num_workers", str(args.workers)] if args.workers is not None else []
        warm = [*teacher, *workers, "--shards", str(OUT / "warm256"), "--output", str(out) + "_warm"]
        run = [*teacher, *workers, "--shards", str(data / "00000.tar"), "--output", str(out)]
        main = embed_main
    else:
        warm = ["--shards", str(OUT / "warm256"), "--output", str(out) + "_warm", *FILTER]
        run = ["--shards", str(data), "--output", str(out), *FILTER]
        main = filter_main
    import disco_clip_ds

    main(warm)
    if args.profile_to:  # the measured call under cProfile: its functions by cumulative time, then by own time
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.runcall(main, run)
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text).strip_dirs()
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        Path(args.profile_to).write_text(text.getvalue())
        print(json.dumps({"wall": 0.0, "cpu": 0.0, "package": disco_clip_ds.__file__}))
        return
    import resource

    def children() -> float:  # the CPU time of the reaped children: data embed's decoding workers
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    wall, cpu, workers = time.perf_counter(), time.process_time(), children()
    main(run)
    times = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "workers": children() - workers}
    print(json.dumps({**times, "package": disco_clip_ds.__file__}))


def run_side(step: str, root: Path, workers: int | None, profile: Path | None = None) -> tuple[dict, tuple[str, str]]:
    """(the child's times, (a digest of its output files, one of its stored tensors for embed)) for `step` with
    ROOT's package; with `profile`, its cProfile into that file instead of times."""
    out = OUT / "run" / step
    for folder in (out, Path(str(out) + "_warm")):
        shutil.rmtree(folder, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", step, "--output", str(out)]
    command += ["--workers", str(workers)] if workers is not None else []
    command += ["--profile_to", str(profile)] if profile else []
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{step} with {root} failed: {done.stderr[-3000:]}")
    said = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(said["package"]).is_relative_to(root):  # the side's own package ran, not another's
        raise RuntimeError(f"{step}: ran {said['package']}, not {root}'s")
    return said, (_digest(out), _tensors_digest(out) if step == "embed" else "")


def _digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and ".filter" not in path.parts and path.name != "filter.json":
            digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _tensors_digest(folder: Path) -> str:
    """A digest of the sidecars' tensors (dtype, shape, bytes), sorted: the stored values, not the file format."""
    from safetensors.numpy import load_file

    parts = []
    for path in sorted(folder.rglob("*.safetensors")):
        for tensor in load_file(path).values():
            parts.append(hashlib.sha256(f"{tensor.dtype}{tensor.shape}".encode() + tensor.tobytes()).hexdigest())
    return hashlib.sha256("".join(sorted(parts)).encode()).hexdigest()


def compare(args) -> list[dict]:
    from disco_clip_ds.testing.bench_record import bench_row, ratios

    sides = {"base": Path(args.base).resolve(), "this": REPO}
    samples = {"embed": 1000, "filter": 5000}
    rows = []
    for step in args.steps:
        rates = {side: {"wall": [], "cpu": [], "cpu_ms_main": [], "cpu_ms_all": []} for side in sides}
        digests = {side: set() for side in sides}
        values = {side: set() for side in sides}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for side in order:
                workers = args.workers if (step == "embed" and side == "this") else None
                times, (digest, stored) = run_side(step, sides[side], workers)
                digests[side].add(digest)
                values[side].add(stored)
                for clock in ("wall", "cpu"):
                    rates[side][clock].append(samples[step] / times[clock])
                rates[side]["cpu_ms_main"].append(1000 * times["cpu"] / samples[step])
                rates[side]["cpu_ms_all"].append(1000 * (times["cpu"] + times["workers"]) / samples[step])
                print(step, side, {k: round(v[-1], 1) for k, v in rates[side].items()}, flush=True)
        clocks = ("wall",) if step == "embed" else ("wall", "cpu")
        identical = digests["this"] == digests["base"] and len(digests["base"]) == 1
        suffix = f"_{args.tag}" if args.tag else ""
        for side in sides:
            settings = {"step": step + suffix, "side": side, "samples": samples[step], "threads": 1}
            settings["workers"] = args.workers if (step == "embed" and side == "this") else 0
            settings["identical_to_base"] = identical if side == "this" else ""
            if step == "embed":
                same = values["this"] == values["base"] and len(values["base"]) == 1
                settings["stored_values_equal_to_base"] = same if side == "this" else ""
            measured = {f"samples_per_s_{clock}": rates[side][clock] for clock in clocks}
            if step == "embed":  # CPU ms a sample: the embedding process's, and with its workers'
                measured |= {f"cpu_ms_per_sample_{part}": rates[side][f"cpu_ms_{part}"] for part in ("main", "all")}
            if side == "this":
                measured |= {f"speedup_{clock}": ratios(rates["this"][clock], rates["base"][clock]) for clock in clocks}
            rows.append(bench_row(settings, measured, 2))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a worktree of the base commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", nargs="+", choices=["embed", "filter"], default=["embed", "filter"])
    parser.add_argument("--workers", type=int, help="this tree's data embed --num_workers (default 2)")
    parser.add_argument("--child", choices=["embed", "filter"], help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--profile_to", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help="a suffix to the step names, and the result file's: results/embed_filter_TAG.csv")
    parser.add_argument(
        "--profile", action="store_true", help="instead: cProfile one filter run per side into results/filter_profile_*"
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    args.workers = 2 if args.workers is None else args.workers
    from disco_clip_ds.testing.bench_record import write_rows

    make_data()
    if args.profile:
        for side, root in {"base": Path(args.base).resolve(), "this": REPO}.items():
            run_side("filter", root, None, HERE / "results" / f"filter_profile_{side}.txt")
        return
    rows = compare(args)
    write_rows(HERE / "results" / f"embed_filter{'_' + args.tag if args.tag else ''}.csv", rows)


if __name__ == "__main__":
    main()
