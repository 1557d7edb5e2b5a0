"""The quickstart's in-training zero-shot accuracy for chosen (loss, data format, seed[, patch dropout]) runs.

Each run is `recipes/quickstart.sh` with LOSS, DATA_FORMAT, SEED and PATCH_DROPOUT set (its default steps, batch and
ranks), into outputs/bench_quickstart/LOSS_FORMAT_sSEED[_pdP]; the zero-shot metrics logged at its evals (steps 100,
200, 300) are read from its trainer_state.json and merged into results/quickstart_zeroshot.csv, replacing earlier rows
of the same run. Different seeds change the data order, the augmentation and the initial weights: their spread is the
noise against which two data formats (or patch dropout on and off) are compared. Each row names the training input
pipeline that made it (`pipeline`: `pil` for PIL's decode and resize, before data/decode.py; `turbo` for libjpeg-turbo
and torch's uint8 resize), so that a run of the current code keeps the earlier pipeline's rows beside its own.

    python bench/train/quickstart_zeroshot.py softmax:hf:0 softmax:shards:1 softmax:hf:1
    python bench/train/quickstart_zeroshot.py softmax:shards:0:0.5   # patch dropout 0.5
    python bench/train/quickstart_zeroshot.py softmax:shards:0:0.5:250   # ... and every patch from step 250
    python bench/train/quickstart_zeroshot.py siglip2:shards:0 --max_num_patches 256   # SigLIP 2 at another budget
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CSV = HERE / "results" / "quickstart_zeroshot.csv"
FIELDS = ["loss", "data_format", "seed", "patch_dropout", "unmasked_from", "max_num_patches", "pipeline", "step"]
FIELDS += ["zeroshot_acc1", "zeroshot_acc5", "zeroshot_mean_per_class_recall"]
EARLIER_BUDGET = "256"  # the budget of the siglip2 rows written before the column was (the quickstart's default then)


def run(
    loss: str, data_format: str, seed: int, patch_dropout: float, until: int | None, port: int, budget: int
) -> list:
    """Run the quickstart once (afresh) and return its zero-shot rows (`budget`: MAX_NUM_PATCHES of a siglip2 run)."""
    budget = budget if loss == "siglip2" else ""
    name = f"{loss}_{data_format}_s{seed}" + (f"_pd{patch_dropout:g}" if patch_dropout else "")
    name += (f"_until{until}" if until else "") + (f"_p{budget}" if budget else "")
    out = REPO / "outputs" / "bench_quickstart" / name
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "LOSS": loss, "DATA_FORMAT": data_format, "SEED": str(seed), "OUT": str(out)}
    env["PATCH_DROPOUT"] = f"{patch_dropout:g}"
    env["PATCH_DROPOUT_UNTIL_STEP"] = str(until or "")
    env["MASTER_PORT"] = str(port)
    if budget:
        env["MAX_NUM_PATCHES"] = str(budget)
    subprocess.run(["bash", str(REPO / "recipes" / "quickstart.sh")], env=env, check=True, cwd=REPO)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [
        {"loss": loss, "data_format": data_format, "seed": seed, "patch_dropout": patch_dropout}
        | {"unmasked_from": until or "", "max_num_patches": budget, "step": entry["step"]}
        | {"pipeline": pipeline()}
        | {key: round(entry[key], 4) for key in FIELDS[7:]}
        for entry in history
        if "zeroshot_acc1" in entry
    ]


def pipeline() -> str:
    """The training input pipeline of the code in this checkout: `turbo` once data/decode.py exists, else `pil`."""
    return "turbo" if (REPO / "disco_clip_ds" / "data" / "decode.py").is_file() else "pil"


def merge(rows: list[dict]) -> None:
    """Write `rows` into the CSV, replacing the rows of the same (loss, data format, seed, patch dropout)."""
    key = lambda r: (
        r["loss"],
        r["data_format"],
        str(r["seed"]),
        float(r.get("patch_dropout") or 0),
        str(r.get("unmasked_from") or ""),
        str(r.get("max_num_patches") or ""),
        r.get("pipeline") or "pil",
    )
    runs = {key(r) for r in rows}
    kept = []
    if CSV.is_file():
        with CSV.open() as f:
            old = [{"patch_dropout": 0.0, "unmasked_from": "", **r} for r in csv.DictReader(f)]
            for r in old:
                if r["loss"] == "siglip2" and not r.get("max_num_patches"):
                    r["max_num_patches"] = EARLIER_BUDGET
            old = [r for r in old if key(r) not in runs]
            kept = [{**r, "pipeline": r.get("pipeline") or "pil"} for r in old]
    merged = sorted(kept + rows, key=_order)
    write_rows(CSV, merged, rounds=1)


def _order(row: dict) -> tuple:
    return (
        row["loss"] != "softmax",
        row["data_format"],
        float(row["patch_dropout"]),
        str(row["unmasked_from"]),
        int(row.get("max_num_patches") or 0),
        row["pipeline"],
        int(row["seed"]),
        int(row["step"]),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs",
        nargs="+",
        help="LOSS:FORMAT:SEED[:PATCH_DROPOUT[:UNMASKED_FROM_STEP]], e.g. softmax:hf:0 (loss softmax|sigmoid)",
    )
    parser.add_argument("--master_port", type=int, default=29581)
    parser.add_argument(
        "--max_num_patches", type=int, default=16, help="a siglip2 run's budget (the quickstart's default)"
    )
    args = parser.parse_args(argv)
    for spec in args.runs:
        loss, data_format, seed, *masking = spec.split(":")
        patch_dropout = float(masking[0]) if masking else 0.0
        until = int(masking[1]) if len(masking) > 1 else None
        merge(run(loss, data_format, int(seed), patch_dropout, until, args.master_port, args.max_num_patches))


if __name__ == "__main__":
    main()
