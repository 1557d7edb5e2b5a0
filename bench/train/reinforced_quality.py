"""Reinforced data on the demo: the tiny student (recipes/models/tiny_student.json) distilled from stored teacher
embeddings of K augmentations, from one teacher and from a two-teacher ensemble, with and without synthetic captions,
against the student alone and a live single teacher, at equal steps.

The teachers are two quickstart models (recipes/models/tiny.json) trained with SEED 0 and SEED 1
(`recipes/quickstart.sh`, into outputs/bench_reinforced/teacher[_noiseP]_sS, kept when already there). Their embeddings
are stored once per demo by `disco-clip data embed --augmentations 8 --caption_keys txt,syn0.txt,syn1.txt
--embedding_dtype float16` (one sidecar folder per teacher set, kept when already there). Every student run is the
quickstart's training (its 2 CPU ranks x 128 pairs, 300 steps, schedule and in-training zero-shot evals at steps 100,
200, 300), one at a time:

- `alone`: the student without a teacher;
- `live_t1`: `--teacher T0`, today's live single teacher (centre crop... of the run's own random crop);
- `stored_t1_k8`: `--teacher T0 --teacher_embeddings E --augmentation_pool`, one teacher, K = 8;
- `stored_t2_k8`: `--teacher T0 T1 --teacher_embeddings E --augmentation_pool`, the two-teacher ensemble, K = 8;
- `stored_t2_k8_syn`: the same with `--synthetic_caption_ratio 0.5` (the demo's syn0/syn1 captions, always true).

All distilled runs at `--distill_weight` (default 1.0, MobileCLIP's). The order is seed-major: every run of seed 0 (on
each demo) before any of seed 1, so a bench cut short still has one seed of every row. A run already finished (its
trainer_state.json holds the last eval) is read, not trained again; a teacher or a sidecar folder is made when a run
first needs it. The runs go in --runs' order. Rows go to results/reinforced_quality.csv after each run, with the
teachers' trained so far (runs `teacher_s0`, `teacher_s1`).

    python bench/train/reinforced_quality.py --seeds 0 1 2 --caption_noise 0 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from distill_quality import zeroshot_rows

from disco_clip_ds.testing.bench_record import write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = REPO / "outputs" / "bench_reinforced"
CSV = HERE / "results" / "reinforced_quality.csv"
STUDENT = "recipes/models/tiny_student.json"
STEPS, K, CAPTION_KEYS = 300, 8, "txt,syn0.txt,syn1.txt"
RUNS = ("alone", "live_t1", "stored_t1_k8", "stored_t2_k8", "stored_t2_k8_syn")
BIN = Path(sys.executable).parent


def noise_tag(noise: str) -> str:
    return "" if float(noise) == 0 else f"_noise{noise}"


def data_dir(noise: str) -> Path:
    return REPO / "data" / f"demo{noise_tag(noise)}"


def teacher(noise: str, seed: int) -> Path:
    """The quickstart's model trained with SEED `seed` on the demo with `noise`, trained here when missing."""
    out = OUT / f"teacher{noise_tag(noise)}_s{seed}"
    if not (out / "model.safetensors").is_file():
        shutil.rmtree(out, ignore_errors=True)
        env = {**os.environ, "OUT": str(out), "SEED": str(seed), "CAPTION_NOISE": noise, "MASTER_PORT": "29591"}
        subprocess.run(["bash", "recipes/quickstart.sh"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return out


def embeddings(noise: str, teachers: list[Path]) -> Path:
    """The teachers' stored embeddings of the demo's training shards: K augmentations, every caption key, float16."""
    out = OUT / f"embeddings{noise_tag(noise)}_t{len(teachers)}_k{K}"
    done = out.with_name(out.name + ".command")  # beside the folder: the store reads every file in it
    if not done.is_file():
        command = [str(BIN / "disco-clip"), "data", "embed", "--teacher", *map(str, teachers)]
        command += ["--shards", str(data_dir(noise) / "train"), "--output", str(out), "--augmentations", str(K)]
        command += ["--caption_keys", CAPTION_KEYS, "--embedding_dtype", "float16"]
        subprocess.run(command, cwd=REPO, env=_env(), check=True, stdout=subprocess.DEVNULL)
        done.write_text(" ".join(command) + "\n")
    return out


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def train(out: Path, noise: str, seed: int, extra: list[str]) -> list[dict]:
    """The quickstart's training of the student (its flags, recipes/quickstart.sh) with `extra` flags; its zero-shot
    rows. A finished run is read as it is."""
    state = out / "trainer_state.json"
    if state.is_file() and any(r["step"] == STEPS for r in zeroshot_rows(out)):
        return zeroshot_rows(out)
    shutil.rmtree(out, ignore_errors=True)
    data = data_dir(noise)
    command = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", "29592", "--module", "disco_clip_ds.train"]
    command += ["--deepspeed", "ds_configs/cpu_zero2.json", "--train_shards", str(data / "train")]
    command += ["--model_config", STUDENT, "--tokenizer_name", "recipes/tokenizer", "--loss_impl", "tiled"]
    command += ["--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "128"]
    command += ["--learning_rate", "1e-3", "--weight_decay", "0.1", "--warmup_steps", "30"]
    command += ["--lr_scheduler_type", "cosine", "--adam_beta2", "0.98", "--adam_epsilon", "1e-6"]
    command += ["--logging_steps", "20", "--save_steps", "100", "--save_total_limit", "2"]
    command += ["--dataloader_num_workers", "1", "--seed", str(seed)]
    command += ["--zeroshot_data", str(data / "eval"), "--zeroshot_steps", "100", *extra]
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        subprocess.run(command, cwd=REPO, env=_env(), check=True, stdout=sink, stderr=subprocess.STDOUT)
    return zeroshot_rows(out)


def run_flags(run: str, noise: str, weight: str) -> list[str]:
    """The training flags of one row (module docstring), building what it needs first."""
    if run == "alone":
        return []
    pair = [teacher(noise, 0), teacher(noise, 1)]
    teachers = pair[:1] if "_t1" in run else pair
    flags = ["--teacher", *map(str, teachers), "--distill_weight", weight]
    if run.startswith("stored"):
        flags += ["--teacher_embeddings", str(embeddings(noise, teachers)), "--augmentation_pool"]
    if run.endswith("_syn"):
        flags += ["--synthetic_caption_ratio", "0.5"]
    return flags


def teacher_rows(noises: list[str]) -> list[dict]:
    """The zero-shot rows of the teachers trained so far."""
    rows = []
    for noise in noises:
        for seed in (0, 1):
            out = OUT / f"teacher{noise_tag(noise)}_s{seed}"
            if (out / "trainer_state.json").is_file():
                got = zeroshot_rows(out)
                rows += [{"run": f"teacher_s{seed}", "caption_noise": noise, "seed": seed, **r} for r in got]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--caption_noise", nargs="+", default=["0", "0.3"])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--distill_weight", default="1.0")
    parser.add_argument("--results", type=Path, default=CSV)
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        for noise in args.caption_noise:
            for run in args.runs:
                flags = run_flags(run, noise, args.distill_weight)
                got = train(OUT / f"{run}{noise_tag(noise)}_s{seed}", noise, seed, flags)
                weight = args.distill_weight if run != "alone" else ""
                rows += [{"run": run, "caption_noise": noise, "seed": seed, "distill_weight": weight, **r} for r in got]
                write_rows(args.results, teacher_rows(args.caption_noise) + rows, rounds=1)
                print(run, noise, seed, json.dumps(got[-1]), flush=True)
    rows = teacher_rows(args.caption_noise) + rows
    for noise in args.caption_noise:
        for run in args.runs:
            key = (run, noise, STEPS)
            final = [r["zeroshot_acc1"] for r in rows if (r["run"], r["caption_noise"], r["step"]) == key]
            if not final:
                continue
            print(f"noise {noise} {run}: acc1 at step {STEPS}, mean of {len(final)} {statistics.mean(final):.4f}")


if __name__ == "__main__":
    main()
