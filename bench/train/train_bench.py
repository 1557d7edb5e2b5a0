"""Training throughput per loss: DiscoCLIPModel under the DeepSpeed engine (ZeRO-2), N CPU ranks (gloo).

For each model config and each loss ("local" = each device's own b x b CLIP loss, what HF's contrastive example
trains with under DDP; "disco" and "tiled" = the global-batch loss), times full optimizer steps on in-memory
batches (no decoding, so the table shows model + loss + engine only), and the loss alone (forward + backward of
the loss on this rank's features, collectives included). The impls share one engine and run round-robin so
that drift in the machine's speed hits them alike; `step_vs_local` is each round's step-time ratio to the local
loss's step of the same round. Each row holds the min / median / max over the rounds of rank 0's step time, that
ratio and the loss's own time (`loss_share_of_step`: the medians' quotient).

    python bench/train/train_bench.py [--models tiny small] [--per_rank 256] [--ranks 2] [--steps 6]   # or:
    disco-clip bench train ...

Prints a table; writes train_bench.csv and train_bench.png (samples/s, the bars' whiskers the rounds' spread) to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import run_ranks

IMPLS = ("local", "disco", "tiled")


def _batch(config, per_rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    text, vision = config.text_config, config.vision_config
    length = text.max_position_embeddings
    ids = torch.randint(2, text.vocab_size, (per_rank, length), generator=g)
    ids[:, 0], ids[:, -1] = text.bos_token_id, text.eos_token_id
    pixels = torch.randn(per_rank, 3, vision.image_size, vision.image_size, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "return_loss": True}


def _loss_only_seconds(impl: str, per_rank: int, dim: int, repeats: int) -> list[float]:
    from transformers.models.clip.modeling_clip import image_text_contrastive_loss

    from disco_clip_ds.losses import disco_clip_loss

    image = torch.nn.functional.normalize(torch.randn(per_rank, dim), dim=-1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(per_rank, dim), dim=-1).requires_grad_()
    scale = torch.tensor(100.0)
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        if impl == "local":
            loss = image_text_contrastive_loss(scale * text @ image.t())
        else:
            loss = disco_clip_loss(image, text, scale, impl=impl)
        loss.backward()
        times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, world: int, model_name: str, per_rank: int, steps: int) -> dict | None:
    """Rank 0 returns {impl: {"step_s": [per round], "loss_fwd_bwd_s": [per round]}}."""
    import deepspeed

    from disco_clip_ds.models.build import build_model

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # takes the process group run_ranks started
    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / "recipes" / "models" / f"{model_name}.json"))
    config = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "train_batch_size": per_rank * world,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    batch = _batch(model.config, per_rank, seed=rank)
    step_times = {impl: [] for impl in IMPLS}
    for round_ in range(steps + 1):  # round 0 warms up
        for impl in IMPLS:
            model.config.loss_impl = impl
            torch.distributed.barrier()
            start = time.perf_counter()
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if round_:
                step_times[impl].append(time.perf_counter() - start)
    dim = model.config.projection_dim
    loss_times = {impl: _loss_only_seconds(impl, per_rank, dim, repeats=steps) for impl in IMPLS}
    if rank == 0:
        return {impl: {"step_s": step_times[impl], "loss_fwd_bwd_s": loss_times[impl]} for impl in IMPLS}
    return None


def bench_model(model_name: str, per_rank: int, ranks: int, steps: int) -> dict:
    return run_ranks(_rank, ranks, model_name, per_rank, steps, timeout=3600, env={"DS_ACCELERATOR": "cpu"})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="names in recipes/models/")
    parser.add_argument("--per_rank", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per loss (after one warm-up round)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    rows = []
    for name in args.models:
        result = bench_model(name, args.per_rank, args.ranks, args.steps)
        for impl in IMPLS:
            step, loss = result[impl]["step_s"], result[impl]["loss_fwd_bwd_s"]
            settings = {"model": name, "loss": impl, "ranks": args.ranks, "per_rank": args.per_rank}
            settings["global_batch"] = args.per_rank * args.ranks
            # paired per round: the impls ran back to back, so the ratio cancels most of the machine's drift
            vs_local = ratios(step, result["local"]["step_s"])
            row = bench_row(settings, {"step_s": step, "step_vs_local": vs_local, "loss_fwd_bwd_s": loss})
            row["samples_per_s"] = round(args.per_rank * args.ranks / statistics.median(step), 1)
            row["loss_share_of_step"] = round(statistics.median(loss) / statistics.median(step), 4)
            rows.append(row)
    shown = ("model", "loss", "step_s_median", "step_vs_local_min", "step_vs_local_median", "step_vs_local_max")
    print(" | ".join(shown + ("loss_share_of_step",)))
    for row in rows:
        print(" | ".join(str(row[k]) for k in shown + ("loss_share_of_step",)))

    out = Path(args.out)
    write_rows(out / "train_bench.csv", rows)
    _plot(rows, out / "train_bench.png")
    print(f"wrote {out / 'train_bench.csv'} and {out / 'train_bench.png'}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        rate = [r["samples_per_s"] for r in mine]
        low = [rate_ - r["global_batch"] / r["step_s_max"] for rate_, r in zip(rate, mine)]
        high = [r["global_batch"] / r["step_s_min"] - rate_ for rate_, r in zip(rate, mine)]
        ax.bar([r["loss"] for r in mine], rate, yerr=[low, high], color=["grey", "tab:blue", "tab:green"], capsize=4)
        for i, r in enumerate(mine):
            ax.text(
                i,
                r["samples_per_s"],
                f"loss {100 * r['loss_share_of_step']:.1f}%",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(f"{model}: {mine[0]['ranks']} CPU ranks x {mine[0]['per_rank']}, ZeRO-2")
        ax.set_ylabel("samples/s (all ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
