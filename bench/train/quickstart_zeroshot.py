"""The quickstart's in-training zero-shot accuracy for chosen (loss, data format, seed) runs.

Each run is `recipes/quickstart.sh` with LOSS, DATA_FORMAT and SEED set (its default steps, batch and ranks), into
outputs/bench_quickstart/LOSS_FORMAT_sSEED; the zero-shot metrics logged at its evals (steps 100, 200, 300) are read
from its trainer_state.json and merged into results/quickstart_zeroshot.csv, replacing earlier rows of the same run.
Different seeds change the data order, the augmentation and the initial weights: their spread is the noise against
which two data formats are compared.

    python bench/train/quickstart_zeroshot.py softmax:hf:0 softmax:shards:1 softmax:hf:1
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CSV = HERE / "results" / "quickstart_zeroshot.csv"
FIELDS = ["loss", "data_format", "seed", "step", "zeroshot_acc1", "zeroshot_acc5", "zeroshot_mean_per_class_recall"]


def run(loss: str, data_format: str, seed: int, port: int) -> list[dict]:
    """Run the quickstart once (afresh) and return its zero-shot rows."""
    out = REPO / "outputs" / "bench_quickstart" / f"{loss}_{data_format}_s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "LOSS": loss, "DATA_FORMAT": data_format, "SEED": str(seed), "OUT": str(out)}
    env["MASTER_PORT"] = str(port)
    subprocess.run(["bash", str(REPO / "recipes" / "quickstart.sh")], env=env, check=True, cwd=REPO)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [
        {"loss": loss, "data_format": data_format, "seed": seed, "step": entry["step"]}
        | {key: round(entry[key], 4) for key in FIELDS[4:]}
        for entry in history
        if "zeroshot_acc1" in entry
    ]


def merge(rows: list[dict]) -> None:
    """Write `rows` into the CSV, replacing the rows of the same (loss, data format, seed)."""
    runs = {(r["loss"], r["data_format"], str(r["seed"])) for r in rows}
    kept = []
    if CSV.is_file():
        with CSV.open() as f:
            kept = [r for r in csv.DictReader(f) if (r["loss"], r["data_format"], r["seed"]) not in runs]
    merged = sorted(kept + rows, key=_order)
    with CSV.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(merged)


def _order(row: dict) -> tuple:
    return row["loss"] != "softmax", row["data_format"], int(row["seed"]), int(row["step"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="LOSS:FORMAT:SEED, e.g. softmax:hf:0 (loss softmax|sigmoid)")
    parser.add_argument("--master_port", type=int, default=29581)
    args = parser.parse_args(argv)
    for spec in args.runs:
        loss, data_format, seed = spec.split(":")
        merge(run(loss, data_format, int(seed), args.master_port))


if __name__ == "__main__":
    main()
