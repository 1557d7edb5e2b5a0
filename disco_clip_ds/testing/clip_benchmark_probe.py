"""CLIP_benchmark 1.6.2's own linear probe, run on given features in a separate process: what the probe's reference
test and its bench share.

clip-benchmark is not a dependency of the project: its wheel is fetched with `pip download --no-deps` (the package
index pip is configured with) and unpacked with `pip install --no-deps --target DIR`; a subprocess of this Python
with `PYTHONPATH=DIR` imports `clip_benchmark.metrics.linear_probe`. Its imports (torch, numpy, sklearn, tqdm) are
all installed here, so nothing is stubbed.

The subprocess follows CLIP_benchmark's CLI for `--task linear_probe` from the point where features exist:
`torch.manual_seed(seed)`, `torch.utils.data.random_split` of the train split for `--val_proportion`, then
`linear_probe.evaluate`, which reads the features from its own cache folder (`features_{train,val,test}.pt` and
`targets_*.pt` under `feature_root/model_id`; the driver writes them there, normalised by CLIP_benchmark's
`Featurizer` with an identity model). Patched in the subprocess only:

- `evaluate` asserts `device == "cuda"` and calls `.cuda()`: `.cuda()` of modules and tensors returns them as they
  are, and its `train` / `infer` are called with device "cpu" (float32, as CLIP_benchmark on CUDA with `--no_amp`);
  with `cuda=True` (a GPU machine) these stay as written and it runs with its default float16 autocast;
- its `accuracy` calls `float()` on a 1-element array, which numpy 2 refuses: the module's `float` takes the element.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

VERSION = "1.6.2"

DRIVER = r"""
import builtins, json, os, sys, time
import numpy as np
import torch
from clip_benchmark.metrics import linear_probe as lp
from clip_benchmark.metrics import zeroshot_classification as zs

CUDA = sys.argv[4] == "cuda"
if not CUDA:
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    _train, _infer = lp.train, lp.infer
    lp.train = lambda *args: _train(*args[:7], "cpu", *args[8:])  # (loader, in, out, wd, lr, epochs, amp, device, seed)
    lp.infer = lambda *args: _infer(*args[:3], "cpu")  # (model, loader, amp, device)
zs.float = lambda x: builtins.float(np.asarray(x).reshape(-1)[0]) if np.ndim(x) else builtins.float(x)


class Identity(torch.nn.Module):
    def encode_image(self, x):
        return x


def run(job, root):
    torch.manual_seed(job["seed"])  # as CLIP_benchmark's CLI, before its split
    featurize = lp.Featurizer(Identity(), normalize=True)
    splits = {"train": (job["train_x"], job["train_y"]), "test": (job["test_x"], job["test_y"])}
    if job.get("val_x") is not None:  # a validation split of its own (CLIP_benchmark's --val_split)
        splits["val"] = (job["val_x"], job["val_y"])
    elif job["val_proportion"] is not None:
        p = job["val_proportion"]
        train, val = torch.utils.data.random_split(range(len(job["train_y"])), [1 - p, p])
        x, y = splits["train"]
        splits["train"] = (x[train.indices], y[train.indices])
        splits["val"] = (x[val.indices], y[val.indices])
    folder = os.path.join(root, job["model_id"])
    os.makedirs(folder)
    for name, (x, y) in splits.items():
        with torch.no_grad():
            torch.save(featurize(x), os.path.join(folder, f"features_{name}.pt"))
        torch.save(y, os.path.join(folder, f"targets_{name}.pt"))
    start = time.perf_counter()
    metrics = lp.evaluate(
        None, None, None, job["fewshot_k"], job["batch_size"], 0, job["lr"], job["epochs"], job["model_id"],
        job["seed"], root, "cuda", val_dataloader=[] if "val" in splits else None, normalize=True, amp=CUDA,
    )
    seconds = time.perf_counter() - start
    return None if metrics is None else {**metrics, "seconds": seconds}


jobs = torch.load(sys.argv[1])
results = [run(job, sys.argv[3]) for job in jobs]
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def structured_features(seed: int, n: int, n_classes: int = 8, dim: int = 24, noise: float = 1.6):
    """(features, labels): fixed class centres plus Gaussian noise, uneven class sizes; a probe on them is right
    often but not always, so its numbers tell settings apart."""
    centres = torch.randn(n_classes, dim, generator=torch.Generator().manual_seed(100))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.multinomial(torch.linspace(1, 2, n_classes), n, replacement=True, generator=gen)
    return centres[labels] + noise * torch.randn(n, dim, generator=gen), labels


def install(cache: Path) -> Path:
    """A folder holding clip_benchmark 1.6.2 (and nothing else), made once under `cache`."""
    target = Path(cache) / f"clip_benchmark-{VERSION}"
    if (target / "clip_benchmark" / "metrics" / "linear_probe.py").exists():
        return target
    wheels = Path(cache) / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "download", f"clip-benchmark=={VERSION}", "--no-deps", "-d", str(wheels)], check=True)
    wheel = next(wheels.glob(f"clip_benchmark-{VERSION}-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True)
    return target


def run_clip_benchmark(target: Path, jobs: list[dict], workdir: Path, cuda: bool = False) -> list[dict | None]:
    """CLIP_benchmark's linear-probe metrics for each job (its `evaluate`'s dict plus `seconds`, the time of that
    call; None where it declined, e.g. too few samples for fewshot_k). A job holds train_x/train_y/test_x/test_y
    (raw features and labels), seed, fewshot_k, val_proportion (or None), batch_size, epochs, lr, and optionally
    val_x/val_y (a validation split of its own).

    cuda: run it on the GPU as it is written (nothing patched but `float`), with its default float16 autocast."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = [{**job, "model_id": f"job{i}"} for i, job in enumerate(jobs)]
    torch.save(jobs, workdir / "jobs.pt")
    (workdir / "driver.py").write_text(DRIVER)
    feature_root = workdir / "features"
    feature_root.mkdir(exist_ok=True)
    for old in feature_root.iterdir():  # a rerun in the same folder: CLIP_benchmark would reuse a stale cache
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = workdir / "results.json"
    device = "cuda" if cuda else "cpu"
    argv = [sys.executable, str(workdir / "driver.py"), str(workdir / "jobs.pt"), str(out), str(feature_root), device]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"CLIP_benchmark's linear probe failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())
