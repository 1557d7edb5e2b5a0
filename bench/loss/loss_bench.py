"""Per-rank peak extra memory, forward+backward time and wire bytes of the CLIP loss, impls side by side.

Impls: naive (open_clip's default), disco (the paper), twoblock (this repo's earlier tiled loss, kept here as
the baseline: two b x B blocks per rank, both modalities gathered), tiled (disco_clip_ds.losses: one block) and,
on request, infcl (Inf-CL's `inf-cl` package: Triton kernels, CUDA only, each direction separately).
Each (world, batch, impl) runs in `world` freshly spawned ranks (gloo on CPU, NCCL on one or more GPUs), so
memory peaks never mix; with --rounds R the impls run interleaved (A, B, C, A, B, C, ...) so that drift in a
shared machine's speed hits them alike, and `time_vs_tiled` is the median over rounds of each round's ratio.
On CPU each rank gets a data-segment limit (RLIMIT_DATA): an impl that needs more fails its allocation and is
recorded as OOM instead of waking the kernel's OOM killer. Writes a CSV and a log-log PNG of memory vs batch.

    python bench/loss/loss_bench.py --world 4 --batch 4096 8192 16384 32768    # or: disco-clip bench loss ...
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.memory import mmap_threshold_env, peak_extra_mib, rss_mib
from disco_clip_ds.testing.ranks import RanksFailed, run_ranks
from disco_clip_ds.testing.wire import WireBytes

# The losses compared by default: the bench-only baselines naive (open_clip's default) and twoblock (this repo's
# earlier tiled loss), and the package's disco and tiled; tiled last: ratios are to it.
IMPLS = ("naive", "disco", "twoblock", "tiled")


def naive_loss(image, text, scale, group=None):
    """The open_clip default without --local-loss: every rank builds the full B x B logits.

    Gathered features carry no gradient except this rank's own rows (put back in place), so each rank's
    gradient is the global-loss gradient w.r.t. its rows, as in open_clip's gather_features.
    """
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = []
    for local in (image, text):
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        parts[rank] = local
        gathered.append(torch.cat(parts))
    logits = scale.float() * gathered[0].float() @ gathered[1].float().T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def infcl_loss(image, text, scale):
    """Inf-CL's symmetric CLIP loss as its README composes it: one cal_inf_loss per direction, averaged.

    Its ring passes each rank's keys around and returns the mean over local rows (a per-rank loss, not scaled
    to the global mean as ours): the same work per rank, for timing and memory only.
    """
    from inf_cl import cal_inf_loss

    return (cal_inf_loss(image, text, scale=scale) + cal_inf_loss(text, image, scale=scale)) / 2


def twoblock_loss(image, text, scale, chunk_size=None, group=None):
    """The repo's tiled loss before the one-block rewrite: the baseline the new one is measured against.

    Both modalities gathered; per direction, row tiles of the rank's b x B block against all keys, each tile's
    gradient accumulated in the same pass as its log-sum-exp (3 matmuls per tile, 6 b x B x d per rank).
    """
    from disco_clip_ds.losses import default_chunk_size, gather_features
    from disco_clip_ds.losses.comm import check_inputs, rank_and_world

    sizes = check_inputs(image, text, {"logit_scale": scale}, group, "twoblock")
    world, total = rank_and_world(group)[1], sum(sizes)
    with torch.autocast(device_type=image.device.type, enabled=False):
        scale = torch.as_tensor(scale, device=image.device).float()
        all_images, all_texts = gather_features(image, text, sizes=sizes, group=group)
        chunk = chunk_size or default_chunk_size(total)
        lse_sum = _TwoBlockLSE.apply(image, all_texts, scale, chunk) + _TwoBlockLSE.apply(
            text, all_images, scale, chunk
        )
        positives = (image.float() * text.float()).sum() * scale
        return (lse_sum - 2 * positives) * (world / (2 * total))


class _TwoBlockLSE(torch.autograd.Function):
    """sum_i logsumexp_j(scale * q_i . k_j) in row tiles, with the gradient built in the same pass."""

    @staticmethod
    def forward(ctx, queries, keys, scale, chunk):
        keys32, s = keys.float(), float(scale)
        total = torch.zeros((), dtype=torch.float32, device=queries.device)
        grad_q = torch.empty(queries.shape, dtype=torch.float32, device=queries.device)
        grad_k = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        grad_s = torch.zeros((), dtype=torch.float32, device=queries.device)
        for start in range(0, queries.shape[0], chunk):
            q = queries[start : start + chunk].float()
            logits = (q @ keys32.T).mul_(s)
            row_max = logits.amax(dim=1, keepdim=True)
            prob = logits.sub_(row_max).exp_()
            row_sum = prob.sum(dim=1, keepdim=True)
            total += (row_max + row_sum.log()).sum()
            prob.div_(row_sum)
            prob_keys = prob @ keys32
            grad_q[start : start + chunk] = prob_keys * s
            grad_s += torch.vdot(q.reshape(-1), prob_keys.view(-1))
            grad_k.addmm_(prob.T, q, alpha=s)
        ctx.grads, ctx.dtypes = (grad_q, grad_k, grad_s), (queries.dtype, keys.dtype, scale.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*(g.mul_(grad_total).to(dt) for g, dt in zip(ctx.grads, ctx.dtypes)), None)


CHOICES = (*IMPLS[:-1], "infcl", IMPLS[-1])  # infcl: Inf-CL's PyPI package `inf-cl` (CUDA + Triton), when installed


def _limit_memory(extra_gib: float):
    """Cap this process's data segment at its current size plus `extra_gib`."""
    import resource

    limit = int((rss_mib("VmData") / 1024 + extra_gib) * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _status(failed: RanksFailed) -> str:
    """The CSV status of a failed configuration: OOM when any rank ran out of memory, else the first error."""
    first_lines = [message.splitlines()[0] for message in failed.errors.values()]
    for line in first_lines:
        if line.startswith("died with exit code"):
            return "killed (OOM killer?)"
        if line.startswith("MemoryError") or "out of memory" in line.lower() or "can't allocate memory" in line:
            return "OOM"
    return f"error: {first_lines[0]}"[:300]


def _rank_main(rank, world, cfg):
    """One configuration on this rank: (peak extra MiB of the first call, median ms, bytes sent)."""
    from disco_clip_ds.losses import DiscoClipLoss

    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg["dtype"]]
    b = cfg["batch"] // world
    gen = torch.Generator(device=device).manual_seed(rank)
    make = lambda: torch.nn.functional.normalize(torch.randn(b, cfg["dim"], device=device, generator=gen), dim=1)
    image, text = make().to(dtype).requires_grad_(), make().to(dtype).requires_grad_()
    log_scale = torch.tensor(math.log(1 / 0.07), device=device, requires_grad=True)
    if cfg["impl"] == "naive":
        loss_fn = naive_loss
    elif cfg["impl"] == "infcl":
        loss_fn = infcl_loss
    elif cfg["impl"] == "twoblock":
        loss_fn = lambda i, t, s: twoblock_loss(i, t, s, chunk_size=cfg["chunk_size"])
    else:
        loss_fn = DiscoClipLoss(cfg["impl"], chunk_size=cfg["chunk_size"])

    def step():
        loss_fn(image, text, log_scale.exp()).backward()
        image.grad = text.grad = log_scale.grad = None

    # Warm up on a few rows: thread pools, kernels and communicator buffers are set up once per process.
    warm = [t[:8].detach().requires_grad_() for t in (image, text)]
    loss_fn(*warm, log_scale.exp()).backward()
    if not cuda and cfg["mem_limit_gib"]:
        _limit_memory(cfg["mem_limit_gib"])
    start = time.perf_counter()
    with WireBytes() as wire:
        peak = peak_extra_mib(step, device)  # the first call: cold caches
    times = [time.perf_counter() - start] if cfg["reps"] == 0 else []  # with no reps, the cold call's time
    for _ in range(cfg["reps"]):
        dist.barrier()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times) * 1000, wire.total


