"""The multi-index search's plans, timed against the cost model that chooses among them (`index._plan`, with
index.py's SLOT_COST, LOOP_COST, CANDIDATE_COST and BUCKET_COST, in probes): at each size, several plans (pieces and
widths; each piece's slots as the search sets them) are run on the same fingerprints, each timed as the best of
`--rounds` calls of `hamming_pairs` in this process (numba's loops compiled before the clock), beside the model's
estimate. The model is right where the plan it picks is the one measured fastest, and its unit (seconds per probe)
is about the same for every plan.

    python bench/data/dedup_plans.py --rounds 2 --csv bench/data/results/dedup_plans.csv

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
from disco_clip_ds.testing.bench_record import write_rows  # noqa: E402

SIZES = [(25_000, 2_500), (100_000, 10_000), (250_000, 25_000), (1_000_000, 100_000)]
PLANS = {  # name: (pieces, width); None: the plan the search picks
    "picked": None,
    "3 x 21-22 bits": (3, 21),
    "3 x 20 bits": (3, 20),
    "4 x 16 bits": (4, 16),
    "5 x 12-13 bits": (5, 12),
}


def timed(queries, base, plan, rounds: int) -> float:
    picked = index._plan
    if plan is not None:
        index._plan = lambda bits, radius, nq, nb: plan
    try:
        index.hamming_pairs(queries[:100], base[:200], 8)  # compiles what this plan runs
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            index.hamming_pairs(queries, base, 8)
            best = min(best, time.perf_counter() - started)
        return best
    finally:
        index._plan = picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--csv", default="bench/data/results/dedup_plans.csv")
    args = parser.parse_args()
    rows = []
    for pool, eval_images in SIZES:
        _, train, reference = synthetic(pool, eval_images, 0)
        queries, base = copies._distinct(train[:, 0]), copies._distinct(reference.reshape(-1, 8))
        chosen = index._plan(64, 8, len(queries), len(base))
        for name, shape in PLANS.items():
            plan = chosen if shape is None else (index._pieces(64, shape[0], shape[1]), 8 // shape[0])
            if shape is not None and plan == chosen:
                continue  # timed as "picked"
            cost = sum(index._piece_cost(width, plan[1], len(queries), len(base)) for _, width in plan[0])
            seconds = timed(queries, base, plan, args.rounds)
            row = {"pool": pool, "queries": len(queries), "base": len(base), "plan": name}
            row.update(widths=" ".join(str(w) for _, w in plan[0]), flip_bits=plan[1], model_probes=round(cost))
            row.update(seconds=round(seconds, 4), ns_per_model_probe=round(seconds / cost * 1e9, 2))
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
            write_rows(args.csv, rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
