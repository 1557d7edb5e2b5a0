"""The EMA of the weights on the demo: zero-shot top-1 of the EMA against the weights themselves, at the quickstart's
in-training evals (steps 100, 200, 300), per seed; and the EMA's memory per rank, measured against the planner's.

Each run is `recipes/quickstart.sh` with EMA_DECAY (its `--ema_decay D --eval_ema true`): 2 CPU ranks x 128 pairs,
ZeRO-2, fp32, the quickstart's schedule; its in-training eval evaluates the weights (`zeroshot_acc1`) and, swapped in
for the eval, the EMA (`zeroshot_ema_acc1`) on the same held-out digits at the same step: a paired comparison, read
from the run's trainer_state.json into results/ema_quality.csv. The memory: the bytes of the EMA each rank holds (the
tensors of its file in the last checkpoint, checkpoint/ema.py's layout) beside `disco-clip plan --ema`'s term for
the same configuration, into results/ema_memory.csv.

    python bench/train/ema_quality.py --seeds 0 1 2 --decay 0.99
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
from disco_clip_ds.testing.ranks import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "outputs" / "bench_ema"
MODEL = "recipes/models/tiny.json"


def quickstart(out: Path, seed: int, decay: str) -> None:
    """The quickstart with the EMA into OUT, unless OUT already holds its finished run (a bench cut short goes on)."""
    if (out / "eval" / "zeroshot_both.json").is_file():  # the quickstart's last file
        return
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OUT": str(out), "SEED": str(seed), "EMA_DECAY": decay, "MASTER_PORT": str(free_port())}
    subprocess.run(["bash", "recipes/quickstart.sh"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)


def eval_rows(out: Path) -> list[dict]:
    """The run's in-training evals: the weights' and the EMA's figures at each eval step."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    keys = ("acc1", "acc5", "ema_acc1", "ema_acc5")
    return [{"step": h["step"], **{k: h[f"zeroshot_{k}"] for k in keys}} for h in history if "zeroshot_ema_acc1" in h]


def memory_row(out: Path) -> dict:
    """Bytes of EMA per rank in the run's last checkpoint, and the planner's term for the quickstart's set-up."""
    from safetensors import safe_open

    from disco_clip_ds.checkpoint.ema import ema_files
    from disco_clip_ds.checkpoint.layout import newest_complete
    from disco_clip_ds.plan.report import plan

    held = []
    for path in ema_files(newest_complete(out)):
        with safe_open(str(path), framework="pt") as saved:
            held.append(sum(saved.get_slice(name).get_shape()[0] * 4 for name in saved.keys()))  # 1-D fp32
    planned = plan(REPO / "ds_configs/cpu_zero2.json", REPO / MODEL, 2, "40GB", 128, "fp32", ema=True)
    return {
        "model": MODEL,
        "ranks": len(held),
        "zero_stage": 2,
        "ema_bytes_per_rank_planned": int(planned["memory"]["tiled"]["terms"]["ema"]),
        "ema_bytes_per_rank_held": ";".join(str(b) for b in held),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--decay", default="0.99")
    args = parser.parse_args()
    rows, memory = [], None
    for seed in args.seeds:
        out = OUT / f"d{args.decay}_s{seed}"
        quickstart(out, seed, args.decay)
        got = eval_rows(out)
        rows += [{"seed": seed, "ema_decay": args.decay, "ema_warmup": True, **r} for r in got]
        memory = memory or memory_row(out)
        print(seed, got)
    write_rows(HERE / "results" / "ema_quality.csv", rows, rounds=1)
    write_rows(HERE / "results" / "ema_memory.csv", [memory], rounds=1)
    for step in sorted({r["step"] for r in rows}):
        at = [r for r in rows if r["step"] == step]
        weights, ema = (statistics.mean(r[k] for r in at) for k in ("acc1", "ema_acc1"))
        print(f"step {step}: acc1 weights {weights:.4f}, EMA {ema:.4f} (mean of {len(at)} seeds)")
    print(memory)


if __name__ == "__main__":
    main()
