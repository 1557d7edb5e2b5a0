"""Distillation on the demo: the quickstart's trained tiny CLIP (2 layers, width 64) taught to a smaller student
(recipes/models/tiny_student.json: 1 layer, width 32), against the same student trained without it, at equal steps.

Each run is `recipes/quickstart.sh` (its steps, batch, ranks, schedule and in-training zero-shot evals at steps 100,
200, 300): first the teacher (the default model, SEED 0, into outputs/bench_distill/teacher, kept when already
there), then per seed the student with TEACHER= (DISTILL_WEIGHT, default 0.5) and without. The zero-shot metrics at
each eval are read from the runs' trainer_state.json (the teacher's too, as run "teacher") into
results/distill_quality.csv, and the mean over seeds of the final top-1 accuracy is printed.

    python bench/train/distill_quality.py --seeds 0 1 2     # DATA=... to use a demo built elsewhere
    python bench/train/distill_quality.py --caption_noise 0.3 --distill_weight 0.8

`--caption_noise P` runs all of it (the teacher too) on the demo with a fraction P of its training captions naming
another digit (`disco-clip data demo --caption_noise`, the quickstart's CAPTION_NOISE=P; data/demo_noiseP).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "outputs" / "bench_distill"
CSV = HERE / "results" / "distill_quality.csv"
STUDENT = "recipes/models/tiny_student.json"
FIELDS = [
    "run",
    "caption_noise",
    "seed",
    "distill_weight",
    "distill_temperature",
    "step",
    "zeroshot_acc1",
    "zeroshot_acc5",
    "train_runtime_s",
]


def quickstart(out: Path, port: int, fresh: bool = True, **env: str) -> list[dict]:
    """Run the quickstart into OUT with `env` set; its zero-shot rows."""
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    full = {**os.environ, "OUT": str(out), "MASTER_PORT": str(port), **env}
    subprocess.run(["bash", "recipes/quickstart.sh"], cwd=REPO, env=full, check=True, stdout=subprocess.DEVNULL)
    return zeroshot_rows(out)


def zeroshot_rows(out: Path) -> list[dict]:
    """A finished run's zero-shot evals, from its trainer_state.json."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    runtime = next((h["train_runtime"] for h in history if "train_runtime" in h), None)
    return [
        {
            "step": h["step"],
            "zeroshot_acc1": h["zeroshot_acc1"],
            "zeroshot_acc5": h["zeroshot_acc5"],
            "train_runtime_s": runtime,
        }
        for h in history
        if "zeroshot_acc1" in h
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--distill_weight", default="0.5")
    parser.add_argument("--distill_temperature", default="", help="the default: the teacher's own logit scale")
    parser.add_argument("--runs", nargs="+", choices=["distilled", "alone"], default=["distilled", "alone"])
    parser.add_argument("--caption_noise", default="0", help="the demo's fraction of mislabelled training captions")
    parser.add_argument("--results", type=Path, help="default: results/distill_quality.csv (_noiseP with noise)")
    args = parser.parse_args()
    noise = "" if float(args.caption_noise) == 0 else f"_noise{args.caption_noise}"
    args.results = args.results or CSV.with_name(f"{CSV.stem}{noise}.csv")
    os.environ["CAPTION_NOISE"] = args.caption_noise  # the quickstart builds and reads data/demo_noiseP
    teacher = OUT / f"teacher{noise}"
    if not (teacher / "model.safetensors").is_file():
        quickstart(teacher, 29571, SEED="0")
    rows = [{"run": "teacher", "caption_noise": args.caption_noise, "seed": 0, **r} for r in zeroshot_rows(teacher)]
    for seed in args.seeds:
        distilled = {"TEACHER": str(teacher), "DISTILL_WEIGHT": args.distill_weight}
        distilled |= {"DISTILL_TEMPERATURE": args.distill_temperature} if args.distill_temperature else {}
        runs = {"distilled": distilled, "alone": {}}
        for name, extra in ((name, runs[name]) for name in args.runs):
            tag = f"_w{args.distill_weight}_t{args.distill_temperature}" if name == "distilled" else ""
            got = quickstart(OUT / f"{name}{tag}{noise}_s{seed}", 29572 + seed, SEED=str(seed), MODEL=STUDENT, **extra)
            weight, temperature = (args.distill_weight, args.distill_temperature) if name == "distilled" else ("", "")
            rows += [
                {
                    "run": name,
                    "caption_noise": args.caption_noise,
                    "seed": seed,
                    "distill_weight": weight,
                    "distill_temperature": temperature,
                    **row,
                }
                for row in got
            ]
            print(name, seed, got[-1])
    args.results.parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.results, rows, rounds=1)
    last = max(r["step"] for r in rows)
    for name in args.runs:
        final = [r["zeroshot_acc1"] for r in rows if r["run"] == name and r["step"] == last]
        print(f"{name}: zero-shot acc1 at step {last}, mean of {len(final)} seeds {statistics.mean(final):.4f} {final}")


if __name__ == "__main__":
    main()
