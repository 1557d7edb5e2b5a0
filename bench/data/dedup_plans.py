"""The multi-index search's plans, timed against the cost model that chooses among them (`index._plan`, with
index.py's SLOT_COST, LOOP_COST, CANDIDATE_COST and BUCKET_COST, in probes): at each size, several plans (pieces and
widths; each piece's slots as the search sets them) are run on the same fingerprints, `--rounds` calls of
`hamming_pairs` each in this process, the plans interleaved in every round (numba's loops compiled before the
clock), beside the model's estimate. The model is right where the plan it picks is the one measured fastest, and
its unit (seconds per estimated probe) is about the same for every plan.

    python bench/data/dedup_plans.py --rounds 3 --csv bench/data/results/dedup_plans.csv

Fingerprints as dedup_scale.py makes them (`--dedup_against`'s shapes: the distinct pool hashes against the eval
images' 20 hashes each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "data"))

from dedup_scale import synthetic  # noqa: E402

from disco_clip_ds.data.curate import copies, index  # noqa: E402
from disco_clip_ds.testing.bench_record import bench_row, write_rows  # noqa: E402

SIZES = [(25_000, 2_500), (100_000, 10_000), (250_000, 25_000), (1_000_000, 100_000)]
PLANS = {  # name: (pieces, width), timed beside the plan the search picks ("picked")
    "3 x 21-22 bits": (3, 21),
    "3 x 20 bits": (3, 20),
    "4 x 16 bits": (4, 16),
    "5 x 12-13 bits": (5, 12),
}


def timed(queries, base, plan) -> float:
    """Seconds of one `hamming_pairs` call under `plan`."""
    picked = index._plan
    index._plan = lambda bits, radius, nq, nb: plan
    try:
        started = time.perf_counter()
        index.hamming_pairs(queries, base, 8)
        return time.perf_counter() - started
    finally:
        index._plan = picked


def size_rows(pool: int, eval_images: int, rounds: int) -> list[dict]:
    """One row per plan at one size: the plans' calls interleaved round by round, each plan's loops compiled first."""
    _, train, reference = synthetic(pool, eval_images, 0)
    queries, base = copies._distinct(train[:, 0]), copies._distinct(reference.reshape(-1, 8))
    chosen = index._plan(64, 8, len(queries), len(base))
    plans = {"picked": chosen}
    for name, (count, width) in PLANS.items():
        plan = (index._pieces(64, count, width), 8 // count)
        if plan != chosen:  # else timed as "picked"
            plans[name] = plan
    for plan in plans.values():
        timed(queries[:100], base[:200], plan)  # compiles what this plan runs
    seconds = {name: [] for name in plans}
    for _ in range(rounds):
        for name, plan in plans.items():
            seconds[name].append(timed(queries, base, plan))
    rows = []
    for name, (pieces, flip_bits) in plans.items():
        cost = sum(index._piece_cost(width, flip_bits, len(queries), len(base)) for _, width in pieces)
        settings = {"pool": pool, "queries": len(queries), "base": len(base), "plan": name}
        settings.update(widths=" ".join(str(w) for _, w in pieces), flip_bits=flip_bits, model_probes=round(cost))
        ns = [t / cost * 1e9 for t in seconds[name]]
        rows.append(bench_row(settings, {"seconds": seconds[name], "ns_per_model_probe": ns}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--csv", default="bench/data/results/dedup_plans.csv")
    args = parser.parse_args()
    rows = []
    for pool, eval_images in SIZES:
        for row in size_rows(pool, eval_images, args.rounds):
            rows.append(row)
            print(json.dumps(row), flush=True)
        write_rows(args.csv, rows)


if __name__ == "__main__":
    main()
