"""Gradient accumulation with FLIP's patch dropout: how far each stack's accumulated gradient is from the gradient of
one batch of all pairs.

open_clip 3.3.0's PatchDropout draws its mask from torch's global generator at every forward. Its accumulation
(open_clip_train/train.py, accum_freq > 1) first embeds each micro-batch without gradients, then runs each one again
with gradients and back-propagates the loss over all cached features: the second forward draws new masks, so the
gradient is that of no single set of masks. Ours draws each sample's mask from (seed, sample, pass), so both passes
see the same mask (disco_clip_ds/models/patch_dropout.py).

On one batch of 256 pairs of the demo data, the tiny CLIP, fp32, one process:

  open_clip    the gradient of its accumulation with accum_freq 4 (micro-batches of 64), as its train loop computes
               it, against (a) its accum_freq 1 on the same batch, seeded alike, and (b) the exact gradient for the
               masks its first pass drew (the same loop with the generator's state replayed for each second forward);
               and, for scale, accum_freq 1 against accum_freq 1 under another seed (other masks)
  ours         the weight update of one SGD step of `python -m disco_clip_ds.train` with K = 4 x 64 against 1 x 256
               (SGD at a constant rate, no weight decay or clipping: the update is the gradient times the rate)

each with patch dropout 0.5 and 0 (the control: without patch dropout both accumulations are exact). The figure is
the relative difference |g - g_ref| / |g_ref| over the towers' parameters (open_clip) or all of them (ours). open_clip's
logit_scale is reported apart: each of its K backward passes carries the whole loss's logit_scale gradient, so its
accumulated logit_scale gradient is K times the one-batch one, with or without patch dropout.

    .venv/bin/python bench/vs_open_clip/patch_dropout_accumulation.py    # writes results/patch_dropout_accumulation.csv
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import same_batches

from disco_clip_ds.testing.bench_record import write_rows

import vs_open_clip

REPO = vs_open_clip.REPO
MICRO, K, RATE, SEED = 64, 4, 0.5, 0


def open_clip_gradients(batch_file: str, model_config: str, rate: float) -> dict:
    """In open_clip's virtualenv: the relative differences of its accumulated gradient (see the module docstring)."""
    import torch

    open_clip = vs_open_clip._import_open_clip()
    from open_clip.loss import ClipLoss

    torch.set_num_threads(1)
    open_clip.add_model_config(model_config)
    torch.manual_seed(SEED)
    model = open_clip.create_model(
        Path(model_config).stem, precision="fp32", output_dict=True, force_patch_dropout=rate
    )
    model.train()
    batch = torch.load(batch_file)[0]
    images, texts = batch["pixel_values"].float(), batch["input_ids"]
    loss_fn = ClipLoss()

    def gradients() -> dict:
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def one_batch(seed: int) -> dict:
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        out = model(images, texts)
        loss_fn(out["image_features"], out["text_features"], out["logit_scale"]).backward()
        return gradients()

    def accumulated(seed: int, replay: bool) -> dict:
        """open_clip_train/train.py's accum_freq loop; `replay`: each second forward redraws its first one's masks."""
        torch.manual_seed(seed)
        micro = [(images[i : i + MICRO], texts[i : i + MICRO]) for i in range(0, len(images), MICRO)]
        states, cached = [], []
        with torch.no_grad():
            for image, text in micro:
                states.append(torch.get_rng_state())
                out = model(image, text)
                cached.append((out["image_features"], out["text_features"]))
        model.zero_grad(set_to_none=True)
        for j, (image, text) in enumerate(micro):
            if replay:
                torch.set_rng_state(states[j])
            out = model(image, text)
            image_all = torch.cat([out["image_features"] if i == j else c[0] for i, c in enumerate(cached)])
            text_all = torch.cat([out["text_features"] if i == j else c[1] for i, c in enumerate(cached)])
            loss_fn(image_all, text_all, out["logit_scale"]).backward()
        return gradients()

    def towers(grads: dict) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for n, g in grads.items() if n != "logit_scale"])

    rel = lambda a, b: ((towers(a) - towers(b)).norm() / towers(b).norm()).item()
    g1, g1_other = one_batch(SEED), one_batch(SEED + 1)
    g4, g4_replayed = accumulated(SEED, replay=False), accumulated(SEED, replay=True)
    return {
        "towers: accum_4 vs accum_1": rel(g4, g1),
        "towers: accum_4 vs exact for its first masks": rel(g4, g4_replayed),
        "towers: accum_1 vs accum_1 under another seed": rel(g1_other, g1),
        # each of the K backward passes carries the whole loss's logit_scale gradient
        "logit_scale gradient: accum_4 / accum_1": (g4["logit_scale"] / g1["logit_scale"]).item(),
    }


