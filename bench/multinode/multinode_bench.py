"""Cost across nodes: 2 nodes x 1 rank against 1 node x 2 ranks, same global batch, on this host.

Both are `torchrun` launches of `disco_clip_ds.train` (DeepSpeed ZeRO-2, tiny CLIP, SGD, CPU ranks on gloo, from
the same config and seed): one launcher with two ranks, or two launchers (`--nnodes 2 --node_rank R`, each its own
session) with one. Rounds interleave them (A B A B ...) so that drift in the machine's speed hits both alike; a
round's ratio is B's median logged `step_time_s` (steps after the first) over A's, and the table gives the median
of the rounds' ratios.

Bytes: one more run of each, through counted_rank.py, records at every step's end the bytes each rank's own TCP
sockets have sent (the kernel's count); the per-step figure is the median of the differences between consecutive
steps after the first, next to the planner's figure (disco_clip_ds.plan.traffic) for the same model and settings.

    python bench/multinode/multinode_bench.py [--per_rank 8 64] [--steps 12] [--rounds 3] [--out DIR]

Writes multinode_bench.csv (one row per run) and multinode_summary.csv (one row per per-rank batch) to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, TINY_CONFIG, start_nodes

HERE = Path(__file__).resolve().parent
SHAPES = {"1 node x 2 ranks": (1, 2), "2 nodes x 1 rank": (2, 1)}  # (nodes, ranks per node)


def _run(root: Path, name: str, shape: tuple, per_rank: int, steps: int, shards: str, count_bytes=False) -> Path:
    """Train `steps` steps with SHAPE = (nodes, ranks per node); the run folder (rank logs beside it)."""
    out = root / name
    nodes, nproc = shape
    args = [
        *LAUNCH_COMMON, "--output_dir", out, "--model_config", TINY_CONFIG, "--train_shards", shards,
        "--train_num_samples", 2 * per_rank * steps, "--per_device_train_batch_size", per_rank,
        "--max_steps", steps, "--save_steps", 10 * steps, *SGD,
        "--deepspeed", REPO / "ds_configs/cpu_zero2.json", "--dataloader_num_workers", "1",
    ]  # fmt: skip
    env = {"BENCH_BYTES_DIR": str(out)} if count_bytes else {}
    script = HERE / "counted_rank.py" if count_bytes else None
    out.mkdir(parents=True)
    procs = start_nodes("torchrun", nodes, args, out, nproc=nproc, script=script, **env)
    codes = [p.wait(timeout=1800) for p in procs]
    if codes != [0] * len(procs):
        logs = "".join(Path(f"{out}.node{r}.log").read_text()[-3000:] for r in range(nodes))
        raise RuntimeError(f"{name} failed ({codes}):\n{logs}")
    return out


def median_step_time(out: Path) -> float:
    """The median logged step_time_s of the steps after the first (logging_steps 1)."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    times = [float(h["step_time_s"]) for h in history if "step_time_s" in h]
    return statistics.median(times[1:])


def bytes_per_step(out: Path, rank: int) -> float:
    """Rank RANK's median TCP bytes sent per step, between consecutive step ends after the first step."""
    rows = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    sent = [r["tcp_bytes_sent"] for r in sorted(rows, key=lambda r: r["step"])]
    return statistics.median(b - a for a, b in zip(sent[1:], sent[2:]))


def planner_bytes(per_rank: int) -> dict:
    """The planner's bytes per rank per step for the tiny model, ZeRO-2 fp32, 2 ranks, the tiled loss."""
    from disco_clip_ds.plan.memory import ModelShape, Settings
    from disco_clip_ds.plan.traffic import traffic_bytes

    settings = Settings(
        world=2, micro_batch=per_rank, grad_accum=1, train_batch=2 * per_rank, stage=2, precision="fp32", comm_bytes=4
    )
    return traffic_bytes(ModelShape.from_json(TINY_CONFIG), settings, loss_impls=("tiled",))


def planner_columns(per_rank: int) -> dict:
    plan = planner_bytes(per_rank)
    return {
        "planner_bytes_per_step": int(sum(plan.values())),
        "planner_loss_bytes_per_step": int(sum(v for k, v in plan.items() if "loss" in k)),
    }


def replan(path: Path) -> None:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    _write(path, [{**row, **planner_columns(int(row["per_rank"]))} for row in rows])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per_rank", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--replan", action="store_true", help="only recompute the planner's columns of OUT/multinode_summary.csv"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replan:  # the measured bytes stand; the planner's figures are recomputed from the current planner
        replan(args.out / "multinode_summary.csv")
        return
    runs, summary = [], []
    with tempfile.TemporaryDirectory(prefix="multinode_bench_") as tmp:
        root = Path(tmp)
        for per_rank in args.per_rank:
            shard_dir = root / f"shards_b{per_rank}"
            write_shards(shard_dir, num_shards=2, per_shard=per_rank * args.steps, seed=3)
            shards = f"{shard_dir}/{{00000..00001}}.tar"
            ratios, medians = [], {name: [] for name in SHAPES}
            for round_ in range(args.rounds):
                times = {}
                for name, shape in SHAPES.items():
                    tag = f"b{per_rank}_r{round_}_{shape[0]}x{shape[1]}"
                    times[name] = median_step_time(_run(root, tag, shape, per_rank, args.steps, shards))
                    medians[name].append(times[name])
                    runs.append({"per_rank": per_rank, "round": round_, "shape": name, "step_time_s": times[name]})
                    print(runs[-1], flush=True)
                ratios.append(times["2 nodes x 1 rank"] / times["1 node x 2 ranks"])
            sent = {}
            for name, shape in SHAPES.items():
                out = _run(root, f"b{per_rank}_bytes_{shape[0]}x{shape[1]}", shape, per_rank, args.steps, shards, True)
                sent[name] = [bytes_per_step(out, rank) for rank in range(2)]
            summary.append(
                {
                    "per_rank": per_rank,
                    "global_batch": 2 * per_rank,
                    "rounds": args.rounds,
                    "step_s_1node_x2": round(statistics.median(medians["1 node x 2 ranks"]), 4),
                    "step_s_2nodes_x1": round(statistics.median(medians["2 nodes x 1 rank"]), 4),
                    "ratio_2nodes_over_1node": round(statistics.median(ratios), 3),
                    "ratio_min": round(min(ratios), 3),
                    "ratio_max": round(max(ratios), 3),
                    "tcp_bytes_per_step_1node_rank0": int(sent["1 node x 2 ranks"][0]),
                    "tcp_bytes_per_step_1node_rank1": int(sent["1 node x 2 ranks"][1]),
                    "tcp_bytes_per_step_2nodes_rank0": int(sent["2 nodes x 1 rank"][0]),
                    "tcp_bytes_per_step_2nodes_rank1": int(sent["2 nodes x 1 rank"][1]),
                    **planner_columns(per_rank),
                }
            )
            print(summary[-1], flush=True)
    _write(args.out / "multinode_bench.csv", runs)
    _write(args.out / "multinode_summary.csv", summary)


def _write(path: Path, rows: list[dict]) -> None:
    write_rows(path, rows, rounds=1)


if __name__ == "__main__":
    main()
