"""Where a gap to open_clip comes from: both training loops on the same batches from the same initial weights.

vs_open_clip.py compares the two stacks end to end, where initial weights, data order and the stacks' loops
all differ at once. This bench removes the first two. For each seed it draws one open_clip initialisation of the
tiny CLIP (converted to CLIPModel's layout for our side) and fixed batches of 256 from our data stream, then trains
100 steps in one process, fp32, lr 1e-3, wd 0.1, 10 warmup steps then cosine, clipping at 1.0:

  open_clip        open_clip's model, ClipLoss, parameter groups (open_clip_train/main.py) and cosine_lr
  ours             CLIPModel, the Trainer's decay set minus disco_clip_ds.train.optim.NO_DECAY, transformers' cosine
                   schedule with disco_clip_ds.train.optim.warmup_from_first_step (what disco_clip_ds.train runs)
  ours_hf_warmup   as ours, with transformers' stock warmup (step 0 at lr 0)
  ours_2_readers   as ours, on the batches that 2 ranks reading their own shards (the default) would form

and reports each final training loss (mean of the last 10 steps) and the loss on 10 fixed held-out batches of the
same stream (another seed). That our model and loop equal the Trainer's is checked elsewhere: a real 1-rank
`disco_clip_ds.train` run from the same weights logs the same losses as `ours_hf_warmup` on its batches.

Runs in open_clip's virtualenv for the training (see vs_open_clip.py), ours for drawing the batches:
  .venv/bin/python bench/vs_open_clip/same_batches.py          # writes results/same_batches.csv
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows

import vs_open_clip

REPO = vs_open_clip.REPO
STEPS, BATCH, LR, WD, WARMUP, CLIP_NORM, EVAL_BATCHES = 100, 256, 1e-3, 0.1, 10, 1.0, 10
CONFIGS = ("open_clip", "ours", "ours_hf_warmup", "ours_2_readers")


def draw_batches(data: Path, seed: int, readers: int, steps: int, out: Path) -> None:
    """`steps` global batches from `readers` ShardStreams (rank r of `readers`), concatenated in rank order."""
    import torch
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import ClipCollator
    from disco_clip_ds.data.streams.shards import ShardStream

    urls = sorted(str(p) for p in (data / "train").glob("*.tar"))
    streams = [iter(ShardStream(urls, 64, rank=r, world_size=readers, seed=seed)) for r in range(readers)]
    collate = ClipCollator(AutoTokenizer.from_pretrained(REPO / "recipes" / "tokenizer"), 32)
    batches = []
    for _ in range(steps):
        batch = collate([item for stream in streams for item in itertools.islice(stream, BATCH // readers)])
        batches.append({**batch, "pixel_values": batch["pixel_values"].half()})  # halves the file; both sides alike
    torch.save(batches, out)


def train(config: str, seed: int, batches_file: str, eval_file: str, model_config: str) -> dict:
    """One configuration in open_clip's virtualenv; returns the training losses and the held-out loss."""
    import torch

    from disco_clip_ds.train.optim import warmup_from_first_step, without_clip_no_decay

    open_clip = vs_open_clip._import_open_clip()  # first: transformers imports torchvision too
    from open_clip.loss import ClipLoss
    from open_clip_train.scheduler import cosine_lr
    from transformers import CLIPConfig, CLIPModel, Trainer, get_scheduler

    torch.set_num_threads(1)
    open_clip.add_model_config(model_config)
    torch.manual_seed(seed)
    model = open_clip.create_model(Path(model_config).stem, precision="fp32", output_dict=True)
    batches, held_out = torch.load(batches_file), torch.load(eval_file)
    if config == "open_clip":
        no_decay = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
        params = list(model.named_parameters())
        decay = [p for n, p in params if not no_decay(n, p)]
        optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in params if no_decay(n, p)], "weight_decay": 0.0},
                {"params": decay, "weight_decay": WD},
            ],
            lr=LR,
            betas=(0.9, 0.999),
            eps=1e-8,
        )
        adjust, loss_fn = cosine_lr(optimizer, LR, WARMUP, len(batches)), ClipLoss()

        def loss_of(batch):
            out = model(batch["pixel_values"].float(), batch["input_ids"])
            return loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
    else:
        clip_config = CLIPConfig.from_json_file(str(REPO / "recipes" / "models" / "tiny.json"))
        hf = CLIPModel(clip_config)
        hf.load_state_dict(vs_open_clip.open_clip_to_hf(model.state_dict(), clip_config), strict=True)
        model = hf
        decay_names = set(without_clip_no_decay(Trainer.get_decay_parameter_names(None, model)))
        groups = [
            {"params": [p for n, p in model.named_parameters() if (n in decay_names) == d], "weight_decay": WD * d}
            for d in (False, True)
        ]
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
        scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=WARMUP, num_training_steps=len(batches))
        if config != "ours_hf_warmup":
            scheduler = warmup_from_first_step(scheduler, WARMUP)
        adjust = lambda step: None  # (the scheduler steps after each optimizer step)

        def loss_of(batch):
            return model(
                pixel_values=batch["pixel_values"].float(),
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                return_loss=True,
            ).loss

    losses = []
    for step, batch in enumerate(batches):
        adjust(step)
        loss = loss_of(batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        if config != "open_clip":
            scheduler.step()
        with torch.no_grad():  # open_clip_train clamps the temperature at 100 after each step (never reached here)
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        held = [loss_of(batch).item() for batch in held_out]
    return {"losses": losses, "held_out_loss": sum(held) / len(held)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        print(json.dumps(train(argv[1], int(argv[2]), *argv[3:])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "demo")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "same_batches")
    parser.add_argument(
        "--results", type=Path, default=Path(__file__).resolve().parent / "results" / "same_batches.csv"
    )
    args = parser.parse_args(argv)

    python = vs_open_clip.ensure_openclip_venv(vs_open_clip.OPENCLIP_VENV)
    args.work.mkdir(parents=True, exist_ok=True)
    model_config = vs_open_clip.write_tiny_open_clip_config(args.work)
    held_out = args.work / "held_out.pt"
    draw_batches(args.data, 1000, 1, EVAL_BATCHES, held_out)
    rows = []
    for seed in args.seeds:
        for readers in (1, 2):
            draw_batches(args.data, seed, readers, args.steps, args.work / f"batches_{seed}_{readers}.pt")
        for config in CONFIGS:
            batches = args.work / f"batches_{seed}_{2 if config == 'ours_2_readers' else 1}.pt"
            result = subprocess.run(
                [str(python), __file__, "train", config, str(seed), str(batches), str(held_out), str(model_config)],
                check=True,
                capture_output=True,
                text=True,
                env=vs_open_clip._env(),
            )
            run = json.loads(result.stdout.strip().splitlines()[-1])
            rows.append(
                {
                    "config": config,
                    "seed": seed,
                    "first_loss": round(run["losses"][0], 4),
                    "final_loss": round(sum(run["losses"][-10:]) / len(run["losses"][-10:]), 4),
                    "held_out_loss": round(run["held_out_loss"], 4),
                }
            )
            print(rows[-1], flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        write_rows(args.results, rows, rounds=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
