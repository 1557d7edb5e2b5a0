"""The linear probe (disco_clip_ds/eval/probe.py) against CLIP_benchmark 1.6.2's own, on the same features.

Features: with --model and --data, the model's image embeddings of a linear-probe set in CLIP_benchmark's wds layout
(`train/*.tar` and `test/*.tar` with `cls` and an image; the demo's `digits_probe`); without them, structured
synthetic features (class centres plus noise). Each setting (full data and few-shot k = 1, 5, 10; the weight decay
chosen on a --val_proportion split) runs on both sides: ours in this process, CLIP_benchmark's `evaluate` in a
subprocess with clip_benchmark alone added to its path (disco_clip_ds/testing/clip_benchmark_probe.py says how it is
installed and what is patched there). Rounds interleave the sides (ours, theirs, ours, ...); a side's time
is the wall time of its probe call (theirs: `evaluate`, its reads of its feature cache included; not the process
start or imports), one thread each.

    python bench/eval/probe_vs_clip_benchmark.py --model outputs/bench_probe/export \
        --data data/demo/suite/digits_probe --rounds 3   # writes bench/eval/results/probe_vs_clip_benchmark.csv
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from disco_clip_ds.eval.probe import BATCH_SIZE, EPOCHS, LR, linear_probe
from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.clip_benchmark_probe import install, run_clip_benchmark, structured_features

RESULTS = Path(__file__).parent / "results" / "probe_vs_clip_benchmark.csv"
FEWSHOT_KS = (-1, 1, 5, 10)
METRICS = {
    "acc1": "lp_acc1",
    "acc5": "lp_acc5",
    "mean_per_class_recall": "lp_mean_per_class_recall",
    "weight_decay": "weight_decay",
}


def model_features(model_dir: str, data: str) -> tuple[dict, str]:
    """The model's L2-normalised image embeddings and labels of the set's train and test splits."""
    from disco_clip_ds.commands.eval import load_for_eval
    from disco_clip_ds.eval.encode import EvalMode, encode_images
    from disco_clip_ds.eval.sources import shard_batches

    model, _, image_processor = load_for_eval(model_dir)
    splits = {}
    with EvalMode(model):
        for split in ("train", "test"):
            shards = sorted(str(p) for p in (Path(data) / split).glob("*.tar"))
            features, labels = [], []
            for pixels, classes in shard_batches(shards, image_processor, "cls", batch_size=128):
                features.append(encode_images(model, pixels))
                labels += classes
            splits[split] = (torch.cat(features), torch.tensor(labels))
    return splits, f"image embeddings of {Path(model_dir)} on {Path(data).name}"


def synthetic_features() -> tuple[dict, str]:
    return {"train": structured_features(1, 1440, n_classes=10), "test": structured_features(2, 360, n_classes=10)}, (
        "synthetic: 10 class centres + noise, d=24"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an exported model folder (with --data); none: synthetic features")
    parser.add_argument("--data", help="a linear-probe set in CLIP_benchmark's wds layout (train/, test/)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--val_proportion", type=float, default=0.2)
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "disco_clip_bench_clip_benchmark"),
        help="where clip_benchmark's wheel is fetched and unpacked (kept for the next run)",
    )
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if bool(args.model) != bool(args.data):
        parser.error("--model and --data go together (neither: synthetic features)")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the CLIP_benchmark subprocess too
    splits, described = model_features(args.model, args.data) if args.model else synthetic_features()
    (train_x, train_y), (test_x, test_y) = splits["train"], splits["test"]
    settings = [{"fewshot_k": k, "val_proportion": args.val_proportion, "seed": 0} for k in FEWSHOT_KS]
    jobs = [
        {
            "train_x": train_x,
            "train_y": train_y,
            "test_x": test_x,
            "test_y": test_y,
            "batch_size": BATCH_SIZE,
            "epochs": EPOCHS,
            "lr": LR,
            **s,
        }
        for s in settings
    ]
    target = install(Path(args.cache))
    ours_runs, theirs_runs = [], []
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            ours_runs.append([_timed_ours(train_x, train_y, test_x, test_y, s) for s in settings])
            theirs_runs.append(run_clip_benchmark(target, jobs, Path(work) / f"round{r}"))
    rows = [
        _row(s, [o[i] for o in ours_runs], [t[i] for t in theirs_runs], described, splits)
        for i, s in enumerate(settings)
    ]
    path = write_rows(args.output, rows)
    for row in rows:
        print({k: row[k] for k in ("fewshot_k", "ours_acc1", "theirs_acc1", "equal", "ours_s_median")})
    print(f"wrote {path}")


def _timed_ours(train_x, train_y, test_x, test_y, setting: dict) -> dict:
    start = time.perf_counter()
    result = linear_probe(train_x, train_y, test_x, test_y, **setting)
    return {**result, "seconds": time.perf_counter() - start}


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _row(setting: dict, ours: list[dict], theirs: list[dict], described: str, splits: dict) -> dict:
    first_ours, first_theirs = ours[0], theirs[0]
    for run in ours[1:] + theirs[1:]:  # deterministic: every round gives the first round's numbers
        reference = first_ours if "n_train" in run else first_theirs
        assert all(_same(run[k], reference[k]) for k in run if k != "seconds"), (run, reference)
    row = {
        "features": described,
        "n_train": len(splits["train"][1]),
        "n_test": len(splits["test"][1]),
        "dim": splits["train"][0].shape[1],
        **setting,
        "n_fit": first_ours["n_train"],
    }
    for ours_key, theirs_key in METRICS.items():
        row[f"ours_{ours_key}"] = first_ours[ours_key]
        row[f"theirs_{ours_key}"] = first_theirs[theirs_key]
    row["equal"] = all(_same(first_ours[k], first_theirs[t]) for k, t in METRICS.items())
    ours_s, theirs_s = [o["seconds"] for o in ours], [t["seconds"] for t in theirs]
    samples = {"ours_s": ours_s, "theirs_s": theirs_s, "ours_over_theirs": ratios(ours_s, theirs_s)}
    return {**row, **bench_row({}, samples)}


if __name__ == "__main__":
    main()
