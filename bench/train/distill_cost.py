"""Distillation's cost: the student's training step with and without a live teacher, interleaved in one process group.

The demo's pair: the student `recipes/models/tiny_student.json` (1 layer, width 32), the teacher the quickstart's
`recipes/models/tiny.json` (2 layers, width 64); the quickstart's 2 CPU ranks x 128 pairs, 1 thread per rank, fp32,
random in-memory batches (the teacher's weights and the data do not change the cost). Both sides run in one process
group, in turn (alone, distilled, distilled, alone, ...) for --rounds rounds after a warm-up round, the same DDP +
AdamW step for both:

- alone: the student's forward and backward of its global-batch contrastive loss;
- distilled: as `DiscoTrainer` computes a distilled loss (`train/trainer.py`, `train/distill.py`): the student's
  embeddings, the teacher's without grad (`Teacher.embed`), and the backward of `Teacher.loss_fn`'s
  (1 - W) contrastive + W distillation.

Per round: each side's step time (the slower rank's) and the distilled step's ratio to the alone step of the same
round. The launcher's start-up, the data pipeline and the evals are left out: they are the same for both sides.

    python bench/train/distill_cost.py --rounds 31     # writes results/distill_cost.csv
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
STUDENT, TEACHER = "recipes/models/tiny_student.json", "recipes/models/tiny.json"
SIDES = ("alone", "distilled")


def _rank(rank: int, world: int, per_rank: int, weight: float, rounds: int) -> dict:
    """{side: [step seconds per round]} on this rank."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.accumulation import logit_params
    from disco_clip_ds.train.distill import Teacher

    torch.manual_seed(0)
    student = build_model(model_config=str(REPO / STUDENT))
    teacher = Teacher(build_model(model_config=str(REPO / TEACHER)), weight)
    ddp = torch.nn.parallel.DistributedDataParallel(student)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    batch = random_clip_batch(student.config, per_rank, seed=rank)

    def step(side: str) -> None:
        if side == "alone":
            ddp(**batch, return_loss=True).loss.backward()
            return
        out = ddp(**batch, return_loss=False, return_logits=False)
        loss_fn = teacher.loss_fn(*teacher.embed(batch))
        loss_fn(out.image_embeds, out.text_embeds, *logit_params(student, out)).backward()

    times = {side: [] for side in SIDES}
    for round_ in range(rounds + 1):  # round 0 warms up
        for side in SIDES if round_ % 2 else SIDES[::-1]:
            torch.distributed.barrier()
            start = time.perf_counter()
            step(side)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_:
                times[side].append(time.perf_counter() - start)
    torch.distributed.barrier()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=31, help="interleaved rounds after one warm-up round")
    parser.add_argument("--per_rank", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--distill_weight", type=float, default=0.5)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "distill_cost.csv")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    per_rank = run_ranks(
        _rank, args.ranks, args.per_rank, args.distill_weight, args.rounds, timeout=3600, env={"HF_HUB_OFFLINE": "1"}
    )
    # a step ends when its slowest rank does
    times = {side: [max(r[side][i] for r in per_rank) for i in range(args.rounds)] for side in SIDES}
    settings = {"student": STUDENT, "teacher": TEACHER, "ranks": args.ranks, "per_rank": args.per_rank}
    rows = [
        bench_row(
            {**settings, "run": side, "distill_weight": args.distill_weight if side == "distilled" else ""},
            {"step_s": times[side], "step_vs_alone": ratios(times[side], times["alone"])},
        )
        for side in SIDES
    ]
    write_rows(args.results, rows)
    for row in rows:
        print({k: row[k] for k in ("run", "step_s_median", "step_vs_alone_min", "step_vs_alone_median")})


if __name__ == "__main__":
    main()
