"""CPU time of one forward + backward of the distillation losses beside the contrastive ones, in one process.

As loss_cpu_time.py: one thread, time.process_time, world 1 (rank r's work at any world size is its b x B blocks,
here with b = B), cases interleaved per repetition, medians. Student and teacher features d = d' = 512. Cases, for
CLIP (softmax) and SigLIP (sigmoid): the contrastive loss alone; the distillation alone (W = 1); the 0.5 / 0.5 mix
as `--distill_weight 0.5` trains it (one pass of the tiles); and the same mix as two losses summed (`two_pass`).

    python bench/loss/distill_cpu_time.py --batch 4096 --reps 3    # writes bench/loss/results/distill_cpu_time.csv
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from disco_clip_ds.losses import disco_clip_loss
from disco_clip_ds.losses.distill import sigmoid_distill_loss, softmax_distill_loss
from disco_clip_ds.losses.sigmoid import sigmoid_loss
from disco_clip_ds.testing.bench_record import write_rows

SCALE, BIAS, T_SCALE, T_BIAS = 20.0, -10.0, 30.0, -12.0


def _clip_distill(x, y, xt, yt, weight=1.0):
    return softmax_distill_loss(x, y, SCALE, xt, yt, T_SCALE, distill_weight=weight)


def _siglip_distill(x, y, xt, yt, weight=1.0):
    return sigmoid_distill_loss(x, y, SCALE, BIAS, xt, yt, T_SCALE, T_BIAS, distill_weight=weight)


CASES = {
    "clip": lambda x, y, xt, yt: disco_clip_loss(x, y, SCALE),
    "clip_distill": _clip_distill,
    "clip_mixed": lambda x, y, xt, yt: _clip_distill(x, y, xt, yt, 0.5),
    "clip_mixed_two_pass": lambda x, y, xt, yt: 0.5 * disco_clip_loss(x, y, SCALE) + 0.5 * _clip_distill(x, y, xt, yt),
    "siglip": lambda x, y, xt, yt: sigmoid_loss(x, y, SCALE, BIAS),
    "siglip_distill": _siglip_distill,
    "siglip_mixed": lambda x, y, xt, yt: _siglip_distill(x, y, xt, yt, 0.5),
    "siglip_mixed_two_pass": lambda x, y, xt, yt: (
        0.5 * sigmoid_loss(x, y, SCALE, BIAS) + 0.5 * _siglip_distill(x, y, xt, yt)
    ),
}


def cpu_seconds(fn, x, y, xt, yt) -> float:
    start = time.process_time()
    fn(x, y, xt, yt).backward()
    x.grad = y.grad = None
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[4096])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="bench/loss/results/distill_cpu_time.csv")
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch:
        x, y, xt, yt = (F.normalize(torch.randn(batch, args.dim, generator=g), dim=1) for _ in range(4))
        x.requires_grad_(), y.requires_grad_()
        for fn in CASES.values():  # warm-up
            cpu_seconds(fn, x[:64], y[:64], xt[:64], yt[:64])
        times = {name: [] for name in CASES}
        for _ in range(args.reps):
            for name, fn in CASES.items():
                times[name].append(cpu_seconds(fn, x, y, xt, yt))
        for name, t in times.items():
            contrastive = times[name.split("_")[0]]  # clip or siglip alone, the same repetitions
            ratio = statistics.median(a / b for a, b in zip(t, contrastive))
            rows.append({"case": name, "batch": batch, "dim": args.dim, "cpu_s": round(statistics.median(t), 3)})
            rows[-1]["vs_contrastive"] = round(ratio, 3)
            print(rows[-1], flush=True)
    write_rows(args.out, rows, rounds=args.reps)


if __name__ == "__main__":
    main()
