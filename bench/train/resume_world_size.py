"""How far a run resumed on another world size ends from the uninterrupted run, per ZeRO stage: the
scenario of tests/launched/test_resume_on_another_world_size.py (tiny CLIP, AdamW eps 1e-6, 2 ranks x K=1 x 4
pairs, stopped at step 3 of 6), resumed on 1 rank x K=2 with 2 DataLoader workers, with deepspeed's universal load
as it is ("deepspeed alone": `universal.repair_zero3_universal_load` turned off in the ranks) and as training runs it,
and on 4 ranks x 2 pairs (each pair of ranks sharing one of the run's readers);
and the noise floor: an uninterrupted 1 rank x K=2 run against the 2-rank one. `update_rel` is |w_a - w_b| /
|w_b - w_0| over all weights, `loss_rel` the largest relative difference of a step's loss. Writes
bench/train/results/resume_world_size.csv.

    .venv/bin/python bench/train/resume_world_size.py [STAGE ...]   (default: 2 3)
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from disco_clip_ds.testing import launch
from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, run_to_end
from disco_clip_ds.testing.runs import save_initial_model, step_losses, weights

STEPS, SAVE, PER_RANK = 6, 3, 4
ADAMW = ["--adam_epsilon", "1e-6", "--optim", "adamw_torch", "--learning_rate", "1e-3", "--lr_scheduler_type"]
ADAMW += ["linear", "--warmup_steps", "2", "--weight_decay", "0.1"]
NO_REPAIR = "DISCO_BENCH_NO_REPAIR"  # set in the ranks of a "deepspeed alone" run
K2 = ["--gradient_accumulation_steps", "2", "--contrastive_accumulation", "true", "--dataloader_num_workers", "2"]
OUT = Path(__file__).parent / "results" / "resume_world_size.csv"


def _run(
    root: Path, name: str, stage: int, nproc: int, *extra: str, resume_of: Path | None = None, alone=False
) -> Path:
    out = root / f"zero{stage}" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    if resume_of is not None:  # the uninterrupted run as it stood at step SAVE
        out.mkdir()
        shutil.copytree(resume_of / f"checkpoint-{SAVE}", out / f"checkpoint-{SAVE}")
        shutil.copy(resume_of / "run.json", out / "run.json")
        extra = ("--resume_from_checkpoint", "latest", *extra)
    args = ["--output_dir", str(out), "--model_name_or_path", str(root / "tiny"), "--train_shards"]
    args += [f"{root}/shards/{{00000..00003}}.tar", *LAUNCH_COMMON, "--train_num_samples", "96"]
    args += ["--per_device_train_batch_size", str(PER_RANK), "--save_steps", str(SAVE), "--max_steps", str(STEPS)]
    args += [*ADAMW, "--deepspeed", str(REPO / f"ds_configs/cpu_zero{stage}.json"), *extra]
    env = {NO_REPAIR: "1", "PYTHONPATH": f"{REPO}:{Path(__file__).parent}"} if alone else {}
    launch.MODULE = Path(__file__).stem if alone else "disco_clip_ds.train"  # the ranks run this file
    try:
        rc, log = run_to_end(out, args, launcher="torchrun", nproc=nproc, **env)
    finally:
        launch.MODULE = "disco_clip_ds.train"
    assert rc == 0, log[-3000:]
    return out


def _differences(a: Path, b: Path, w0: dict) -> tuple[float, float]:
    wa, wb = weights(a), weights(b)
    update = torch.cat([(wb[k] - w0[k]).reshape(-1) for k in w0])
    gap = torch.cat([(wa[k] - wb[k]).reshape(-1) for k in w0])
    la, lb = step_losses(a), step_losses(b)
    return (gap.norm() / update.norm()).item(), max(abs(x - y) / abs(y) for x, y in zip(la, lb))


def main(stages: list[int]) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        write_shards(root / "shards", num_shards=4, per_shard=24, seed=1)
        w0 = weights(save_initial_model(root / "tiny", 7))
        for stage in stages:
            full = _run(root, "full", stage, 2)
            runs = {
                "uninterrupted 1 rank x K=2 (noise floor)": _run(root, "one", stage, 1, *K2),
                "resumed on 1 rank x K=2, deepspeed alone": _run(
                    root, "alone", stage, 1, *K2, resume_of=full, alone=True
                ),
                "resumed on 1 rank x K=2": _run(root, "resumed", stage, 1, *K2, resume_of=full),
                "resumed on 4 ranks x 2 pairs": _run(
                    root,
                    "four",
                    stage,
                    4,
                    "--per_device_train_batch_size",
                    str(PER_RANK // 2),
                    resume_of=full,  # the last one counts
                ),
            }
            for case, out in runs.items():
                update_rel, loss_rel = _differences(out, full, w0)
                rows.append(
                    {"stage": stage, "case": case, "update_rel": f"{update_rel:.2e}", "loss_rel": f"{loss_rel:.2e}"}
                )
                print(rows[-1], flush=True)
    OUT.parent.mkdir(exist_ok=True)
    write_rows(OUT, rows, rounds=1)


def _rank_without_repair() -> None:
    """A rank of a "deepspeed alone" run: `disco_clip_ds.train` with the repair turned off."""
    from disco_clip_ds.train import trainer

    trainer.repair_zero3_universal_load = lambda optimizer, checkpoint: None
    runpy.run_module("disco_clip_ds.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if os.environ.get(NO_REPAIR):
        _rank_without_repair()
    else:
        main([int(s) for s in sys.argv[1:]] or [2, 3])
