"""A 3-source weighted mixture (weights 0.6 / 0.3 / 0.1, `--train_shards 'a::b::c' --train_data_weights`):

- `mixture_fractions.csv`: the realised fraction of each source over the first 10,000 samples of one reader, per seed,
  each sample's source read from the shard it came from, against its weight (goal: within 0.01);
- `mixture_resume.csv`: the scenario of tests/launched/test_mixture_runs.py (tiny CLIP, ZeRO-2, AdamW eps 1e-6,
  2 ranks x K=1 x 4 pairs, stopped at step 3 of 6): the largest absolute weight difference to the uninterrupted run
  of a resume on 2 ranks (goal 0.0), of a resume on 1 rank x K=2 with 2 DataLoader workers (the run's 2 readers),
  and of an uninterrupted 1 rank x K=2 run with 2 workers (the same 2 readers: the same samples per step;
  `update_rel` = |w_a - w_b| / |w_b - w_0| over all weights, `loss_rel` the largest relative difference of a step's
  loss), and whether each ends with the uninterrupted run's per-source sample counts.

    .venv/bin/python bench/data/mixture_bench.py [SEEDS ...]   (default: 0 1 2)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from itertools import islice
from pathlib import Path

import torch

from disco_clip_ds.data.mix import Mixture, MixtureStream
from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, run_to_end
from disco_clip_ds.testing.runs import save_initial_model, step_losses, weights

WEIGHTS = (0.6, 0.3, 0.1)
SAMPLES = 10_000
STEPS, SAVE, PER_RANK = 6, 3, 4
ADAMW = ["--optim", "adamw_torch", "--adam_epsilon", "1e-6", "--learning_rate", "1e-3", "--weight_decay", "0.1"]
K2 = ["--gradient_accumulation_steps", "2", "--contrastive_accumulation", "true", "--dataloader_num_workers", "2"]
RESULTS = Path(__file__).parent / "results"


def _sources(root: Path) -> list[list[str]]:
    return [write_shards(root / name, n, 12, seed=s) for name, n, s in (("a", 4, 1), ("b", 2, 2), ("c", 2, 3))]


def fractions(root: Path, seeds: list[int]) -> list[dict]:
    sources = _sources(root)
    mixture = Mixture(tuple(map(tuple, sources)), ("a", "b", "c"), WEIGHTS)
    rows = []
    for seed in seeds:
        stream = MixtureStream(mixture, 16, seed=seed, shuffle_buffer=8, sample_ids=True)
        names = [Path(item[2][0]).parent.name for item in islice(stream, SAMPLES)]
        for name, weight in zip("abc", WEIGHTS):
            realised = names.count(name) / SAMPLES
            rows.append(
                {
                    "seed": seed,
                    "source": name,
                    "samples": SAMPLES,
                    "weight": weight,
                    "realised_fraction": round(realised, 4),
                    "abs_difference": round(abs(realised - weight), 4),
                    "within_0.01": abs(realised - weight) <= 0.01,
                }
            )
            print(rows[-1], flush=True)
    return rows


def _run(root: Path, name: str, nproc: int, *extra: str, resume_of: Path | None = None) -> Path:
    out = root / name
    if resume_of is not None:  # the uninterrupted run as it stood at step SAVE
        out.mkdir()
        shutil.copytree(resume_of / f"checkpoint-{SAVE}", out / f"checkpoint-{SAVE}")
        shutil.copy(resume_of / "run.json", out / "run.json")
        extra = ("--resume_from_checkpoint", "latest", *extra)
    args = ["--output_dir", str(out), "--model_name_or_path", str(root / "tiny"), "--train_shards"]
    args += ["::".join(str(root / n) for n in "abc"), "--train_data_weights", *map(str, WEIGHTS), *LAUNCH_COMMON]
    args += ["--per_device_train_batch_size", str(PER_RANK), "--save_steps", str(SAVE), "--max_steps", str(STEPS)]
    args += [*ADAMW, "--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"), *extra]
    rc, log = run_to_end(out, args, launcher="torchrun", nproc=nproc)
    assert rc == 0, log[-3000:]
    return out


def _per_source(output: Path) -> list:
    import json

    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return [[h[f"samples_seen_source{s}"] for s in range(3)] for h in history if "loss" in h]


def resumes(root: Path) -> list[dict]:
    _sources(root)
    w0 = weights(save_initial_model(root / "tiny", 9))
    full = _run(root, "full", 2)
    rows = []
    for case, out in (
        ("uninterrupted 1 rank x K=2, 2 DataLoader workers", _run(root, "k2", 1, *K2)),
        ("stopped at step 3, resumed on 2 ranks", _run(root, "resumed", 2, resume_of=full)),
        ("stopped at step 3, resumed on 1 rank x K=2", _run(root, "one", 1, *K2, resume_of=full)),
    ):
        wa, wb = weights(out), weights(full)
        update = torch.cat([(wb[k] - w0[k]).reshape(-1) for k in w0])
        gap = torch.cat([(wa[k] - wb[k]).reshape(-1) for k in w0])
        la, lb = step_losses(out), step_losses(full)
        rows.append(
            {
                "case": case,
                "max_abs_weight_difference": f"{gap.abs().max().item():.3e}",
                "update_rel": f"{(gap.norm() / update.norm()).item():.2e}",
                "loss_rel": f"{max(abs(x - y) / abs(y) for x, y in zip(la, lb)):.2e}",
                "same_samples_per_source": _per_source(out) == _per_source(full),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main(seeds: list[int]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        write_rows(RESULTS / "mixture_fractions.csv", fractions(Path(scratch) / "fractions", seeds), rounds=1)
        write_rows(RESULTS / "mixture_resume.csv", resumes(Path(scratch) / "resume"), rounds=1)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [0, 1, 2])
