"""Largest global contrastive batch that fits vs GPU count, per loss, for 40 GB and 80 GB GPUs (planner only).

    python bench/plan/plan_plot.py      # writes bench/plan/results/plan_max_batch.csv and .png (seconds, no GPU)

Settings are the paper configs' (ds_configs/vit_b32_32k_8gpu.json: bf16, ZeRO-2, fp32 gradient reduction,
25M-element buckets with overlap_comm), ViT-B/32, AdamW, activation checkpointing on, 2 GiB framework overhead.
"""

from __future__ import annotations

from pathlib import Path

from disco_clip_ds import plan as P
from disco_clip_ds.testing.bench_record import write_rows

ROOT = Path(__file__).resolve().parents[2]

GPUS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# the global-batch losses: `local` contrasts each rank's micro-batch alone, so it has no global batch to draw
IMPLS = tuple(impl for impl in P.LOSS_IMPLS if impl != "local")


def main() -> None:
    shape, fit = P.ModelShape.from_json(ROOT / "recipes/models/vit_b32.json"), P.load_fit()
    base = P.read_deepspeed_json(ROOT / "ds_configs/vit_b32_32k_8gpu.json")
    rows = []
    for memory in ("40GB", "80GB"):
        for n in GPUS:
            config = dict(base, train_batch_size=base["train_micro_batch_size_per_gpu"] * n)
            settings = P.validate_config(config, n)
            for impl in IMPLS:
                micro = P.max_micro_batch(
                    shape, settings, fit, impl, True, P.parse_memory(memory), P.DEFAULT_OVERHEAD_GB * P.GiB
                )
                rows.append(
                    {
                        "gpu_memory": memory,
                        "gpus": n,
                        "impl": impl,
                        "max_micro_batch": micro,
                        "max_global_batch": micro * n,
                    }
                )
    out = ROOT / "bench/plan/results/plan_max_batch.csv"
    write_rows(out, rows, rounds=1)
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.relative_to(ROOT)} and {out.with_suffix('.png').relative_to(ROOT)}")
    for r in rows:
        if r["gpus"] in (8, 64):
            print(f"{r['gpu_memory']:>5} {r['gpus']:>4} GPUs {r['impl']:>6}: {r['max_global_batch']:>9,d}")


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for impl, color in zip(IMPLS, ("tab:blue", "tab:green")):
        for memory, style in (("40GB", "-"), ("80GB", "--")):
            pts = [(r["gpus"], r["max_global_batch"]) for r in rows if r["impl"] == impl and r["gpu_memory"] == memory]
            ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{impl}, {memory}")
    for b, n in ((32768, 8), (196608, 64)):
        ax.scatter([n], [b], marker="*", s=150, color="black", zorder=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(
        xlabel="GPUs", ylabel="largest global batch that fits", title="ViT-B/32, bf16, ZeRO-2, act. ckpt (* = paper)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
