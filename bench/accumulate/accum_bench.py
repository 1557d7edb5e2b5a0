"""Contrastive accumulation: peak memory per rank and time per sample against K, at a fixed micro-batch.

Runs the real training path, `disco_clip_ds.train.trainer.DiscoTrainer` (HF Trainer + DeepSpeed ZeRO-2, fp32, AdamW)
on N CPU ranks (gloo), on in-memory random batches, once per (model, K) in fresh processes (peak RSS only grows, so each
K needs its own). Each run: --steps optimizer steps of K micro-batches of --micro pairs per rank, so a contrastive
batch of micro x ranks x K. `ref` rows: the same contrastive batch without accumulation (micro x K per rank, K=1),
the memory that accumulation avoids.

Per rank: `peak_mib` = the process's peak RSS; `train_mib` = peak RSS minus the RSS just before `trainer.train()`
(model built, data in memory; the DeepSpeed engine and optimizer states are built inside train() and included);
`s_per_sample` = median logged step time over the steps after the first / (micro x ranks x K): separate runs,
so on a shared machine their times drift apart. Hence also `--interleaved`: one process group per model runs
optimizer steps at K = 1, 2, 4, 8 in turn (round-robin, --rounds rounds), with the same accumulate.py functions as
the Trainer mixin in a bare DDP loop (the Trainer cannot switch K between steps); `time_vs_k1_interleaved` is the
median over rounds of each round's per-sample time ratio to K=1's.

    python bench/accumulate/accum_bench.py [--models tiny small] [--micro 64 16] [--ks 1 2 4 8] [--steps 4]
    python bench/accumulate/accum_bench.py --timing_only --interleaved [--rounds 6]   # accum_bench_timing.csv

Prints a table; writes accum_bench.csv to --out (default bench/accumulate/results).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.memory import rss_mib
from disco_clip_ds.testing.ranks import run_ranks

DS_CONFIG = {  # cpu_zero2.json with small buckets: its 50M-element buckets would dwarf the tiny model's memory
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "steps_per_print": 10**9,
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2_000_000,
        "allgather_bucket_size": 2_000_000,
    },
}


class RandomPairs(torch.utils.data.Dataset):
    """Random (token ids, image) pairs made on access from a per-index seed: the bench measures model + loss +
    engine, not decoding, and holds no data set in memory (which would grow with K and blur the peak)."""

    def __init__(self, config, size: int, seed: int):
        self.text, self.vision, self.size, self.seed = config.text_config, config.vision_config, size, seed
        self.skipped = SimpleNamespace(value=0)  # DiscoTrainer logs the stream's skipped-sample count

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(2, self.text.vocab_size, (self.text.max_position_embeddings,), generator=g)
        ids[0], ids[-1] = self.text.bos_token_id, self.text.eos_token_id
        pixels = torch.randn(3, self.vision.image_size, self.vision.image_size, generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def _rank(rank: int, world: int, model_name: str, micro: int, k: int, contrastive: bool, steps: int, out: str):
    import deepspeed

    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.args import DiscoTrainingArguments
    from disco_clip_ds.train.trainer import DiscoTrainer

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # takes the process group run_ranks started
    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / "recipes" / "models" / f"{model_name}.json"))
    args = DiscoTrainingArguments(
        output_dir=out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=k,
        contrastive_accumulation=contrastive,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=DS_CONFIG,
        learning_rate=1e-4,
        seed=0,
    )
    data = RandomPairs(model.config, micro * k * world * steps, seed=1)
    trainer = DiscoTrainer(model=model, args=args, train_dataset=data)
    before = rss_mib("VmRSS")
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = [h["step_time_s"] for h in trainer.state.log_history if "step_time_s" in h][1:]
    batch = [h["global_contrastive_batch"] for h in trainer.state.log_history if "global_contrastive_batch" in h][0]
    torch.distributed.barrier()
    return {
        "peak_mib": peak,
        "train_mib": peak - before,
        "step_s": statistics.median(times),
        "contrastive_batch": batch,
    }


def _interleaved_rank(rank: int, world: int, model_name: str, micro: int, ks: list, rounds: int) -> dict | None:
    """Rank 0 returns {K: median over rounds of the per-sample time ratio to the first K}."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.accumulation import cached_embedding_gradients, surrogate_loss

    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / "recipes" / "models" / f"{model_name}.json"))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = RandomPairs(model.config, 10**9, seed=rank)
    batch = lambda i: {
        k: torch.stack([data[i * micro + j][k] for j in range(micro)])
        for k in ("input_ids", "attention_mask", "pixel_values")
    }
    batches = [batch(i) for i in range(max(ks))]
    times = {k: [] for k in ks}
    for round_ in range(rounds + 1):  # round 0 warms up
        for k in ks:
            torch.distributed.barrier()
            start = time.perf_counter()
            if k == 1:
                ddp(**batches[0], return_loss=True).loss.backward()
            else:  # steps 1-3 of disco_clip_ds.train.accumulation, as the mixin runs them
                with torch.no_grad():
                    outs = [ddp(**b) for b in batches[:k]]
                loss, grads, param_grads = cached_embedding_gradients(
                    [o.image_embeds for o in outs],
                    [o.text_embeds for o in outs],
                    (outs[0].logit_scale,),
                    model.global_loss,
                )
                for i, b in enumerate(batches[:k]):
                    with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                        out = ddp(**b)
                        surrogate_loss(
                            out.image_embeds, out.text_embeds, (out.logit_scale,), grads[i], param_grads, k
                        ).backward()
            optimizer.step()
            optimizer.zero_grad()
            if round_:
                times[k].append((time.perf_counter() - start) / (micro * k * world))
    torch.distributed.barrier()
    if rank == 0:
        return {k: statistics.median(t / t1 for t, t1 in zip(times[k], times[ks[0]])) for k in ks}
    return None


