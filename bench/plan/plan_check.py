"""The planner's estimates against measured CPU peak memory: whole training steps, and the loss alone.

    python bench/plan/plan_check.py          # whole steps, a few minutes: results/plan_check.csv and a table
    python bench/plan/plan_check.py --loss   # the loss term against the loss benchmark's CSVs (seconds)

Whole steps (world size 1, fp32, AdamW): each point runs disco_clip_ds.testing.step_memory --mode train in a fresh
process; the estimate is memory_plan() with stage 0, fp32, the model's own (local) loss, no framework overhead;
with a teacher, the step first runs the frozen teacher's no-grad forward (`step_memory --teacher`).
tests/test_plan.py asserts the no-checkpointing points (tiny and small, two batch sizes each) within 25 %.

--loss: `loss_bytes()` against each measured per-rank peak in LOSS_CSVS (written by bench/loss/loss_bench.py),
batches >= 4096 (below that the process's fixed costs, thread pools and gloo buffers, dominate), CPU rows of the
impls the planner models; exits 1 when one is off by 25 % or more. tests/test_plan.py measures the same at one
small batch itself.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from disco_clip_ds import plan as P
from disco_clip_ds.testing.bench_record import write_rows

ROOT = Path(__file__).resolve().parents[2]
# (model, batch, activation checkpointing, distillation teacher): the teacher points check its terms, once with its
# forward under the student's activations (small) and once above them (ViT-B/32)
POINTS = [
    ("tiny", 256, False, None),
    ("tiny", 1024, False, None),
    ("small", 32, False, None),
    ("small", 128, False, None),
    ("tiny", 1024, True, None),
    ("small", 128, True, None),
    ("tiny", 256, False, "small"),
    ("tiny", 128, False, "vit_b32"),
]
LOSS_CSVS = [
    ROOT / "bench/plan/results/plan_loss_check_cpu.csv",
    ROOT / "bench/plan/results/plan_loss_check_one_block_cpu.csv",
    ROOT / "bench/loss/results/loss_bench_cpu.csv",
    ROOT / "bench/loss/results/loss_bench_cpu_one_block.csv",
    ROOT / "bench/loss/results/loss_bench_cpu_one_block_w4.csv",
]
TOLERANCE = 0.25


def check_steps(out: Path) -> None:
    """Measure each of POINTS, print it beside the estimate, and write the table to `out` (after every point)."""
    fit = P.load_fit()
    print(
        "| model | batch | act. ckpt | teacher | measured MiB | estimate MiB | error |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    rows = []
    for name, batch, ckpt, teacher in POINTS:
        path = ROOT / f"recipes/models/{name}.json"
        cmd = [
            sys.executable,
            "-m",
            "disco_clip_ds.testing.step_memory",
            "--model",
            str(path),
            "--batch",
            str(batch),
            "--mode",
            "train",
        ]
        cmd += ["--activation_checkpointing"] if ckpt else []
        cmd += ["--teacher", str(ROOT / f"recipes/models/{teacher}.json")] if teacher else []
        stdout = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        measured = json.loads(stdout.strip().splitlines()[-1])["delta_mib"]
        settings = P.validate_config({"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0}}, 1)
        shape = P.ModelShape.from_json(path)
        taught = P.ModelShape.from_json(ROOT / f"recipes/models/{teacher}.json") if teacher else None
        estimate = P.memory_plan(shape, settings, fit, "local", ckpt, float("inf"), 0.0, teacher=taught).total / 2**20
        print(
            f"| {name} | {batch} | {'on' if ckpt else 'off'} | {teacher or '-'} | {measured:.0f} | {estimate:.0f} | "
            f"{estimate / measured - 1:+.0%} |",
            flush=True,
        )
        rows.append(
            {
                "model": name,
                "batch": batch,
                "act_ckpt": ckpt,
                "teacher": teacher or "",
                "measured_mib": round(measured, 1),
                "estimate_mib": round(estimate, 1),
                "error": round(estimate / measured - 1, 3),
            }
        )
        write_rows(out, rows, rounds=1)


def check_loss() -> int:
    """Print each measured loss peak beside the planner's; return how many are off by TOLERANCE or more."""
    print("| file | impl | world | batch | dtype | measured MiB | estimate MiB | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    off = 0
    for path in LOSS_CSVS:
        for r in csv.DictReader(path.open()):
            if r["status"] != "ok" or int(r["batch"]) < 4096 or r.get("device", "cpu") != "cpu":
                continue
            elem = {"fp32": 4, "bf16": 2}[r["dtype"]]
            try:
                estimate = P.loss_bytes(r["impl"], int(r["batch"]), int(r["world"]), int(r["dim"]), elem) / 2**20
            except P.PlanConfigError:  # a benchmark baseline the planner does not model
                continue
            measured = float(r["peak_extra_mib"])
            error = estimate / measured - 1
            off += abs(error) >= TOLERANCE
            print(
                f"| {path.relative_to(ROOT)} | {r['impl']} | {r['world']} | {r['batch']} | {r['dtype']} | "
                f"{measured:.0f} | {estimate:.0f} | {error:+.1%} |"
            )
    return off


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", action="store_true", help="check the loss term against the loss benchmark's CSVs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_check.csv")
    args = parser.parse_args(argv)
    if args.loss:
        off = check_loss()
        print(f"{off} point(s) off by {TOLERANCE:.0%} or more")
        return 1 if off else 0
    check_steps(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
