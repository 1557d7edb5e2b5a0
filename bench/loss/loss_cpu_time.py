"""CPU time of one loss forward + backward per impl, in one process: compute cost that a loaded machine cannot skew.

Wall-clock timings on a shared CPU move with other jobs; the CPU time the process itself spends (one thread,
time.process_time) does not, much. World 1, so no collectives: rank r's work is the same b x B blocks at any world
size (b = B / N), here with b = B. Impls interleaved per repetition.

    python bench/loss/loss_cpu_time.py --batch 1024 --reps 3     # writes bench/loss/results/loss_cpu_time.csv

--ref REV adds the tiled loss as the package had it at git revision REV (rows "tiled@REV", "tiled_keep@REV"),
interleaved with the rest: a before/after measurement of a change to the loss, in one run. --impls picks the impls
(e.g. only tiled and tiled_keep against --ref). --memory also records each call's peak resident memory above its
start (the script restarts itself with glibc returning every block of 1 MiB or more to the system, so that resident
memory follows what torch holds; see disco_clip_ds/testing/memory.py).

    python bench/loss/loss_cpu_time.py --batch 4096 8192 --reps 3 --impls tiled tiled_keep --ref 9b87829 --memory
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from disco_clip_ds.losses import disco_clip_loss
from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.memory import MMAP_THRESHOLD, mmap_threshold_env, peak_extra_mib

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


def measured(fn, x, y, s, memory: bool) -> tuple[float, float | None]:
    """(CPU seconds, peak MiB above the start or None) of one forward + backward."""
    if not memory:
        return cpu_seconds(fn, x, y, s), None
    seconds = []
    peak = peak_extra_mib(lambda: seconds.append(cpu_seconds(fn, x, y, s)))
    return seconds[0], peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    p.add_argument("--memory", action="store_true", help="also record each call's peak resident memory (MiB)")
    p.add_argument("--out", default="bench/loss/results/loss_cpu_time.csv")
    p.add_argument("--ref", help="also time the tiled loss of this git revision (e.g. main), interleaved")
    args = p.parse_args()
    if args.memory and MMAP_THRESHOLD not in os.environ:  # glibc reads it at start: restart with it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **mmap_threshold_env()})
    torch.set_num_threads(1)
    impls = {name: IMPLS[name] for name in args.impls}
    if args.ref:
        old = loss_at(args.ref)
        ref_impls = {
            "tiled": lambda x, y, s: old.disco_clip_loss(x, y, s, keep_bytes=0),
            "tiled_keep": lambda x, y, s: old.disco_clip_loss(x, y, s, keep_bytes=1 << 40),
        }
        impls.update({f"{name}@{args.ref}": fn for name, fn in ref_impls.items() if name in impls})
    rows = []
    for batch in args.batch:
        x, y = (F.normalize(torch.randn(batch, args.dim), dim=1).requires_grad_() for _ in range(2))
        s = torch.tensor(1 / 0.07)
        for fn in impls.values():  # warm-up
            cpu_seconds(fn, x[:64], y[:64], s)
        times, peaks = {name: [] for name in impls}, {name: [] for name in impls}
        for _ in range(args.reps):
            for name, fn in impls.items():
                seconds, peak = measured(fn, x, y, s, args.memory)
                times[name].append(seconds)
                peaks[name].append(peak)
        for name, t in times.items():
            samples = {"cpu_s": t}
            samples.update({f"vs_{base}": ratios(t, times[base]) for base in ("twoblock", "disco") if base in times})
            if args.memory:
                samples["peak_mib"] = peaks[name]
            if args.ref and f"{name}@{args.ref}" in times:  # this impl against itself at --ref
                samples["vs_ref"] = ratios(t, times[f"{name}@{args.ref}"])
                if args.memory:
                    samples["peak_vs_ref"] = ratios(peaks[name], peaks[f"{name}@{args.ref}"])
            rows.append(bench_row({"impl": name, "batch": batch, "dim": args.dim}, samples, digits=3))
            print({k: v for k, v in rows[-1].items() if not k.endswith(("_min", "_max"))}, flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