def our_updates(work: Path, rate: float) -> dict:
    """Two one-step runs of disco_clip_ds.train (K = 4 x 64 and 1 x 256, SGD) from one initialisation."""
    from disco_clip_ds.testing.launch import SGD, launch_in_one_process
    from disco_clip_ds.testing.runs import save_initial_model, weights

    init = save_initial_model(work / "init", SEED)
    common = [
        "--model_name_or_path", str(init), "--train_shards", str(REPO / "data/demo/train"), "--max_steps", "1",
        *SGD, "--patch_dropout", str(rate), "--report_to", "none",
    ]  # fmt: skip
    micro = lambda b, k: ["--per_device_train_batch_size", str(b), "--gradient_accumulation_steps", str(k)]
    runs = {"k1": work / f"k1_p{rate:g}", "k4": work / f"k4_p{rate:g}"}
    for folder in runs.values():  # each run afresh (an output_dir holding checkpoints is refused)
        shutil.rmtree(folder, ignore_errors=True)
    launch_in_one_process([(runs["k1"], [*common, *micro(MICRO * K, 1)]), (runs["k4"], [*common, *micro(MICRO, K)])])
    w0, w1, w4 = weights(init), weights(runs["k1"]), weights(runs["k4"])
    import torch

    u1 = torch.cat([(w1[n] - w0[n]).reshape(-1) for n in w0])
    u4 = torch.cat([(w4[n] - w0[n]).reshape(-1) for n in w0])
    return {"all parameters: K 4 x 64 vs 1 x 256": ((u4 - u1).norm() / u1.norm()).item()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["open_clip"]:
        print(json.dumps(open_clip_gradients(argv[1], argv[2], float(argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "patch_dropout_accumulation")
    parser.add_argument(
        "--results", type=Path, default=Path(__file__).resolve().parent / "results" / "patch_dropout_accumulation.csv"
    )
    args = parser.parse_args(argv)
    python = vs_open_clip.ensure_openclip_venv(vs_open_clip.OPENCLIP_VENV)
    args.work.mkdir(parents=True, exist_ok=True)
    model_config = vs_open_clip.write_tiny_open_clip_config(args.work)
    batch_file = args.work / "batch.pt"
    same_batches.draw_batches(REPO / "data" / "demo", SEED, 1, 1, batch_file)
    rows = []
    for rate in (RATE, 0.0):
        command = [str(python), __file__, "open_clip", str(batch_file), str(model_config), str(rate)]
        found = subprocess.run(command, check=True, capture_output=True, text=True, env=vs_open_clip._env())
        for name, value in json.loads(found.stdout.strip().splitlines()[-1]).items():
            rows.append({"stack": "open_clip 3.3.0", "patch_dropout": rate, "comparison": name, "value": value})
        for name, value in our_updates(args.work, rate).items():
            rows.append({"stack": "disco-clip-ds", "patch_dropout": rate, "comparison": name, "value": value})
    for row in rows:
        print(f"{row['stack']:<16} p={row['patch_dropout']:<4} {row['comparison']:<48} {row['value']:.3g}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.results, rows, rounds=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
