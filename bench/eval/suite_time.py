"""The suite on the quickstart model over the demo's three tasks: the table `disco-clip eval --tasks` prints, and the
time per task over a few rounds (the model and processor loaded once, as the command loads them).

    OUT=outputs/bench_suite bash recipes/quickstart.sh      # the model (about 3 minutes on 2 CPU ranks)
    OMP_NUM_THREADS=1 python bench/eval/suite_time.py --model outputs/bench_suite --data data/demo --rounds 3

The demo's tasks are `DATA/suite/tasks.yml` (written by `disco-clip data demo`; for a demo built before it had
them, this script writes them from the same samples). Writes bench/eval/results/suite_demo.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from disco_clip_ds.commands.eval import load_for_eval  # noqa: E402
from disco_clip_ds.eval.suite import load_tasks, markdown, run_suite, summary_rows  # noqa: E402
from disco_clip_ds.testing.bench_record import bench_row, write_rows  # noqa: E402


def demo_tasks(data: Path) -> Path:
    """DATA/suite/tasks.yml, written from the demo's samples when the demo was built without it."""
    tasks = data / "suite" / "tasks.yml"
    if not tasks.is_file():
        from disco_clip_ds.data.prep.demo import demo_samples, write_suite_tasks

        pngs, labels, _, train, held = demo_samples(64, 0.2, 0, 0.0)  # the demo's defaults
        write_suite_tasks(data / "suite", pngs, labels, train, held, image_size=64, per_shard=180, seed=0)
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/bench_suite")
    parser.add_argument("--data", default="data/demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--csv", default=str(REPO / "bench/eval/results/suite_demo.csv"))
    args = parser.parse_args()

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
