"""The suite on the quickstart model over the demo's three tasks: the table `disco-clip eval --tasks` prints, and the
time per task over a few rounds (the model and processor loaded once, as the command loads them).

    OUT=outputs/bench_suite bash recipes/quickstart.sh      # the model (about 3 minutes on 2 CPU ranks)
    OMP_NUM_THREADS=1 python bench/eval/suite_time.py --model outputs/bench_suite --data data/demo --rounds 3

The demo's tasks are `DATA/suite/tasks.yml` (written by `disco-clip data demo`; for a demo built before it had
them, this script writes them from the same samples). Writes bench/eval/results/suite_demo.csv.

With `--ranks 1 2` it measures the suite's wall time on 1 rank against 2 (spawned gloo CPU ranks, one thread each,
the model loaded and warmed up on the first task before the clock starts; the clock runs from a barrier before the
suite to a barrier after it), for each `--code LABEL=PATH` (a checkout of the package, e.g. the base commit's:
`git worktree add /tmp/base 9b87829`), every side interleaved in each round; it checks that 2 ranks give 1 rank's
records, and writes bench/eval/results/suite_ranks.csv:

    OMP_NUM_THREADS=1 python bench/eval/suite_time.py --model outputs/bench_suite_model --data data/demo \
        --ranks 1 2 --code base=/tmp/base_suite --code this=. --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from disco_clip_ds.commands.eval import load_for_eval
from disco_clip_ds.eval.suite import load_tasks, markdown, run_suite, summary_rows
from disco_clip_ds.testing.bench_record import bench_row, write_rows

REPO = Path(__file__).resolve().parents[2]


def demo_tasks(data: Path) -> Path:
    """DATA/suite/tasks.yml, written from the demo's samples when the demo was built without it."""
    tasks = data / "suite" / "tasks.yml"
    if not tasks.is_file():
        from disco_clip_ds.data.prep.demo import demo_samples, write_suite_tasks

        pngs, labels, _, train, held = demo_samples(64, 0.2, 0, 0.0)  # the demo's defaults
        write_suite_tasks(data / "suite", pngs, labels, train, held, image_size=64, per_shard=180, seed=0)
    return tasks


def timed_suite(rank: int, world: int, model: str, tasks_file: str, batch_size: int) -> dict:
    """In a spawned rank: load the model, warm up on the first task, then time the suite between two barriers."""
    import time

    import torch.distributed as dist

    from disco_clip_ds.commands.eval import load_for_eval
    from disco_clip_ds.eval.suite import load_tasks, run_suite

    tasks = load_tasks(tasks_file)
    loaded = load_for_eval(model)
    run_suite(tasks[:1], *loaded, batch_size=batch_size, progress=False)  # torch's one-time costs, off the clock
    dist.barrier()
    started = time.perf_counter()
    results = run_suite(tasks, *loaded, batch_size=batch_size, progress=False)
    dist.barrier()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "records": [r.record for r in results], "errors": [str(r.error or "") for r in results]}


def side(args, tasks_file: Path) -> None:
    """One side of one round (`--side N`, in its own process, whose PYTHONPATH picks the code): the suite on N
    spawned ranks; prints one JSON line."""
    from disco_clip_ds.testing.ranks import run_ranks

    out = run_ranks(timed_suite, args.side, args.model, str(tasks_file), args.batch_size, timeout=1800)
    records = [rank["records"] for rank in out]
    errors = [error for rank in out for error in rank["errors"] if error]
    package = str(Path(sys.modules["disco_clip_ds"].__file__).parents[1])
    summary = {"seconds": max(r["seconds"] for r in out), "records": records, "errors": errors, "package": package}
    print(json.dumps(summary))


