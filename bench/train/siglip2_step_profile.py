"""Where the tiny SigLIP 2 quickstart's step time goes, against the tiny CLIP quickstart's step: the whole step
(forward with the loss, backward, AdamW) and its parts timed alone (each tower's forward + backward; the rest is the
loss and the optimizer), for CLIP (recipes/models/tiny.json: 4 x 4 patches of 16 px + the class token, text padded to
32 positions) and SigLIP 2 (recipes/models/siglip2_tiny.json: patches of 4 px, text padded to 64 positions) at NaFlex
budgets 16, 64, 144 and 256 patches. Interleaved rounds (every case once per round, the order rotating), so that other
load on the machine meets every case alike; medians, and each case's ratio to CLIP's step of the same round.

    python bench/train/siglip2_step_profile.py --rounds 7      # writes results/siglip2_step_profile.csv
    python bench/train/siglip2_step_profile.py --rounds 1 --out /tmp/p.csv   # a smoke run

One process, one torch thread, fp32, batch 128 (the quickstart's per rank), the package's models with their own
single-process losses; the inputs are what the collator hands over (square 64 px demo images), random pixels and
tokens.
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
MODELS = REPO / "recipes" / "models"
BATCH, IMAGE, VOCAB = 128, 64, 539
BUDGETS = (16, 64, 144, 256)
PARTS = ("step", "vision", "text")


def clip_inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, VOCAB, (BATCH, 32), generator=generator)
    pixels = torch.rand(BATCH, 3, IMAGE, IMAGE, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def siglip2_inputs(budget: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    height, width = naflex_size(IMAGE, IMAGE, 4, budget)
    rows, cols = height // 4, width // 4
    mask = (torch.arange(budget) < rows * cols).to(torch.int32).expand(BATCH, -1)
    ids = torch.randint(2, VOCAB, (BATCH, 64), generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.rand(BATCH, budget, 48, generator=generator) * mask[..., None],
        "pixel_attention_mask": mask,
        "spatial_shapes": torch.tensor([[rows, cols]] * BATCH),
    }


def vision_call(model, inputs):
    if "spatial_shapes" in inputs:
        return model.vision_model(
            pixel_values=inputs["pixel_values"],
            pixel_attention_mask=inputs["pixel_attention_mask"],
            spatial_shapes=inputs["spatial_shapes"],
        )
    return model.vision_model(pixel_values=inputs["pixel_values"])


def timed(part: str, model, optimizer, inputs) -> float:
    """Seconds of one PART: the whole optimizer step, or one tower's forward + backward (gradients then dropped)."""
    start = time.perf_counter()
    if part == "step":
        model(**inputs, return_loss=True).loss.backward()
        optimizer.step()
    elif part == "vision":
        vision_call(model, inputs).pooler_output.sum().backward()
    else:
        model.text_model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).pooler_output.sum().backward()
    seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "siglip2_step_profile.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    models = {"clip": build_model(model_config=str(MODELS / "tiny.json"), seed=0)}
    models["siglip2"] = build_model(model_config=str(MODELS / "siglip2_tiny.json"), seed=0)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}
    cases = {("clip", IMAGE // 16 * (IMAGE // 16)): clip_inputs(generator)}
    cases |= {("siglip2", budget): siglip2_inputs(budget, generator) for budget in BUDGETS}
    keys = [(name, size, part) for name, size in cases for part in PARTS]
    for name, size, part in keys:  # warm-up: first-call allocations
        timed(part, models[name], optimizers[name], cases[name, size])
    times = {key: [] for key in keys}
    for r in range(args.rounds):
        for name, size, part in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[name, size, part].append(timed(part, models[name], optimizers[name], cases[name, size]))
    clip_step = times["clip", IMAGE // 16 * (IMAGE // 16), "step"]
    rows = []
    for name, size, part in keys:
        ratios = [t / c for t, c in zip(times[name, size, part], clip_step)]
        inputs = cases[name, size]
        rows.append(
            {
                "case": f"tiny {'CLIP' if name == 'clip' else 'SigLIP 2'} training step (batch {BATCH}, 1 thread)",
                "model": name,
                "patches_per_image": int(inputs["spatial_shapes"][0].prod()) if "spatial_shapes" in inputs else size,
                "text_positions": inputs["input_ids"].shape[1],
                "part": {"step": "whole step", "vision": "vision tower fwd+bwd", "text": "text tower fwd+bwd"}[part],
                "median_s": round(statistics.median(times[name, size, part]), 4),
                "min_s": round(min(times[name, size, part]), 4),
                "max_s": round(max(times[name, size, part]), 4),
                "to_clip_step_median": round(statistics.median(ratios), 3),
                "to_clip_step_min": round(min(ratios), 3),
                "to_clip_step_max": round(max(ratios), 3),
            }
        )
    write_rows(args.out, rows, rounds=args.rounds)
    for row in rows:
        print({k: row[k] for k in ("model", "patches_per_image", "part", "median_s", "to_clip_step_median")})


if __name__ == "__main__":
    main()
