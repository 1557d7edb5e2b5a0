"""Per-rank peak memory of one forward + backward of the distillation loss (disco_clip_ds.losses.distill), beside the
tiled contrastive loss alone and open_clip 3.3.0's DistillClipLoss, on gloo ranks (CPU), fp32.

Everything runs in open_clip's virtualenv (bench/vs_open_clip/vs_open_clip.py makes it on first use; OPENCLIP_VENV
to put it elsewhere), this checkout on PYTHONPATH, each rank on its slice of one seeded global batch of student and
teacher features (d = d' = 512). Cases per rank, each measured as the peak resident memory above the inputs
(disco_clip_ds.testing.memory, as bench/loss/loss_bench.py):
- tiled: our contrastive CLIP loss alone (the reference of the issue's 1.3x bound);
- distill: our softmax distillation loss alone;
- mixed: 0.5 contrastive + 0.5 distillation, as `--distill_weight 0.5` trains (one pass of the tiles);
- mixed_two_pass: the same as two losses summed, each with its own gather and tiles (both graphs alive);
- open_clip: DistillClipLoss (its contrastive and distillation terms, summed) as open_clip_train builds it by default
  (every rank builds the B x B logits of student and teacher);
- open_clip_local: the same with --local-loss --gather-with-grad (b x B logits per rank).
Each rank gets a data-segment limit (80 % of the memory available, shared by the ranks): a case that needs more is
recorded as OOM, as loss_bench.py does.

  .venv/bin/python bench/loss/distill_memory.py --points 4x4096 4x32768   # writes results/distill_memory.csv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES = ("tiled", "distill", "mixed", "mixed_two_pass", "open_clip", "open_clip_local")


def _features(rank: int, world: int, batch: int, dim: int = 512, seed: int = 0):
    """This rank's rows of the seeded global batch: student image and text, teacher image and text."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    per = batch // world
    rows = slice(rank * per, (rank + 1) * per)
    out = []
    for _ in range(2):  # student, then teacher: paired image and text features
        x = F.normalize(torch.randn(batch, dim, generator=g), dim=1)
        y = F.normalize(x + 0.5 * torch.randn(batch, dim, generator=g), dim=1)
        out += [x[rows].clone(), y[rows].clone()]
    return out


def _loss(case: str, rank: int, world: int):
    """loss(x, y, scale, xt, yt, teacher_scale) for one case."""
    from disco_clip_ds.losses import disco_clip_loss
    from disco_clip_ds.losses.distill import softmax_distill_loss

    if case == "tiled":
        return lambda x, y, s, xt, yt, ts: disco_clip_loss(x, y, s)
    if case == "distill":
        return softmax_distill_loss
    if case == "mixed":
        return lambda x, y, s, xt, yt, ts: softmax_distill_loss(x, y, s, xt, yt, ts, distill_weight=0.5)
    if case == "mixed_two_pass":
        return lambda x, y, s, xt, yt, ts: (
            0.5 * disco_clip_loss(x, y, s) + 0.5 * softmax_distill_loss(x, y, s, xt, yt, ts)
        )
    sys.path.insert(0, str(REPO / "bench" / "vs_open_clip"))
    from vs_open_clip import _import_open_clip  # works around the registry's CUDA-only torchvision ops

    local = case == "open_clip_local"
    loss = _import_open_clip().loss.DistillClipLoss(
        local_loss=local, gather_with_grad=local, rank=rank, world_size=world
    )
    return lambda x, y, s, xt, yt, ts: sum(loss(x, y, s, xt, yt, ts))


def _rank(rank: int, world: int, batch: int, limit_gib: float) -> dict:
    import resource

    import torch

    from disco_clip_ds.testing.memory import peak_extra_mib, rss_mib

    limit = int((rss_mib("VmData") / 1024 + limit_gib) * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    out = {}
    for case in CASES:
        x, y, xt, yt = _features(rank, world, batch)
        loss_fn = _loss(case, rank, world)

        def step(n=None):
            xi, yi = x[:n].clone().requires_grad_(), y[:n].clone().requires_grad_()
            scale = torch.tensor(20.0, requires_grad=True)
            loss_fn(xi, yi, scale, xt[:n], yt[:n], torch.tensor(30.0)).backward()

        step(8)  # thread pools and gloo buffers are set up once per process
        try:
            out[case] = round(peak_extra_mib(step), 1)
        except (MemoryError, RuntimeError) as error:  # every rank fails at its own logits, before any collective
            out[case] = (
                f"OOM ({type(error).__name__})"
                if "memory" in str(error).lower() or isinstance(error, MemoryError)
                else f"error: {str(error).splitlines()[0][:120]}"
            )
    return out


def worker(points: list[tuple[int, int]]) -> list[dict]:
    from disco_clip_ds.testing.memory import mmap_threshold_env
    from disco_clip_ds.testing.ranks import run_ranks

    rows = []
    for world, batch in points:
        with open("/proc/meminfo") as f:
            avail_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        limit_gib = 0.8 * avail_kib / 2**20 / world
        per = run_ranks(_rank, world, batch, limit_gib, env=mmap_threshold_env(1 << 20), timeout=3000)
        for case in CASES:
            values = [r[case] for r in per]
            numbers = [v for v in values if isinstance(v, float)]
            peak = max(numbers) if len(numbers) == len(values) else next(v for v in values if isinstance(v, str))
            rows.append(
                {
                    "world": world,
                    "batch": batch,
                    "dim": 512,
                    "case": case,
                    "peak_extra_mib_max_rank": peak,
                    "limit_gib_per_rank": round(limit_gib, 2),
                }
            )
        tiled = next(r["peak_extra_mib_max_rank"] for r in rows[-len(CASES) :] if r["case"] == "tiled")
        for row in rows[-len(CASES) :]:
            value = row["peak_extra_mib_max_rank"]
            row["vs_tiled"] = round(value / tiled, 3) if isinstance(value, float) else ""
        print(json.dumps(rows[-len(CASES) :]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="+", default=["4x4096", "4x32768"], help="WORLDxGLOBAL_BATCH")
    parser.add_argument("--results", default=str(HERE / "results" / "distill_memory.csv"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    points = [tuple(int(v) for v in p.lower().split("x")) for p in args.points]
    if args.worker:  # inside open_clip's virtualenv
        print(json.dumps(worker(points)))
        return
    sys.path.insert(0, str(REPO / "bench" / "vs_open_clip"))
    from vs_open_clip import OPENCLIP_VENV, ensure_openclip_venv

    python = ensure_openclip_venv(OPENCLIP_VENV)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [str(python), __file__, "--worker", "--points", *args.points],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.results, rows, rounds=1)
    for row in rows:
        print(row)


if __name__ == "__main__":
    sys.exit(main())
