"""Contrastive accumulation's cost: time and memory per optimizer step at one contrastive batch, against K.

One harness for both: a process group of --ranks CPU ranks (gloo) runs, per model, optimizer steps at each K in
turn (K = 1, 2, 4 ... then again, --rounds rounds after a warm-up round), every K at the SAME contrastive batch
(micro = batch / (ranks x K) per rank): K = 1 is that batch without accumulation, the baseline. A step at K > 1 runs
`disco_clip_ds.train.accumulation`'s functions as the Trainer's component does (embed the K micro-batches without
grad, the global-batch loss and its gradient on the cached embeddings, one forward + backward per micro-batch);
K = 1 is one forward + backward of the model's global-batch loss. DDP and plain SGD, fp32: the Trainer cannot
change K between steps, and only steps interleaved in one process group see the same machine load.

Per step and rank: the wall time, and the peak resident memory above the resident memory just before the step
(VmHWM reset through /proc after glibc's malloc_trim, the ranks started with its mmap threshold at 1 MiB: what
earlier steps freed has left the process, so no step reuses it unseen). Per round, each K's ratio to K = 1's step
of the same round. Rows: each K's spread (min / median / max over rounds) of step_s, peak_mib (the larger rank's)
and both ratios.

    python bench/accumulate/accum_bench.py --models tiny small --batch 256 128 --ks 1 2 4 8 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import time
from pathlib import Path

import torch

from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.images import random_clip_batch
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.memory import mmap_threshold_env, reset_peak_rss, rss_mib
from disco_clip_ds.testing.ranks import run_ranks

_LIBC = ctypes.CDLL("libc.so.6")


def _step(ddp, model, micro_batches: list) -> None:
    """One optimizer step's forward and backward passes (the optimizer step itself is the caller's)."""
    from disco_clip_ds.train.accumulation import cached_embedding_gradients, surrogate_loss

    k = len(micro_batches)
    if k == 1:
        ddp(**micro_batches[0], return_loss=True).loss.backward()
        return
    with torch.no_grad():  # step 1: embed without grad
        outs = [ddp(**b) for b in micro_batches]
    _, grads, param_grads = cached_embedding_gradients(  # step 2: the global-batch loss on the cache
        [o.image_embeds for o in outs], [o.text_embeds for o in outs], (outs[0].logit_scale,), model.global_loss
    )
    del outs
    for i, b in enumerate(micro_batches):  # step 3: each micro-batch again, with grad
        with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
            out = ddp(**b)
            surrogate_loss(out.image_embeds, out.text_embeds, (out.logit_scale,), grads[i], param_grads, k).backward()


def _rank(rank: int, world: int, model_name: str, batch: int, ks: list, rounds: int) -> dict:
    """{K: {"step_s": [per round], "peak_mib": [per round]}} on this rank."""
    from disco_clip_ds.models.build import build_model

    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / "recipes" / "models" / f"{model_name}.json"))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    local = random_clip_batch(model.config, batch // world, seed=rank)  # this rank's share of the contrastive batch
    splits = {k: [{n: t[i::k] for n, t in local.items()} for i in range(k)] for k in ks}
    got = {k: {"step_s": [], "peak_mib": []} for k in ks}
    for round_ in range(rounds + 1):  # round 0 warms up
        for k in ks if round_ % 2 else ks[::-1]:  # alternate the order: no K always runs after the same one
            torch.distributed.barrier()
            _LIBC.malloc_trim(0)  # hand back what earlier steps freed: else a step reuses it unseen by the peak
            before = reset_peak_rss()
            start = time.perf_counter()
            _step(ddp, model, splits[k])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if round_:
                got[k]["step_s"].append(elapsed)
                got[k]["peak_mib"].append(rss_mib("VmHWM") - before)
    torch.distributed.barrier()
    return got


def measure(model_name: str, batch: int, ks: list, rounds: int, ranks: int) -> list[dict]:
    per_rank = run_ranks(
        _rank, ranks, model_name, batch, ks, rounds, timeout=3600, env={**mmap_threshold_env(), "HF_HUB_OFFLINE": "1"}
    )
    # a step ends when its slowest rank does; its memory is the larger rank's
    step_s = {k: [max(r[k]["step_s"][i] for r in per_rank) for i in range(rounds)] for k in ks}
    peak = {k: [max(r[k]["peak_mib"][i] for r in per_rank) for i in range(rounds)] for k in ks}
    base = ks[0]
    return [
        bench_row(
            {"model": model_name, "ranks": ranks, "contrastive_batch": batch, "micro": batch // (ranks * k), "K": k},
            {
                "step_s": step_s[k],
                "peak_mib": peak[k],
                "time_vs_k1": ratios(step_s[k], step_s[base]),
                "peak_vs_k1": ratios(peak[k], peak[base]),
            },
            digits=3,
        )
        for k in ks
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="names in recipes/models/")
    parser.add_argument("--batch", nargs="+", type=int, default=[256, 128], help="contrastive batch, one per model")
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8], help="the first is the baseline (1)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds after one warm-up round")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "accum_bench.csv"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sorted(args.ks)[0] != 1 or any(b % (args.ranks * k) for b in args.batch for k in args.ks):
        parser.error("--ks must include 1, and each --batch must divide by ranks x K for every K")
    rows = []
    for name, batch in zip(args.models, args.batch):
        rows += measure(name, batch, sorted(args.ks), args.rounds, args.ranks)
        write_rows(args.out, rows)  # after every model: an interrupted sweep keeps its rows
        for row in rows[-len(args.ks) :]:
            shown = ("model", "K", "micro", "step_s_median", "time_vs_k1_median", "peak_vs_k1_median")
            print({k: row[k] for k in shown})


if __name__ == "__main__":
    main()