def run_config(cfg: dict, timeout: float) -> dict:
    """One (impl, world, batch) in fresh ranks; returns a CSV row. Peak is the max over ranks, time the max median."""
    row = {k: cfg[k] for k in ("impl", "world", "batch", "dim", "dtype", "device")}
    try:
        outcomes = run_ranks(
            _rank_main,
            cfg["world"],
            cfg,
            timeout=timeout,
            backend="nccl" if cfg["device"] == "cuda" else "gloo",
            threads=max(1, cfg["threads"] // cfg["world"]),
            # every large freed block goes back to the OS, so that RSS tracks live tensors
            env=mmap_threshold_env(1 << 20),
            grace=1.0,  # one rank failed: the others would wait forever in a collective
        )
    except RanksFailed as failed:
        return dict(row, peak_extra_mib="", time_ms="", wire_mib="", status=_status(failed))
    except TimeoutError:
        return dict(row, peak_extra_mib="", time_ms="", wire_mib="", status="timeout")
    return dict(
        row,
        peak_extra_mib=round(max(o[0] for o in outcomes), 1),
        time_ms=round(max(o[1] for o in outcomes), 1),
        wire_mib=round(max(o[2] for o in outcomes) / 2**20, 3),
        status="ok",
    )


def plot(rows: list[dict], path: Path):
    """Memory vs batch per (impl, world, dtype, device), log-log; failed runs as crosses along the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    top = 1.6 * max((float(r["peak_extra_mib"]) for r in rows if r["status"] == "ok"), default=1.0)
    series = sorted({(r["impl"], int(r["world"]), r["dtype"], r["device"]) for r in rows})
    for n, key in enumerate(series):
        mine = [r for r in rows if (r["impl"], int(r["world"]), r["dtype"], r["device"]) == key]
        pts = sorted((int(r["batch"]), float(r["peak_extra_mib"])) for r in mine if r["status"] == "ok")
        failed = [int(r["batch"]) for r in mine if r["status"] not in ("ok",) and not r["status"].startswith("skipped")]
        color = None
        if pts:
            (line,) = ax.plot(*zip(*pts), marker="o", label="{} (world {}, {}, {})".format(*key))
            color = line.get_color()
        if failed:
            # nudged sideways per series so that crosses at the same B stay distinguishable
            ax.scatter([b * 1.04**n for b in failed], [top] * len(failed), marker="x", s=70, color=color)
    ax.axhline(top, color="grey", lw=0.5, ls=":")
    ax.set_xscale("log", base=2)
    ax.text(min(int(r["batch"]) for r in rows), top, "OOM ", ha="right", va="center", fontsize=8, color="grey")
    ax.set(
        yscale="log",
        xlabel="global batch B (d = 512)",
        ylabel="peak extra memory per rank (MiB)",
        title="CLIP loss memory per rank",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _default_mem_limit(world: int) -> float:
    """GiB per rank: 80 % of the memory available now, shared by the ranks."""
    with open("/proc/meminfo") as f:
        avail_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return 0.8 * avail_kib / 2**20 / world


def _point(text: str) -> tuple[int, int]:
    world, batch = text.lower().split("x")
    return int(world), int(batch)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="ranks per run (GPUs with --device cuda)")
    p.add_argument(
        "--batch", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768], help="global batch sizes B"
    )
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=CHOICES)  # tiled last: ratios are to it
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--chunk_size", type=int, default=None, help="tiled loss rows per tile (default: the loss's own)")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions after the memory-measuring first call")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all impls per (world, batch)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads shared by the ranks")
    p.add_argument(
        "--mem_limit_gib", type=float, default=None, help="CPU memory cap per rank (default: 80%% of available / world)"
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    p.add_argument(
        "--out", default="bench/loss/results/loss_bench_cpu.csv", help="CSV path (a PNG plot is written beside it)"
    )
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from the CSV at --out")
    p.add_argument(
        "--points", type=_point, nargs="+", help="WORLDxBATCH pairs, e.g. 2x16384 4x32768, instead of --world x --batch"
    )
    args = p.parse_args(argv)
    if args.points:
        args.world, args.batch = sorted({w for w, _ in args.points}), [b for _, b in args.points]
        if any(b % w for w, b in args.points):
            p.error(f"every batch must be divisible by its world; got {args.points}")
        return args
    if any(b % w for b in args.batch for w in args.world):
        p.error(f"every --batch must be divisible by every --world; got batch {args.batch}, world {args.world}")
    return args


def _merge_rounds(runs: list[dict]) -> list[dict]:
    """One row per impl from its interleaved rounds: first round's peak (a cold process each time, so the
    rounds agree), median time, and the median over rounds of the time ratio to tiled's run of that round."""
    rows = []
    tiled = [r for r in runs if r["impl"] == "tiled"]
    for impl in dict.fromkeys(r["impl"] for r in runs):
        mine = [r for r in runs if r["impl"] == impl]
        row = dict(mine[0])
        ok = [r for r in mine if r["status"] == "ok"]
        if len(ok) == len(mine):
            times = [float(r["time_ms"]) for r in ok]
            row.update(time_ms=round(statistics.median(times), 1), rounds_ms=";".join(f"{t:.0f}" for t in times))
            if len(tiled) == len(mine) and all(t["status"] == "ok" for t in tiled):
                row["time_vs_tiled"] = round(
                    statistics.median(a / float(t["time_ms"]) for a, t in zip(times, tiled)), 3
                )
        rows.append(row)
    return rows


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    if args.replot:
        with open(out) as f:
            plot(list(csv.DictReader(f)), out.with_suffix(".png"))
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    print(
        f"{'impl':>8} {'world':>5} {'batch':>7} {'dtype':>5} {'round':>5} {'peak MiB/rank':>14} "
        f"{'fwd+bwd ms':>11} {'wire MiB':>9}  status",
        flush=True,
    )
    points = args.points or [(w, b) for w in args.world for b in sorted(args.batch)]
    for dtype in args.dtype:
        for world, batch in points:
            runs = []
            for round_ in range(args.rounds):
                for impl in args.impl:
                    base = {
                        "impl": impl,
                        "world": world,
                        "batch": batch,
                        "dim": args.dim,
                        "dtype": dtype,
                        "device": args.device,
                    }
                    if any(
                        r["impl"] == impl and r["world"] == world and r["dtype"] == dtype and r["status"] != "ok"
                        for r in rows + runs
                    ):
                        runs.append(
                            dict(
                                base,
                                peak_extra_mib="",
                                time_ms="",
                                status="skipped (smaller B or earlier round failed)",
                            )
                        )
                    else:
                        cfg = dict(
                            base,
                            chunk_size=args.chunk_size,
                            reps=args.reps,
                            threads=args.threads,
                            mem_limit_gib=args.mem_limit_gib or _default_mem_limit(world),
                        )
                        runs.append(run_config(cfg, args.timeout))
                    r = runs[-1]
                    print(
                        f"{impl:>8} {world:>5} {batch:>7} {dtype:>5} {round_:>5} {r['peak_extra_mib']!s:>14} "
                        f"{r['time_ms']!s:>11} {r.get('wire_mib', '')!s:>9}  {r['status']}",
                        flush=True,
                    )
            rows += _merge_rounds(runs)
            write_rows(out, rows, rounds=args.rounds)  # rewritten after every batch: a crash keeps what was measured
    for r in rows:
        if r.get("time_vs_tiled"):
            print(
                f"world {r['world']} B {r['batch']} {r['dtype']}: tiled's time / {r['impl']}'s = "
                f"{1 / float(r['time_vs_tiled']):.3f} (median of per-round ratios)"
            )
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
