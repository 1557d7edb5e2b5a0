"""Distillation's cost on the demo: the student's training step with and without a live teacher, interleaved.

Both sides are `recipes/quickstart.sh` with the student `recipes/models/tiny_student.json` (1 layer, width 32), STEPS
steps, one with TEACHER= (the quickstart's tiny CLIP, 2 layers, width 64, trained for a few steps into
outputs/bench_distill_cost/teacher when not there: its weights do not change the cost) and one without, run in
turn (alone, distilled, distilled, alone, ...) for --rounds rounds. Per run: the median of the logged `step_time_s`
(the quickstart logs every 20 steps; the first window, start-up included, is left out). Per round: the distilled
run's step time over the alone run's of the same round.

    python bench/train/distill_cost.py --rounds 3 --steps 60     # writes results/distill_cost.csv
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path

from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.ranks import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "outputs" / "bench_distill_cost"
STUDENT = "recipes/models/tiny_student.json"


def quickstart(out: Path, steps: int, **env: str) -> list[dict]:
    """Run the quickstart afresh into OUT; its trainer_state.json log history."""
    shutil.rmtree(out, ignore_errors=True)
    full = {**os.environ, "OUT": str(out), "MASTER_PORT": str(free_port()), "STEPS": str(steps), **env}
    subprocess.run(["bash", "recipes/quickstart.sh"], cwd=REPO, env=full, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def step_time(history: list[dict]) -> float:
    """The median logged step time, the first logging window (start-up) left out."""
    times = [h["step_time_s"] for h in history if "step_time_s" in h][1:]
    if not times:
        raise SystemExit("fewer than 2 logging windows: give --steps of at least 40 (the quickstart logs every 20)")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="steps per run (the quickstart logs every 20)")
    parser.add_argument("--distill_weight", default="0.5")
    parser.add_argument("--results", type=Path, default=HERE / "results" / "distill_cost.csv")
    args = parser.parse_args()
    teacher = OUT / "teacher"
    if not (teacher / "model.safetensors").is_file():
        quickstart(teacher, 20, SEED="0")
    sides = {"alone": {}, "distilled": {"TEACHER": str(teacher), "DISTILL_WEIGHT": args.distill_weight}}
    times = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
            times[name].append(step_time(quickstart(OUT / name, args.steps, SEED="0", MODEL=STUDENT, **sides[name])))
            print(round_, name, times[name][-1], flush=True)
    settings = {"student": STUDENT, "teacher": "recipes/models/tiny.json", "ranks": 2, "per_rank": 128}
    rows = [
        bench_row(
            {**settings, "run": name, "distill_weight": args.distill_weight if name == "distilled" else ""},
            {"step_s": times[name], "step_vs_alone": ratios(times[name], times["alone"])},
            digits=4,
        )
        for name in sides
    ]
    write_rows(args.results, rows)
    print(rows[-1])


if __name__ == "__main__":
    main()
