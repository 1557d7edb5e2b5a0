"""`data filter` on noisy captions: what a CLIP-score filter keeps, what a tiny CLIP trained on it learns, and what
filtering and embedding cost per process.

Quality (results/filter_quality.csv):
1. the demo with `--caption_noise 0.3` (the quickstart's CAPTION_NOISE=0.3, data/demo_noise0.3) and the teacher the
   quickstart trains on it (SEED 0, the default tiny CLIP: outputs/bench_filter/noisy_s0, which is also the
   "unfiltered" run of seed 0);
2. `disco-clip data embed` of its training shards with that teacher, then `disco-clip data filter --keep_fraction 0.7`
   ("filtered"), and the same with `--target` the eval classes' names as text and `--clusters 20` ("filtered_target":
   the image-based filter intersected with the CLIP-score one), and the CLIP-score one with DataComp's basic filter
   (`--basic_filter`, its image side rule at the demo's 64 px: "basic_filtered");
3. precision (kept samples whose caption names the digit the image shows) and recall (such samples kept), per filter.
   The demo does not record which captions it changed; each training sample's json holds its image's label, and a
   caption is right when the digit it names (a word or a numeral, `named_digit`) is that label;
4. the quickstart (the default tiny CLIP, its steps, batch and zero-shot evals at steps 100, 200, 300) per seed on the
   filtered shards (both filters), on the noisy ones and on the clean demo (data/demo), all at equal steps; the eval
   split is the demo's own in every run. A run whose folder already holds a finished trainer_state.json is read, not
   run again.

Throughput (results/filter_throughput.csv), one process, one thread (OMP_NUM_THREADS=1, as the quickstart), each
command's main called in this process after a warm-up (imports not counted; each embed builds the teacher once):
samples/s of `data embed` (the quickstart's tiny teacher) and `data filter --keep_fraction 0.7`, on the
demo's training shards (64 px) and on LAION-like 256 px JPEGs (bench/data/input_pipeline.py's shards), and the hours
one process would take for 1e9 samples at that rate.

    python bench/data/filter_quality.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
OUT = REPO / "outputs" / "bench_filter"
NOISY, CLEAN = REPO / "data" / "demo_noise0.3", REPO / "data" / "demo"
TEACHER = OUT / "noisy_s0"
TOKENIZER = REPO / "recipes" / "tokenizer"
RUNS = ("noisy", "clean", "filtered", "filtered_target", "basic_filtered")
FILTERS = {
    "filtered": ["--keep_fraction", "0.7"],
    # DataComp's basic filter with the CLIP-score one (its "basic + CLIP score"), the image side rule at the demo's
    # 64 px (DataComp's 200 px would drop every 64 px digit)
    "basic_filtered": ["--keep_fraction", "0.7", "--basic_filter", "--min_image_side", "64"],
    "filtered_target": ["--keep_fraction", "0.7", "--clusters", "20"],  # + --target the class names
}
QUALITY = ["run", "seed", "step", "zeroshot_acc1", "zeroshot_acc5", "train_samples", "precision", "recall"]
BILLION = 1e9


def quickstart(out: Path, port: int, **env: str) -> list[dict]:
    """The quickstart into OUT with `env` set, unless OUT holds a finished run; its zero-shot rows."""
    if not _finished(out):
        shutil.rmtree(out, ignore_errors=True)
        full = {**os.environ, "OUT": str(out), "MASTER_PORT": str(port), **env}
        subprocess.run(["bash", "recipes/quickstart.sh"], cwd=REPO, env=full, check=True, stdout=subprocess.DEVNULL)
    return zeroshot_rows(out)


def _finished(out: Path) -> bool:
    state = out / "trainer_state.json"
    return state.is_file() and any("train_runtime" in h for h in json.loads(state.read_text())["log_history"])


def zeroshot_rows(out: Path) -> list[dict]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [
        {"step": h["step"], "zeroshot_acc1": h["zeroshot_acc1"], "zeroshot_acc5": h["zeroshot_acc5"]}
        for h in history
        if "zeroshot_acc1" in h
    ]


def cli(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(REPO / ".venv" / "bin" / "disco-clip"), *args], cwd=REPO, env=env, check=True)


def named_digit(caption: str) -> int | None:
    """The digit a demo caption names: a digit word (DIGITS) or a lone numeral; None when it names none."""
    from disco_clip_ds.data.prep.demo import DIGITS

    for token in re.findall(r"[a-z]+|\d+", caption.lower()):
        if token in DIGITS:
            return DIGITS.index(token)
        if token.isdigit() and len(token) == 1:
            return int(token)
    return None


def truth(shards: Path) -> dict[str, bool]:
    """{sample key: its caption names its image's digit} over the training shards in SHARDS."""
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    right = {}
    for shard in sorted(shards.glob("*.tar")):
        for sample in raw_samples(str(shard)):
            label = json.loads(sample["json"])["label"]
            right[sample["__key__"]] = named_digit(sample["txt"].decode()) == label
    return right


def kept_keys(folder: Path) -> set[str]:
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    return {s["__key__"] for shard in sorted(folder.glob("*.tar")) for s in raw_samples(str(shard), read=False)}


def build_filtered(name: str, embeddings: Path, classnames: Path) -> Path:
    """`data filter` of the noisy training shards into OUT/data_NAME/train, the demo's eval split beside it."""
    data = OUT / f"data_{name}"
    if not (data / "train" / "sizes.json").is_file():
        shutil.rmtree(data, ignore_errors=True)
        target = ["--target", str(classnames)] if name == "filtered_target" else []
        cli(
            "data", "filter", "--shards", str(NOISY / "train"), "--embeddings", str(embeddings),
            "--output", str(data / "train"), "--teacher", str(TEACHER), "--samples_per_shard", "180",
            *FILTERS[name], *target,
        )  # fmt: skip
        (data / "eval").symlink_to(NOISY / "eval")
    return data


def quality(args) -> list[dict]:
    rows_of = {}
    rows_of[("noisy", 0)] = quickstart(TEACHER, 29581, SEED="0", CAPTION_NOISE="0.3")
    embeddings, filters = OUT / "embeddings", [name for name in FILTERS if name in args.runs]
    if filters:  # resumes: a sidecar that verifies is kept
        cli("data", "embed", "--teacher", str(TEACHER), "--tokenizer_name", str(TOKENIZER),
            "--shards", str(NOISY / "train"), "--output", str(embeddings))  # fmt: skip
    right = truth(NOISY / "train")
    data = {name: build_filtered(name, embeddings, NOISY / "eval" / "classnames.txt") for name in filters}
    facts = {"noisy": _facts(set(right), right), "clean": {"train_samples": len(right)}}
    facts |= {name: _facts(kept_keys(folder / "train"), right) for name, folder in data.items()}
    for seed in args.seeds:  # seed by seed: a cut-short bench still compares every kind of data
        for run in args.runs:
            if (run, seed) in rows_of:
                continue
            env = {"SEED": str(seed), "OMP_NUM_THREADS": "1"}
            if run == "noisy":
                env["CAPTION_NOISE"] = "0.3"
            elif run in data:
                env["DATA"] = str(data[run])
            rows_of[(run, seed)] = quickstart(OUT / f"{run}_s{seed}", 29582 + seed, **env)
            print(run, seed, rows_of[(run, seed)][-1], flush=True)
    return [
        {"run": run, "seed": seed, **row, **facts[run]}
        for (run, seed), rows in sorted(rows_of.items(), key=lambda kv: (RUNS.index(kv[0][0]), kv[0][1]))
        if run in args.runs
        for row in rows
    ]


def _facts(kept: set[str], right: dict[str, bool]) -> dict:
    """precision: kept samples whose caption is right; recall: right samples kept."""
    good = {k for k, ok in right.items() if ok}
    return {
        "train_samples": len(kept),
        "precision": round(len(kept & good) / len(kept), 4),
        "recall": round(len(kept & good) / len(good), 4),
    }


def laion_like(samples: int) -> Path:
    """`samples` LAION-like 256 px JPEG samples in shards of 500 (bench/data/input_pipeline.py's), with sizes.json."""
    from input_pipeline import make_shards

    from disco_clip_ds.data.shards import write_json

    folder, per_shard = OUT / "laion256", 500
    urls = make_shards(folder, -(-samples // per_shard), per_shard, 256)
    write_json(folder / "sizes.json", {Path(u).name: per_shard for u in urls})
    return folder


def throughput(args) -> list[dict]:
    """samples/s of data embed and data filter, each called as its command's main in this process (one thread),
    the two data sets interleaved, `args.rounds` rounds after a warm-up embed (imports, first model build)."""
    import torch

    from disco_clip_ds.commands.data import embed_main, filter_main
    from disco_clip_ds.data.shards import expand_shards, shard_sizes
    from disco_clip_ds.testing.bench_record import bench_row

    torch.set_num_threads(1)
    sets = {"demo_64px": NOISY / "train", "laion_256px": laion_like(args.laion_samples)}
    work = OUT / "throughput"
    teacher = ["--teacher", str(TEACHER), "--tokenizer_name", str(TOKENIZER)]
    first = expand_shards(str(NOISY / "train"))[0]
    shutil.rmtree(work, ignore_errors=True)
    embed_main([*teacher, "--shards", first, "--output", str(work / "warmup")])
    rates = {(step, name): [] for name in sets for step in ("embed", "filter")}
    for _ in range(args.rounds):
        for name, folder in sets.items():
            emb, kept = work / name / "emb", work / name / "kept"
            shutil.rmtree(work / name, ignore_errors=True)
            n = sum(shard_sizes(expand_shards(str(folder))).values())
            started = time.perf_counter()
            embed_main([*teacher, "--shards", str(folder), "--output", str(emb)])
            rates[("embed", name)].append(n / (time.perf_counter() - started))
            started = time.perf_counter()
            filter_main(
                ["--shards", str(folder), "--embeddings", str(emb), "--output", str(kept), *FILTERS["filtered"]]
            )
            rates[("filter", name)].append(n / (time.perf_counter() - started))
    rows = []
    for (step, name), values in rates.items():
        n = sum(shard_sizes(expand_shards(str(sets[name]))).values())
        row = bench_row({"step": step, "data": name, "samples": n, "threads": 1}, {"samples_per_s": values}, 2)
        row["hours_for_1e9_samples_one_process"] = round(BILLION / row["samples_per_s_median"] / 3600, 1)
        rows.append(row)
        print(step, name, row["samples_per_s_median"], "samples/s", flush=True)
    return rows


def main() -> None:
    from disco_clip_ds.testing.bench_record import write_rows

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--parts", nargs="+", choices=["quality", "throughput"], default=["quality", "throughput"])
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    parser.add_argument("--laion_samples", type=int, default=3000, help="256 px JPEGs for the throughput")
    parser.add_argument("--out", default=str(HERE / "results" / "filter_quality.csv"), help="the quality rows' CSV")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    if "quality" in args.parts:
        rows = quality(args)
        write_rows(args.out, rows, rounds=1)
    if "throughput" in args.parts:
        write_rows(HERE / "results" / "filter_throughput.csv", throughput(args), rounds=args.rounds)


if __name__ == "__main__":
    main()
