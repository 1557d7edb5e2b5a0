"""Progressive resolution on the CPU (--resolution_schedule, models/resolution.py): the time of a step at each stage's
side against the last side, and a schedule's total time against the last side throughout, in interleaved rounds (one
timing of each side per round, the order rotating) so that other load on the machine meets every side alike.

    python bench/train/resolution_speed.py                       # writes results/resolution_speed.csv
    python bench/train/resolution_speed.py --rounds 2 --out /tmp/rs.csv   # a smoke run

A step at a side is what the trainer runs for it: the batch made at the last side (as the DataLoader makes it),
resized on the device to the side (`resize_images`), then forward + backward with the position embeddings
interpolated (`interpolate_pos_encoding=True`); at the last side, forward + backward alone.

- tower: a ViT-B image tower (width 768, 12 layers, MLP 3072: ViT-B/16's shape) with Perception Encoder's 14 px
  patches, as 98 and 154 are multiples of 14, not 16; batch 2; forward + backward of the pooled output.
- step: DiscoCLIPModel with that image tower and CLIP ViT-B/16's text tower (width 512, 12 layers, 77 tokens), the
  per-device loss, forward, backward and an AdamW step; batch 2.
- the schedule (Perception Encoder's 0:98,0.35:154,0.7:224, without its 336 px tail): its total time over N steps
  is N x the sum over stages of (share of the steps x one step's time at that side), against N x one step's time at
  224; computed per round from that round's timings, so each round gives one ratio (median and spread over rounds).
  The token ratio and the planner's FLOPs ratio (plan/flops.py) are printed beside each side's time ratio.
One torch thread (the shared cores' load is what the rounds even out), fp32, random pixels and tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPVisionConfig, CLIPVisionModel

from disco_clip_ds.models.clip import DiscoCLIPModel
from disco_clip_ds.models.resolution import ResolutionSchedule, parse_schedule, resize_images
from disco_clip_ds.plan.flops import at_size, model_shape
from disco_clip_ds.testing.bench_record import bench_row, ratios, write_rows

HERE = Path(__file__).resolve().parent
SCHEDULE = "0:98,0.35:154,0.7:224"
VIT_B = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=14)
TEXT_B16 = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8)


def tower_case(final: int, batch: int):
    tower = CLIPVisionModel(CLIPVisionConfig(**VIT_B, image_size=final)).train()
    pixels = torch.randn(batch, 3, final, final)

    def step(side: int) -> None:
        inputs = resize_images(pixels, side)
        tower(pixel_values=inputs, interpolate_pos_encoding=side != final).pooler_output.sum().backward()
        tower.zero_grad(set_to_none=True)

    return "ViT-B/14 image tower fwd+bwd", step


def step_case(final: int, batch: int):
    config = CLIPConfig(text_config=TEXT_B16, vision_config=dict(**VIT_B, image_size=final), projection_dim=512)
    config.loss_impl = "local"
    model = DiscoCLIPModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pixels = torch.randn(batch, 3, final, final)
    ids = torch.randint(2, config.text_config.vocab_size, (batch, config.text_config.max_position_embeddings))

    def step(side: int) -> None:
        inputs = resize_images(pixels, side)
        model(
            pixel_values=inputs, input_ids=ids, interpolate_pos_encoding=side != final, return_loss=True
        ).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return "ViT-B/14 CLIP training step", step, config


def timed(step, side: int) -> float:
    start = time.perf_counter()
    step(side)
    return time.perf_counter() - start


def measure(name, step, sides, shares, rounds: int, flops: dict, tokens: dict) -> list[dict]:
    final = sides[-1]
    for side in sides:  # warm-up: allocator, thread pool, AdamW state
        step(side)
    times = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            times[side].append(timed(step, side))
            print(name, side, round(times[side][-1], 3), flush=True)
    rows = []
    for side in sides:
        settings = {"case": name, "side": side, "tokens_ratio": round(tokens[side] / tokens[final], 4)}
        settings["flops_ratio"] = round(flops[side] / flops[final], 4)
        rows.append(bench_row(settings, {"step_s": times[side], "time_ratio": ratios(times[side], times[final])}))
    schedule = [
        sum(share * times[side][r] for side, share in zip(sides, shares)) / times[final][r] for r in range(rounds)
    ]
    settings = {"case": name, "side": f"schedule {SCHEDULE}", "tokens_ratio": ""}
    settings["flops_ratio"] = round(sum(share * flops[s] for s, share in zip(sides, shares)) / flops[final], 4)
    rows.append(bench_row(settings, {"time_ratio": schedule}))
    for row in rows:
        print(row, flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "resolution_speed.csv")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    schedule = ResolutionSchedule(parse_schedule(SCHEDULE), 100)
    sides = [size for size, _ in schedule.steps_per_stage()]
    shares = [steps / 100 for _, steps in schedule.steps_per_stage()]
    final = sides[-1]
    name, step, config = step_case(final, args.batch)
    whole = model_shape(config)
    shapes = {side: at_size(whole, side) for side in sides}
    tokens = {side: shapes[side].towers["vision"]["tokens"] for side in sides}
    tower_flops = {side: shapes[side].training_flops_per_sample()["vision"] for side in sides}
    step_flops = {side: sum(shapes[side].training_flops_per_sample().values()) for side in sides}
    rows = measure(*tower_case(final, args.batch), sides, shares, args.rounds, tower_flops, tokens)
    rows += measure(name, step, sides, shares, args.rounds, step_flops, tokens)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
