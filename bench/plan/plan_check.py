"""The planner's estimate against measured CPU peak memory of whole training steps (world size 1, fp32, AdamW).

    python bench/plan_check.py      # ~3 min on 2 cores; prints a markdown table

Each point runs bench/measure_memory.py --mode train in a fresh process; the estimate is memory_plan() with
stage 0, fp32, the model's own (naive) loss, no framework overhead. tests/test_plan.py asserts the
no-checkpointing points (tiny and small, two batch sizes each) within 25 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from disco_clip_ds import plan as P  # noqa: E402

POINTS = [
    ("tiny", 256, False),
    ("tiny", 1024, False),
    ("small", 32, False),
    ("small", 128, False),
    ("tiny", 1024, True),
    ("small", 128, True),
]


def main() -> None:
    fit = P.load_fit()
    print("| model | batch | act. ckpt | measured MiB | estimate MiB | error |\n| --- | --- | --- | --- | --- | --- |")
    for name, batch, ckpt in POINTS:
        path = ROOT / f"recipes/models/{name}.json"
        cmd = [
            sys.executable,
            str(ROOT / "bench/measure_memory.py"),
            "--model",
            str(path),
            "--batch",
            str(batch),
            "--mode",
            "train",
        ]
        out = subprocess.run(
            cmd + (["--activation_checkpointing"] if ckpt else []), check=True, capture_output=True, text=True
        ).stdout
        measured = json.loads(out.strip().splitlines()[-1])["delta_mib"]
        settings = P.validate_config({"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0}}, 1)
        shape = P.ModelShape.from_json(path)
        estimate = P.memory_plan(shape, settings, fit, "naive", ckpt, float("inf"), 0.0).total / 2**20
        print(
            f"| {name} | {batch} | {'on' if ckpt else 'off'} | {measured:.0f} | {estimate:.0f} | "
            f"{estimate / measured - 1:+.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