def compare_ranks(args) -> None:
    """Each rank count of `args.ranks` for each code, interleaved in every round (each side a fresh process: the
    code is its PYTHONPATH); the first rank count is the reference of the ratios and of the records."""
    codes = dict(code.split("=", 1) for code in args.code) or {"this": str(REPO)}
    seconds = {(label, n): [] for label in codes for n in args.ranks}
    equal = {label: True for label in codes}
    for round_ in range(args.rounds):
        for label, path in codes.items():
            reference = None
            for n in args.ranks:
                got = _run_side(args, n, Path(path).resolve())
                if got["errors"]:
                    raise SystemExit(f"{label}, {n} ranks: a task failed: {got['errors'][0]}")
                seconds[label, n].append(got["seconds"])
                reference = reference or got["records"][0]
                equal[label] &= all(records == reference for records in got["records"])
                print(f"round {round_}: {label} ({got['package']}), {n} ranks: {got['seconds']:.2f} s", flush=True)
        _write_ranks(args, codes, seconds, equal)  # after every round: a stopped run keeps the rounds it made


def _write_ranks(args, codes: dict, seconds: dict, equal: dict) -> None:
    from disco_clip_ds.testing.bench_record import ratios

    rows = []
    for label in codes:
        for n in args.ranks:
            settings = {"model": args.model, "code": label, "ranks": n, "threads_per_rank": 1}
            settings["records_equal_to_first"] = equal[label]
            times = seconds[label, n]
            rows.append(bench_row(settings, {"seconds": times, "ratio": ratios(times, seconds[label, args.ranks[0]])}))
            row = rows[-1]
            print(
                f"{label}, {n} ranks: {row['seconds_median']} s ({row['seconds_min']}-{row['seconds_max']}), "
                f"x{row['ratio_median']} of {args.ranks[0]} ({row['ratio_min']}-{row['ratio_max']})"
            )
    write_rows(args.csv or REPO / "bench/eval/results/suite_ranks.csv", rows)


def _run_side(args, n: int, code: Path) -> dict:
    command = [sys.executable, __file__, "--side", str(n), "--model", args.model, "--data", args.data]
    command += ["--batch_size", str(args.batch_size)]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--side {n} with {code} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/bench_suite")
    parser.add_argument("--data", default="data/demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--csv", help="default results/suite_demo.csv, with --ranks results/suite_ranks.csv")
    parser.add_argument("--ranks", type=int, nargs="+", help="compare the suite's wall time on these rank counts")
    parser.add_argument("--code", action="append", default=[], help="with --ranks: LABEL=PATH of a package checkout")
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)  # one side of --ranks, in its own process
    args = parser.parse_args()
    if args.side:
        return side(args, demo_tasks(Path(args.data)))
    if args.ranks:
        return compare_ranks(args)
    args.csv = args.csv or str(REPO / "bench/eval/results/suite_demo.csv")

    tasks = load_tasks(demo_tasks(Path(args.data)))
    model, tokenizer, image_processor = load_for_eval(args.model)
    rounds = [
        run_suite(tasks, model, tokenizer, image_processor, batch_size=args.batch_size, progress=False)
        for _ in range(args.rounds)
    ]
    failed = [r for results in rounds for r in results if r.error is not None]
    if failed:
        raise SystemExit(f"task {failed[0].task.key} failed: {failed[0].error}")
    table = summary_rows(rounds[0])
    print(markdown(table), end="")
    if any(results[i].value != rounds[0][i].value for results in rounds for i in range(len(tasks))):
        raise SystemExit("the main metrics differ between rounds: the evaluation is not deterministic")
    rows = []
    for i, task in enumerate(tasks):
        settings = {"model": args.model, "task": task.key, "type": task.type, "main_metric": task.main_metric}
        settings["value"] = round(rounds[0][i].value, 4)
        rows.append(bench_row(settings, {"seconds": [results[i].seconds for results in rounds]}))
    totals = [sum(r.seconds for r in results) for results in rounds]
    average = {
        "model": args.model,
        "task": "average",
        "type": "",
        "main_metric": "",
        "value": round(table[-1]["value"], 4),
    }
    rows.append(bench_row(average, {"seconds": totals}))
    print("\nseconds per task (min / median / max over rounds):")
    for row in rows:
        print(f"  {row['task']}: {row['seconds_min']} / {row['seconds_median']} / {row['seconds_max']}")
    write_rows(args.csv, rows)


if __name__ == "__main__":
    main()
