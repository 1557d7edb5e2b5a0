"""The EMA's cost per training step: the step with and without `WeightsEma.update` (train/ema.py), interleaved in one
process group, and the bytes the EMA holds on each rank against the planner's term.

2 CPU ranks x 1 thread, fp32, random in-memory batches, the DDP + AdamW step (as distill_cost.py): each rank averages
every trainable weight, the most an EMA costs a rank (under ZeRO each rank averages only its 1/N of the fp32 masters).
Both sides run in turn (without, with, with, without, ...) for --rounds rounds after a warm-up round; per round each
side's step time (the slower rank's), the ratio of the step with the EMA to the step without it of the same round,
and the update alone (`update_s`) with its share of the step it ends.

    python bench/train/ema_cost.py --models tiny small --rounds 15     # writes results/ema_cost.csv
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.images import random_clip_batch
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import run_ranks

HERE = Path(__file__).resolve().parent
SIDES = ("without", "with")


def _rank(rank: int, world: int, model_name: str, per_rank: int, rounds: int) -> dict:
    """{side: [step seconds per round], "held": bytes of EMA on this rank}."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.ema import WeightsEma

    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / f"recipes/models/{model_name}.json"))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = random_clip_batch(model.config, per_rank, seed=rank)
    trainer = SimpleNamespace(
        model=model,
        model_wrapped=ddp,
        is_deepspeed_enabled=False,
        args=SimpleNamespace(process_index=rank, world_size=world),
    )
    ema = WeightsEma(trainer, decay=0.999)
    ema.start(None)
    times = {side: [] for side in SIDES}
    update, step = [], 0
    for round_ in range(rounds + 1):  # round 0 warms up
        for side in SIDES if round_ % 2 else SIDES[::-1]:
            torch.distributed.barrier()
            start = time.perf_counter()
            ddp(**batch, return_loss=True).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if side == "with":
                updating = time.perf_counter()
                ema.update(step)
                if round_:
                    update.append(time.perf_counter() - updating)
            if round_:
                times[side].append(time.perf_counter() - start)
    torch.distributed.barrier()
    return {**times, "update": update, "held": sum(v.numel() * v.element_size() for v in ema.values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds after one warm-up round")
    parser.add_argument("--per_rank", type=int, nargs="+", default=[128, 32], help="one per model")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--results", type=Path, default=HERE / "results" / "ema_cost.csv")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from disco_clip_ds.plan.report import plan

    rows = []
    for model, per_rank in zip(args.models, args.per_rank, strict=True):
        got = run_ranks(_rank, args.ranks, model, per_rank, args.rounds, timeout=3600, env={"HF_HUB_OFFLINE": "1"})
        times = {side: [max(r[side][i] for r in got) for i in range(args.rounds)] for side in SIDES}
        config, model_json = REPO / "ds_configs/cpu_zero2.json", REPO / f"recipes/models/{model}.json"
        mem = plan(config, model_json, args.ranks, "40GB", per_rank, "fp32", loss_impls=["tiled"], ema=True)
        zero2 = int(mem["memory"]["tiled"]["terms"]["ema"])  # a 1/N partition per rank; DDP holds N of them
        settings = {"model": model, "ranks": args.ranks, "per_rank": per_rank, "engine": "DDP"}
        memory = {"ema_bytes_per_rank_held": got[0]["held"], "ema_bytes_per_rank_planned_ddp": zero2 * args.ranks}
        memory["ema_bytes_per_rank_planned_zero2"] = zero2
        update = [max(r["update"][i] for r in got) for i in range(args.rounds)]
        for side in SIDES:
            samples = {"step_s": times[side], "step_vs_without": ratios(times[side], times["without"])}
            if side == "with":  # the update alone, and its share of the step it ends
                samples |= {"update_s": update, "update_share": ratios(update, times[side])}
            rows.append(bench_row({**settings, "run": side, **memory}, samples))
    write_rows(args.results, rows)
    for row in rows:
        print({k: v for k, v in row.items() if k.startswith(("model", "run", "step_", "update_"))})


if __name__ == "__main__":
    main()
