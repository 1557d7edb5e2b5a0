"""Count the host syncs of a training run: every call that reads a tensor's value on the host (`Tensor.item`,
`tolist`, `nonzero`, `cpu`, `numpy`, and `bool()`, `float()`, `int()` of a tensor), per optimizer step, by whose
code made it.

    python -m disco_clip_ds.testing.syncs OUT.json TRAIN_ARGS...    (under a launcher, as disco_clip_ds.train)

runs `disco-clip train TRAIN_ARGS` with counting wrappers on torch.Tensor and writes, at exit, this rank's counts to
OUT.json (".rank{R}" put before the suffix): a list with one entry per optimizer step, from the start of its batches'
fetch to the start of the next one, each {"ours": n, "losses": n, "library": n, "sites": {"who file:line name": n}}.
A call is charged to the first frame outside torch: "losses" in disco_clip_ds/losses/, "ours" elsewhere in
disco_clip_ds, "library" in the Trainer, accelerate or DeepSpeed (a library's sync on our behalf, e.g. inside
torch.distributed's object collectives, is charged to our call).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

METHODS = ("item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__float__", "__int__")
PACKAGE = Path(__file__).resolve().parents[1]
TORCH = Path(torch.__file__).resolve().parent
HERE = Path(__file__).resolve()


class SyncCounter:
    """Counting wrappers on torch.Tensor (`install`), and the counts per optimizer step (`new_step` starts one)."""

    def __init__(self):
        self.steps: list[dict] = []
        self._inside = False  # a wrapper's own tensor calls are not counted

    def who(self, frame) -> tuple[str, str]:
        while frame is not None and _owner(frame.f_code.co_filename) == "torch":
            frame = frame.f_back
        if frame is None:
            return "library", "?"
        return _owner(frame.f_code.co_filename), f"{frame.f_code.co_filename}:{frame.f_lineno}"

    def count(self, name: str) -> None:
        if self._inside or not self.steps:
            return
        self._inside = True
        try:
            who, site = self.who(sys._getframe(2))
            step = self.steps[-1]
            step[who] += 1
            step["sites"][f"{who} {site} {name}"] += 1
        finally:
            self._inside = False

    def new_step(self) -> None:
        self.steps.append({"ours": 0, "losses": 0, "library": 0, "sites": Counter()})

    def install(self) -> None:
        for name in METHODS:
            setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        torch.nonzero = self._wrap(torch.nonzero, "torch.nonzero")

    def _wrap(self, original, name: str):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.count(name)
            return original(*args, **kwargs)

        return counted

    def write(self, path: Path) -> None:
        path.write_text(json.dumps([{**s, "sites": dict(s["sites"])} for s in self.steps], indent=1))


@functools.lru_cache(maxsize=None)
def _owner(filename: str) -> str:
    path = Path(filename).resolve()
    if path == HERE or path.is_relative_to(TORCH):
        return "torch"
    if path.is_relative_to(PACKAGE / "losses"):
        return "losses"
    return "ours" if path.is_relative_to(PACKAGE) else "library"


def main(argv: list[str]) -> int:
    from transformers import Trainer

    from disco_clip_ds.cli import main as cli_main

    out, train_args = Path(argv[0]), argv[1:]
    counter = SyncCounter()
    fetch = Trainer.get_batch_samples

    def get_batch_samples(self, *args, **kwargs):  # the Trainer's fetch of an update: a new optimizer step starts
        counter.new_step()
        return fetch(self, *args, **kwargs)

    Trainer.get_batch_samples = get_batch_samples
    rank = os.environ.get("RANK", "0")
    atexit.register(counter.write, out.with_suffix(f".rank{rank}{out.suffix}"))
    counter.install()
    return cli_main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
