"""SigLIP 2 (NaFlex) on the CPU: time of a training step of the demo's tiny SigLIP 2 (recipes/models/siglip2_tiny.json)
at patch budgets 64, 144 and 256, measured in interleaved rounds (one timing of each budget per round, the order
rotating) so that other load on the machine meets every budget alike; medians over rounds, samples/s from them.

    python bench/train/naflex_speed.py                  # writes results/naflex_speed.csv
    python bench/train/naflex_speed.py --rounds 2 --out /tmp/nf.csv   # a smoke run

The step: the package's DiscoSiglip2Model with the global sigmoid loss (one process), forward, backward and an AdamW
step, batch 128 (the quickstart's per rank), one torch thread, fp32. Its inputs are what the collator hands over:
the demo's square 64 px images become 8 x 8, 12 x 12 and 16 x 16 patches of 4 px at the three budgets (NaFlex keeps
their aspect ratio), padded to the budget; random pixels and tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from disco_clip_ds.data.naflex import naflex_size
from disco_clip_ds.models.build import build_model
from disco_clip_ds.testing.bench_record import write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = REPO / "recipes" / "models" / "siglip2_tiny.json"
BUDGETS, BATCH, IMAGE = (64, 144, 256), 128, 64


def batch(budget: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The collated batch of BATCH square IMAGE px images at `budget` (as data/naflex.py builds it)."""
    height, width = naflex_size(IMAGE, IMAGE, 4, budget)
    rows, cols = height // 4, width // 4
    mask = (torch.arange(budget) < rows * cols).to(torch.int32).expand(BATCH, -1)
    pixels = torch.rand(BATCH, budget, 48, generator=generator) * mask[..., None]
    ids = torch.randint(2, 539, (BATCH, 64), generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "pixel_attention_mask": mask,
        "spatial_shapes": torch.tensor([[rows, cols]] * BATCH),
    }


def step_time(model, optimizer, inputs) -> float:
    start = time.perf_counter()
    loss = model(**inputs, return_loss=True).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "naflex_speed.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(model_config=str(CONFIG), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    inputs = {budget: batch(budget, generator) for budget in BUDGETS}
    for budget in BUDGETS:  # warm-up: first-call allocations
        step_time(model, optimizer, inputs[budget])
    times = {budget: [] for budget in BUDGETS}
    for r in range(args.rounds):
        order = BUDGETS[r % len(BUDGETS) :] + BUDGETS[: r % len(BUDGETS)]
        for budget in order:
            times[budget].append(step_time(model, optimizer, inputs[budget]))
    rows = []
    for budget in BUDGETS:
        median = statistics.median(times[budget])
        rows.append(
            {
                "case": f"demo tiny SigLIP 2 training step (batch {BATCH})",
                "max_num_patches": budget,
                "patches_per_image": int(inputs[budget]["spatial_shapes"][0].prod()),
                "rounds": args.rounds,
                "median_s": round(median, 4),
                "min_s": round(min(times[budget]), 4),
                "samples_per_s": round(BATCH / median, 1),
                "ratio_to_256_median": round(median / statistics.median(times[256]), 3),
            }
        )
    write_rows(args.out, rows, rounds=args.rounds)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
