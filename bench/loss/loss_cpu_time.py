"""CPU time of one loss forward + backward per impl, in one process: compute cost that a loaded machine cannot skew.

Wall-clock timings on a shared CPU move with other jobs; the CPU time the process itself spends (one thread,
time.process_time) does not, much. World 1, so no collectives: rank r's work is the same b x B blocks at any world
size (b = B / N), here with b = B. Impls interleaved per repetition.

    python bench/loss/loss_cpu_time.py --batch 1024 --reps 3     # writes bench/loss/results/loss_cpu_time.csv

--ref REV adds the tiled loss as the package had it at git revision REV (rows "tiled@REV", "tiled_keep@REV"),
interleaved with the rest: a before/after measurement of a change to the loss, in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from disco_clip_ds.losses import disco_clip_loss
from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows

from loss_bench import twoblock_loss

IMPLS = {
    "disco": lambda x, y, s: disco_clip_loss(x, y, s, impl="disco"),
    "twoblock": twoblock_loss,
    "tiled": lambda x, y, s: disco_clip_loss(x, y, s, keep_bytes=0),  # recomputes the logits in backward
    "tiled_keep": lambda x, y, s: disco_clip_loss(x, y, s, keep_bytes=1 << 40),  # keeps the b x B logits
}


def loss_at(rev: str):
    """The package's CLIP loss as it was at git revision `rev`, imported as a package of its own beside today's."""
    root = Path(__file__).resolve().parents[2]
    tree = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", rev, "disco_clip_ds"], cwd=root, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    package = tree / "disco_clip_ds"
    spec = importlib.util.spec_from_file_location(
        "disco_clip_ds_at_rev", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # the loss lived in one module, loss.py, before it became the losses/ package
    name = "losses" if (package / "losses").is_dir() else "loss"
    return importlib.import_module(f"{spec.name}.{name}")


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
    p.add_argument("--out", default="bench/loss/results/loss_cpu_time.csv")
    p.add_argument("--ref", help="also time the tiled loss of this git revision (e.g. main), interleaved")
    args = p.parse_args()
    torch.set_num_threads(1)
    impls = dict(IMPLS)
    if args.ref:
        old = loss_at(args.ref)
        impls[f"tiled@{args.ref}"] = lambda x, y, s: old.disco_clip_loss(x, y, s, keep_bytes=0)
        impls[f"tiled_keep@{args.ref}"] = lambda x, y, s: old.disco_clip_loss(x, y, s, keep_bytes=1 << 40)
    rows = []
    for batch in args.batch:
        x, y = (F.normalize(torch.randn(batch, args.dim), dim=1).requires_grad_() for _ in range(2))
        s = torch.tensor(1 / 0.07)
        for fn in impls.values():  # warm-up
            cpu_seconds(fn, x[:64], y[:64], s)
        times = {name: [] for name in impls}
        for _ in range(args.reps):
            for name, fn in impls.items():
                times[name].append(cpu_seconds(fn, x, y, s))
        for name, t in times.items():
            samples = {"cpu_s": t, "vs_twoblock": ratios(t, times["twoblock"]), "vs_disco": ratios(t, times["disco"])}
            if args.ref and f"{name}@{args.ref}" in times:  # this impl against itself at --ref
                samples["vs_ref"] = ratios(t, times[f"{name}@{args.ref}"])
            rows.append(bench_row({"impl": name, "batch": batch, "dim": args.dim}, samples, digits=3))
            print({k: v for k, v in rows[-1].items() if not k.endswith(("_min", "_max"))}, flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
