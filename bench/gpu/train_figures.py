"""The throughput figures a `disco-clip train` run logged (docs/training.md, "Throughput and MFU"): one CSV row per
training log of trainer_state.json (samples/s, samples/s per device, TFLOPs per device, MFU) and one for the whole
run from train_results.json; printed too.

    python bench/gpu/train_figures.py RUN_DIR --out bench/gpu/results/gpu/train.csv
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows

FIELDS = ["step", "samples_per_s", "samples_per_s_per_rank", "tflops_per_device", "mfu", "step_time_s"]


def rows(run: Path) -> list[dict]:
    """The logged figures of RUN's training logs, then the run's own (step "run")."""
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    found = [{k: entry.get(k, "") for k in FIELDS} for entry in history if "loss" in entry]
    results = json.loads((run / "train_results.json").read_text())
    whole = {k: results.get(f"train_{k}", "") for k in FIELDS}
    return [*found, {**whole, "step": "run", "samples_per_s": results.get("train_samples_per_second", "")}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="the run's --output_dir")
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    args = p.parse_args(argv)
    missing = [n for n in ("trainer_state.json", "train_results.json") if not (args.run / n).is_file()]
    if missing:
        p.error(f"{args.run}: no {' or '.join(missing)}: give the --output_dir of a finished `disco-clip train` run")
    found = rows(args.run)
    # each figure is what the run logged (one measurement per logging window), not a spread over rounds
    write_rows(args.out, found, rounds=1)
    for row in found:
        print(",".join(str(row[k]) for k in FIELDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
