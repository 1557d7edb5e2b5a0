"""Our sigmoid loss against open_clip 3.3.0's SigLipLoss on the same features: values, gradients and per-rank peak
memory, on 1 to 8 gloo ranks (CPU).

Both losses run in open_clip's virtualenv (see vs_open_clip.py; this checkout on PYTHONPATH), each rank on the same
slice of one seeded global batch. open_clip normalises each rank's loss by its local batch, as ours does when the
local batches are equal (N / B = 1 / b), so per-rank values and gradients compare directly. Peak memory: one
forward + backward at local batch 2048, d = 512, fp32, above the inputs, as tests/test_plan.py measures it.

  .venv/bin/python bench/vs_open_clip/siglip_loss.py      # writes results/siglip_loss.csv
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
WORLDS = (1, 2, 4, 8)


def _features(rank: int, world: int, per_rank: int, dim: int, seed: int = 0):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(per_rank * world, dim, generator=g), dim=1)
    y = F.normalize(x + 0.5 * torch.randn(per_rank * world, dim, generator=g), dim=1)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows].clone().requires_grad_(), y[rows].clone().requires_grad_()


def _open_clip_loss(rank: int, world: int):
    from vs_open_clip import _import_open_clip  # works around the registry's CUDA-only torchvision ops

    SigLipLoss = _import_open_clip().loss.SigLipLoss
    try:
        return SigLipLoss(rank=rank, world_size=world, dist_impl="bidir")
    except TypeError:  # releases before dist_impl: bidir=True
        return SigLipLoss(rank=rank, world_size=world, bidir=True)


def _run(loss_fn, x, y):
    import torch

    scale = torch.tensor(10.0, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True)
    loss = loss_fn(x, y, scale, bias)
    loss.backward()
    return loss.item(), x.grad.clone(), y.grad.clone(), scale.grad.item(), bias.grad.item()


def _rank(rank: int, world: int, per_rank: int, dim: int, peak_batch: int) -> dict:
    """On this rank: the largest relative difference of value and gradients, and both losses' peak memory."""
    import torch

    from disco_clip_ds.losses.sigmoid import SigmoidLoss
    from disco_clip_ds.testing.memory import peak_extra_mib

    ours = _run(SigmoidLoss(), *_features(rank, world, per_rank, dim))
    theirs = _run(_open_clip_loss(rank, world), *_features(rank, world, per_rank, dim))
    rel = lambda a, b: (
        (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item() / max(torch.as_tensor(b).abs().max().item(), 1e-30)
    )
    out = {
        name: rel(a, b)
        for name, a, b in zip(("loss", "image_grad", "text_grad", "scale_grad", "bias_grad"), ours, theirs)
    }
    for name, make in (("ours", SigmoidLoss), ("open_clip", lambda: _open_clip_loss(rank, world))):
        x, y = _features(rank, world, peak_batch, 512, seed=1)
        loss_fn = make()
        _run(loss_fn, x[:8].detach().requires_grad_(), y[:8].detach().requires_grad_())  # set-up costs once
        out[f"peak_mib_{name}"] = peak_extra_mib(lambda: _run(loss_fn, x, y))
    return out


def worker(per_rank: int, dim: int, peak_batch: int) -> list[dict]:
    from disco_clip_ds.testing.memory import mmap_threshold_env
    from disco_clip_ds.testing.ranks import run_ranks

    rows = []
    for world in WORLDS:
        per = run_ranks(_rank, world, per_rank, dim, peak_batch, env=mmap_threshold_env(1 << 20), timeout=600)
        row = {"world": world, "local_batch": per_rank, "dim": dim}
        row.update({k: max(r[k] for r in per) for k in per[0] if not k.startswith("peak")})
        row.update(
            {"peak_local_batch": peak_batch, **{k: max(r[k] for r in per) for k in per[0] if k.startswith("peak")}}
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per_rank", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--peak_batch", type=int, default=2048)
    parser.add_argument("--results", default=str(HERE / "results" / "siglip_loss.csv"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # inside open_clip's virtualenv
        print(json.dumps(worker(args.per_rank, args.dim, args.peak_batch)))
        return
    from vs_open_clip import OPENCLIP_VENV, ensure_openclip_venv

    python = ensure_openclip_venv(OPENCLIP_VENV)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [str(python), __file__, "--worker", "--per_rank", str(args.per_rank), "--dim", str(args.dim)]
    out = subprocess.run(
        [*cmd, "--peak_batch", str(args.peak_batch)], env=env, check=True, capture_output=True, text=True
    )
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.results, rows, rounds=1)
    for row in rows:
        print(row)


if __name__ == "__main__":
    sys.exit(main())
