"""What launched tests share to check a run's zero-shot eval: demo-like eval shards (class names, templates), and the
final `disco-clip eval` of a run folder and of its export against the run's last in-training zero-shot eval."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from disco_clip_ds.data.prep.demo import DIGITS
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

TEMPLATES = "a photo of the number {c}.\na handwritten {c}.\n"  # the quickstart's kind of prompt


def write_eval_shards(folder: Path, n: int = 20, seed: int = 5) -> Path:
    """`n` labelled noise images as CLIP_benchmark's zero-shot layout: shards, classnames.txt, templates."""
    rng = np.random.default_rng(seed)
    samples = [{"png": noise_image_bytes(rng, size=40 + 8 * (i % 3)), "cls": str(i % 10)} for i in range(n)]
    write_samples(folder, samples, per_shard=10)
    (folder / "classnames.txt").write_text("\n".join(DIGITS) + "\n")
    (folder / "zeroshot_classification_templates.txt").write_text(TEMPLATES)
    return folder


def last_zeroshot(run_dir: Path) -> dict:
    """The run's last in-training zero-shot metrics (trainer_state.json), without their `zeroshot_` prefix."""
    history = json.loads((Path(run_dir) / "trainer_state.json").read_text())["log_history"]
    last = [entry for entry in history if "zeroshot_acc1" in entry][-1]
    return {key.removeprefix("zeroshot_"): value for key, value in last.items() if key.startswith("zeroshot_")}


def assert_final_eval_is_the_last_zeroshot(run_dir: Path, data: Path, export_dir: Path) -> dict:
    """`disco-clip eval` of the run folder and of `disco-clip export`'s folder (written to `export_dir`) give the
    run's last in-training zero-shot metrics; returns them."""
    import pytest

    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.export.weights import export_checkpoint

    during = last_zeroshot(run_dir)
    export_checkpoint(run_dir, export_dir)
    for folder in (run_dir, export_dir):
        metrics = run_eval(EvalArguments(model=str(folder), data=str(data)))["metrics"]
        assert metrics == pytest.approx(during, abs=1e-6), folder
    return during
