"""LAMB's cost per training step against AdamW's: two DeepSpeed ZeRO-2 engines over the same model config in one
process group, one with torch's AdamW, one with train/lamb.py's Lamb (its Pieces from train/lamb_shards.py, as
`disco-clip train --optim lamb` runs it), stepped in turn.

2 CPU ranks x 1 thread, fp32, random in-memory batches (no decoding), the Trainer's two weight-decay groups. The
sides run in turn (adamw, lamb, lamb, adamw, ...) for --rounds rounds after a warm-up round; per round each side's
whole step (forward, backward, engine.step) and its optimizer step alone (`engine.step`: the update and ZeRO's
all-gather of the new weights), the slower rank's, and the ratio of LAMB's to AdamW's of the same round.

    python bench/train/lamb_cost.py --models tiny small --rounds 15     # writes results/lamb_cost.csv
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
SIDES = ("adamw", "lamb")


def _engine(side: str, model_name: str, per_rank: int, world: int):
    import deepspeed

    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.lamb import Lamb
    from disco_clip_ds.train.lamb_shards import zero_pieces
    from disco_clip_ds.train.optim import without_clip_no_decay

    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / f"recipes/models/{model_name}.json"))
    decay = set(without_clip_no_decay([n for n, p in model.named_parameters() if p.ndim >= 2]))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-6}
    optimizer = Lamb(groups, **kwargs) if side == "lamb" else torch.optim.AdamW(groups, **kwargs)
    config = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "train_batch_size": per_rank * world,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,  # as the Trainer sets it for an optimizer it builds
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
    }
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    if side == "lamb":
        optimizer.layout = lambda: zero_pieces(engine)
    return engine


def _rank(rank: int, world: int, model_name: str, per_rank: int, rounds: int) -> dict:
    """{side: [step seconds per round]} and {side + "_opt": [engine.step seconds per round]}."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # takes the process group run_ranks started
    engines = {side: _engine(side, model_name, per_rank, world) for side in SIDES}
    batch = random_clip_batch(engines["adamw"].module.config, per_rank, seed=rank)
    times = {key: [] for side in SIDES for key in (side, f"{side}_opt")}
    for round_ in range(rounds + 1):  # round 0 warms up
        for side in SIDES if round_ % 2 else SIDES[::-1]:
            engine = engines[side]
            torch.distributed.barrier()
            start = time.perf_counter()
            engine.backward(engine(**batch, return_loss=True).loss)
            stepping = time.perf_counter()
            engine.step()
            if round_:
                times[side].append(time.perf_counter() - start)
                times[f"{side}_opt"].append(time.perf_counter() - stepping)
    torch.distributed.barrier()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds after one warm-up round")
    parser.add_argument("--per_rank", type=int, nargs="+", default=[128, 32], help="one per model")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "lamb_cost.csv")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for model, per_rank in zip(args.models, args.per_rank, strict=True):
        env = {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
        got = run_ranks(_rank, args.ranks, model, per_rank, args.rounds, timeout=3600, env=env)
        times = {key: [max(r[key][i] for r in got) for i in range(args.rounds)] for key in got[0]}
        settings = {"model": model, "ranks": args.ranks, "per_rank": per_rank, "engine": "DeepSpeed ZeRO-2, fp32"}
        for side in SIDES:
            samples = {
                "step_s": times[side],
                "step_vs_adamw": ratios(times[side], times["adamw"]),
                "optimizer_step_s": times[f"{side}_opt"],
                "optimizer_step_vs_adamw": ratios(times[f"{side}_opt"], times["adamw_opt"]),
            }
            rows.append(bench_row({**settings, "run": side}, samples))
    write_rows(args.results, rows)
    for row in rows:
        print({k: v for k, v in row.items() if k.startswith(("model", "run", "step_", "optimizer_"))})


if __name__ == "__main__":
    main()