def run(model_name: str, micro: int, k: int, contrastive: bool, steps: int, ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        results = run_ranks(
            _rank, ranks, model_name, micro, k, contrastive, steps, out, timeout=3600, env={"DS_ACCELERATOR": "cpu"}
        )
    return {
        "peak_mib": max(r["peak_mib"] for r in results),
        "train_mib": max(r["train_mib"] for r in results),
        "step_s": statistics.median(r["step_s"] for r in results),
        "contrastive_batch": results[0]["contrastive_batch"],
    }


def _write_csv(rows: list, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="names in recipes/models/")
    parser.add_argument("--micro", nargs="+", type=int, default=[64, 16], help="micro-batch per rank, one per model")
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--no_ref", action="store_true", help="skip the micro x K without accumulation runs")
    parser.add_argument("--interleaved", action="store_true", help="also time the Ks round-robin in one process group")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (after one warm-up round)")
    parser.add_argument(
        "--timing_only", action="store_true", help="only the interleaved timing: accum_bench_timing.csv"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    rows = []
    for name, micro in zip(args.models, args.micro):
        interleaved = {}
        if args.interleaved:
            interleaved = run_ranks(
                _interleaved_rank, args.ranks, name, micro, sorted(args.ks), args.rounds, timeout=3600
            )[0]
            print(name, "interleaved per-sample time vs K=1:", interleaved, flush=True)
        if args.timing_only:
            rows += [
                {
                    "model": name,
                    "ranks": args.ranks,
                    "micro": micro,
                    "K": k,
                    "rounds": args.rounds,
                    "time_per_sample_vs_k1": round(v, 3),
                }
                for k, v in interleaved.items()
            ]
            continue
        base = None
        variants = [(k, micro, True, "accum") for k in args.ks]
        variants += [] if args.no_ref else [(k, micro * k, True, "ref") for k in args.ks if k > 1][-1:]
        for k, b, contrastive, kind in variants:
            steps_k = 1 if kind == "ref" else k
            result = run(name, b, steps_k, contrastive, args.steps, args.ranks)
            per_sample = result["step_s"] / result["contrastive_batch"]
            base = base or (result, per_sample)
            rows.append(
                {
                    "model": name,
                    "kind": kind,
                    "ranks": args.ranks,
                    "micro": b,
                    "K": steps_k,
                    "contrastive_batch": result["contrastive_batch"],
                    "peak_mib": round(result["peak_mib"]),
                    "train_mib": round(result["train_mib"]),
                    "peak_vs_k1": round(result["peak_mib"] / base[0]["peak_mib"], 3),
                    "train_vs_k1": round(result["train_mib"] / base[0]["train_mib"], 3),
                    "step_s": round(result["step_s"], 4),
                    "ms_per_sample": round(1000 * per_sample, 3),
                    "time_per_sample_vs_k1": round(per_sample / base[1], 3),
                    "time_vs_k1_interleaved": round(interleaved[steps_k], 3)
                    if kind == "accum" and steps_k in interleaved
                    else "",
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            _write_csv(rows, Path(args.out) / "accum_bench.csv")  # after every run: an interrupted sweep keeps its rows
    if args.timing_only:
        _write_csv(rows, Path(args.out) / "accum_bench_timing.csv")
    header = list(rows[0])
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[k]) for k in header))


if __name__ == "__main__":
    main()
