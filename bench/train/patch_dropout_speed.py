"""FLIP's patch dropout on the CPU: time of the image tower's forward + backward, and of a whole training step, with
patch dropout p against p = 0, measured in interleaved rounds (one timing of each p per round, the order rotating)
so that other load on the machine meets every p alike; medians over rounds, ratios to p = 0 within each round.

    python bench/train/patch_dropout_speed.py                  # writes results/patch_dropout_speed.csv
    python bench/train/patch_dropout_speed.py --rounds 2 --out /tmp/pd.csv   # a smoke run

- tower: a ViT-B/16-shaped CLIP image tower (224 px, 16 px patches: 196 patches + the class token; width 768, 12
  layers, MLP 3072), forward + backward of the pooled output, batch 4.
- step: the package's DiscoCLIPModel with CLIP's per-device loss, forward, backward and an AdamW step, for the demo's
  tiny CLIP (recipes/models/tiny.json, batch 128) and ViT-B/32 (recipes/models/vit_b32.json, batch 8).
One torch thread (the shared cores' load is what the rounds even out), fp32, random pixels and tokens; the kept
patches are drawn per sample as the data stream draws them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPVisionConfig

from disco_clip_ds.models.clip import DiscoCLIPModel
from disco_clip_ds.models.patch_dropout import PatchDropout, draw_kept_patches, patch_counts
from disco_clip_ds.testing.bench_record import write_rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RATES = (0.0, 0.5, 0.75)
VIT_B16 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)


def kept(vision_config, rate: float, batch: int) -> torch.Tensor | None:
    patches = patch_counts(vision_config, rate)
    if patches is None:
        return None
    rng = random.Random(0)
    return torch.stack([draw_kept_patches(*patches, rng) for _ in range(batch)])


def tower_case(batch: int = 4):
    """(name, tokens seen per rate, a callable(rate) timing one forward + backward of a ViT-B/16 image tower)."""
    from transformers import CLIPVisionModel

    config = CLIPVisionConfig(**VIT_B16, image_size=224, patch_size=16)
    tower = CLIPVisionModel(config).train()
    dropout = PatchDropout(tower.embeddings, class_tokens=1)
    pixels = torch.randn(batch, 3, 224, 224)
    masks = {rate: kept(config, rate, batch) for rate in RATES}

    def step(rate: float) -> None:
        with dropout.kept(masks[rate]):
            tower(pixel_values=pixels).pooler_output.sum().backward()
        tower.zero_grad(set_to_none=True)

    return "ViT-B/16 image tower fwd+bwd (batch 4)", step


def training_step_case(model_json: Path, batch: int, label: str):
    """A whole training step of the model at `model_json` (DiscoCLIPModel, local loss, AdamW)."""
    config = CLIPConfig.from_json_file(str(model_json))
    config.loss_impl = "local"
    model = DiscoCLIPModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vision, text = config.vision_config, config.text_config
    inputs = {
        "pixel_values": torch.randn(batch, 3, vision.image_size, vision.image_size),
        "input_ids": torch.randint(2, text.vocab_size, (batch, text.max_position_embeddings)),
    }
    masks = {rate: kept(vision, rate, batch) for rate in RATES}

    def step(rate: float) -> None:
        model(**inputs, patch_keep=masks[rate], return_loss=True).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return f"{label} training step (batch {batch})", step


def timed(step, rate: float) -> float:
    start = time.perf_counter()
    step(rate)
    return time.perf_counter() - start


def measure(case, rounds: int) -> list[dict]:
    name, step = case
    for rate in RATES:  # warm-up: allocator, thread pool, AdamW state
        step(rate)
    times = {rate: [] for rate in RATES}
    for r in range(rounds):
        order = RATES[r % len(RATES) :] + RATES[: r % len(RATES)]
        for rate in order:
            times[rate].append(timed(step, rate))
    rows = []
    for rate in RATES:
        ratios = [t / base for t, base in zip(times[rate], times[0.0])]
        rows.append(
            {
                "case": name,
                "patch_dropout": rate,
                "rounds": rounds,
                "median_s": round(statistics.median(times[rate]), 4),
                "min_s": round(min(times[rate]), 4),
                "ratio_to_p0_median": round(statistics.median(ratios), 3),
                "ratio_to_p0_min": round(min(ratios), 3),
                "ratio_to_p0_max": round(max(ratios), 3),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "patch_dropout_speed.csv")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = [
        tower_case(),
        training_step_case(REPO / "recipes/models/tiny.json", 128, "demo tiny CLIP"),
        training_step_case(REPO / "recipes/models/vit_b32.json", 8, "ViT-B/32 CLIP"),
    ]
    rows = [row for case in cases for row in measure(case, args.rounds)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.out, rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
