"""CPU time of one loss forward + backward per impl, in one process: compute cost that a loaded machine cannot skew.

Wall-clock timings on a shared CPU move with other jobs; the CPU time the process itself spends (one thread,
time.process_time) does not, much. World 1, so no collectives: rank r's work is the same b x B blocks at any world
size (b = B / N), here with b = B. Impls interleaved per repetition.

    python bench/loss_cpu_time.py --batch 1024 --reps 3     # writes bench/results/loss_cpu_time.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_bench import twoblock_loss

from disco_clip_ds.loss import disco_clip_loss

IMPLS = {
    "disco": lambda x, y, s: disco_clip_loss(x, y, s, impl="disco"),
    "twoblock": twoblock_loss,
    "tiled": lambda x, y, s: disco_clip_loss(x, y, s, keep_bytes=0),  # recomputes the logits in backward
    "tiled_keep": lambda x, y, s: disco_clip_loss(x, y, s, keep_bytes=1 << 40),  # keeps the b x B logits
}


def cpu_seconds(fn, x, y, s) -> float:
    start = time.process_time()
    fn(x, y, s).backward()
    x.grad = y.grad = None
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench/results/loss_cpu_time.csv")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in args.batch:
        x, y = (F.normalize(torch.randn(batch, args.dim), dim=1).requires_grad_() for _ in range(2))
        s = torch.tensor(1 / 0.07)
        for fn in IMPLS.values():  # warm-up
            cpu_seconds(fn, x[:64], y[:64], s)
        times = {name: [] for name in IMPLS}
        for _ in range(args.reps):
            for name, fn in IMPLS.items():
                times[name].append(cpu_seconds(fn, x, y, s))
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, times["twoblock"]))
            rows.append({"impl": name, "batch": batch, "dim": args.dim, "cpu_s": round(statistics.median(t), 3),
                         "vs_twoblock": round(ratio, 3), "vs_disco": round(statistics.median(a / b for a, b in zip(t, times["disco"])), 3)})
            print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
