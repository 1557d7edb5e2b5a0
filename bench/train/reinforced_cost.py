"""Reinforced data's step cost: the student's training step without distillation, with stored teacher embeddings and
with live teachers (one teacher and a two-teacher ensemble), interleaved in one process group.

Two cases, each random weights and random in-memory batches (neither changes the cost), fp32, 1 thread per rank:

- `demo`: the quickstart's shapes: the student `recipes/models/tiny_student.json` (1 layer, width 32), each teacher
  the quickstart's `recipes/models/tiny.json` (2 layers, width 64), 2 CPU ranks x 128 pairs;
- `vit_b`: a ViT-B/32 student (`recipes/models/vit_b32.json`), each teacher ViT-B/16-shaped (the same config with
  16 px patches: 196 patches where the student has 49), 1 CPU rank x 8 pairs.

The sides, in turn (reversed every other round) for --rounds rounds after a warm-up round, the same DDP + AdamW step
for all of them:

- `alone`: the student's forward and backward of its global-batch contrastive loss;
- `stored`: the distilled loss as `DiscoTrainer` computes it from `--teacher_embeddings` (the teachers' embeddings
  of the batch are at hand, as the collator delivers them; reading them is the input pipeline's, left out here like
  decoding), (1 - W) contrastive + W distillation, W = 1.0 as MobileCLIP trains;
- `live`: the same loss with the teachers run on the batch under no_grad first (`--teacher A [B]`).

Each distilled side at T = 1 and T = 2 teachers. Per round: each side's step time (the slower rank's) and its ratio to
the `alone` step of the same round. The goal a stored step is held to: at most 1.05 x `alone`.

    python bench/train/reinforced_cost.py --case demo --rounds 61    # writes results/reinforced_cost_demo.csv
    python bench/train/reinforced_cost.py --case vit_b --rounds 5
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.images import random_clip_batch
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import run_ranks

HERE = Path(__file__).resolve().parent
CASES = {  # student config, teacher config, its patch size override, ranks, pairs per rank
    "demo": ("recipes/models/tiny_student.json", "recipes/models/tiny.json", None, 2, 128),
    "vit_b": ("recipes/models/vit_b32.json", "recipes/models/vit_b32.json", 16, 1, 8),
}


def sides(teachers: int) -> list[str]:
    return ["alone"] + [f"{kind}_t{t}" for t in range(1, teachers + 1) for kind in ("stored", "live")]


def _teacher_model(config_path: str, patch: int | None, seed: int):
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.models.configs import load_config

    config = load_config(model_config=str(REPO / config_path))
    if patch is not None:
        config.vision_config.patch_size = patch
    return build_model(model_config=str(REPO / config_path), config=config, seed=seed)


def _rank(rank: int, world: int, case: str, teachers: int, weight: float, rounds: int) -> dict:
    """{side: [step seconds per round]} on this rank."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.accumulation import logit_params
    from disco_clip_ds.train.distill import Ensemble, Teacher

    student_path, teacher_path, patch, _, per_rank = CASES[case]
    torch.manual_seed(0)
    student = build_model(model_config=str(REPO / student_path))
    models = [Teacher(_teacher_model(teacher_path, patch, 1 + t), weight) for t in range(teachers)]
    ddp = torch.nn.parallel.DistributedDataParallel(student)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    batch = random_clip_batch(student.config, per_rank, seed=rank)
    live = [models[0]] + ([Ensemble(models)] if teachers > 1 else [])  # as `--teacher A [B]` runs them
    # what the sidecars hold for this batch, in the form StoredTeacher hands the loss (a list per teacher argument)
    stored = [models[0].embed(batch)] + ([ensemble_targets([m.embed(batch) for m in models])] if teachers > 1 else [])

    def step(side: str) -> None:
        if side == "alone":
            ddp(**batch, return_loss=True).loss.backward()
            return
        kind, t = side.split("_t")
        teacher = live[int(t) - 1]
        if kind == "stored":  # StoredTeacher's loss is Teacher's, on the stored lists
            loss_fn = models[0].loss_fn(*stored[int(t) - 1])
        else:
            loss_fn = teacher.loss_fn(*teacher.embed(batch))
        out = ddp(**batch, return_loss=False, return_logits=False)
        loss_fn(out.image_embeds, out.text_embeds, *logit_params(student, out)).backward()

    times = {side: [] for side in sides(teachers)}
    for round_ in range(rounds + 1):  # round 0 warms up
        for side in sides(teachers) if round_ % 2 else sides(teachers)[::-1]:
            torch.distributed.barrier()
            start = time.perf_counter()
            step(side)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_:
                times[side].append(time.perf_counter() - start)
    torch.distributed.barrier()
    return times


def ensemble_targets(embeds: list[tuple]) -> tuple:
    """Several teachers' `Teacher.embed` outputs as `StoredTeacher.embed` gives them: a list per argument, one entry
    per teacher (losses/distill.py's ensemble form)."""
    images, texts, params = zip(*embeds)
    return list(images), list(texts), tuple(list(p) for p in zip(*params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="demo")
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds after one warm-up round")
    parser.add_argument("--teachers", type=int, choices=[1, 2], default=2, help="measure T = 1 .. this many")
    parser.add_argument("--distill_weight", type=float, default=1.0)
    parser.add_argument("--results", type=Path, help="default: results/reinforced_cost_CASE.csv")
    args = parser.parse_args()
    args.results = args.results or HERE / "results" / f"reinforced_cost_{args.case}.csv"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    student, teacher, patch, ranks, per_rank = CASES[args.case]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    torch.set_num_threads(1)
    per_rank_times = run_ranks(
        _rank, ranks, args.case, args.teachers, args.distill_weight, args.rounds, timeout=3600, threads=1, env=env
    )
    # a step ends when its slowest rank does
    names = sides(args.teachers)
    times = {side: [max(r[side][i] for r in per_rank_times) for i in range(args.rounds)] for side in names}
    settings = {
        "case": args.case,
        "student": student,
        "teacher": teacher + (f" (patch {patch})" if patch else ""),
        "ranks": ranks,
        "per_rank": per_rank,
        "threads": 1,
    }
    rows = []
    for side in names:
        kind, _, t = side.partition("_t")
        rows.append(
            bench_row(
                {
                    **settings,
                    "run": kind,
                    "teachers": t or 0,
                    "distill_weight": args.distill_weight if t else "",
                },
                {"step_s": times[side], "step_vs_alone": ratios(times[side], times["alone"])},
            )
        )
    write_rows(args.results, rows)
    for row in rows:
        shown = ("case", "run", "teachers", "step_s_median", "step_vs_alone_min", "step_vs_alone_median")
        print({k: row[k] for k in (*shown, "step_vs_alone_max")})


if __name__ == "__main__":
    main()
