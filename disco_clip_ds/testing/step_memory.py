"""Measure the CPU peak memory of one CLIPModel training step, in a fresh process.

    python -m disco_clip_ds.testing.step_memory --model recipes/models/vit_b32.json --batch 8
        [--activation_checkpointing] [--mode fwdbwd|train] [--patch_dropout P] [--teacher CONFIG]

Prints one JSON line. The number is peak resident memory (Linux VmHWM, reset through /proc/self/clear_refs)
minus the resident memory just before the measured region, in MiB. Run it with MALLOC_MMAP_THRESHOLD_=65536
(main() re-executes itself with it) so that glibc serves every large tensor with mmap and returns it on free:
RSS then tracks what torch holds instead of what the allocator keeps cached.

- fwdbwd: model and (persistent) gradients exist before the region; the region is one forward+backward at
  --batch with the model's own contrastive loss. Its delta is the activation memory (plus the B x B loss,
  negligible at these batch sizes); bench/plan/act_fit.py fits per-sample coefficients on it.
- train: the region starts after the imports, before the model is built; it covers building the model and
  two AdamW steps at --batch, gradients kept allocated between steps as DeepSpeed's ZeRO buffers are. This is
  the whole-step peak the planner's world-size-1 fp32 estimate is checked against (tests/test_plan.py,
  bench/plan/plan_check.py). With --teacher, a frozen distillation teacher of that config is built in the region
  too, and each step first runs its no-grad forward on inputs of its own size and keeps its embeddings until the
  optimizer step, as a live teacher does in training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from disco_clip_ds.testing.memory import mmap_threshold_env, reset_peak_rss, rss_mib

MMAP_ENV = mmap_threshold_env(65536)


def _inputs(config, batch: int, dtype, patch_dropout: float):
    import random

    import torch

    from disco_clip_ds.models.patch_dropout import draw_kept_patches, patch_counts

    vision, text = config.vision_config, config.text_config
    pixels = torch.randn(batch, vision.num_channels, vision.image_size, vision.image_size, dtype=dtype)
    ids = torch.randint(0, text.vocab_size, (batch, text.max_position_embeddings))
    inputs = {"pixel_values": pixels, "input_ids": ids}
    patches = patch_counts(vision, patch_dropout)
    if patches:
        rng = random.Random(0)
        inputs["patch_keep"] = torch.stack([draw_kept_patches(*patches, rng) for _ in range(batch)])
    return inputs


def _step(model, config, batch: int, patch_dropout: float) -> None:
    out = model(**_inputs(config, batch, model.dtype, patch_dropout), return_loss=True)
    out.loss.backward()


def _frozen(config):
    from disco_clip_ds.models.clip import DiscoCLIPModel

    config.loss_impl = "local"
    return DiscoCLIPModel(config).requires_grad_(False).eval()


def _teacher_embeddings(teacher, batch: int):
    """The teacher's embeddings of a batch of its own inputs, as `train.distill.Teacher.embed` computes them."""
    out = teacher(**_inputs(teacher.config, batch, teacher.dtype, 0.0), return_loss=False, return_logits=False)
    return out.image_embeds.float(), out.text_embeds.float()


def measure(
    model_path: str,
    batch: int,
    mode: str,
    activation_checkpointing: bool,
    dtype: str = "fp32",
    patch_dropout: float = 0.0,
    teacher_path: str | None = None,
) -> dict:
    """The peak memory of one training step of the CLIPModel at MODEL_PATH (as the package's DiscoCLIPModel, with
    CLIP's own per-device loss) on BATCH samples (this module's docstring says what MODE and the result hold)."""
    import torch
    from transformers import CLIPConfig

    from disco_clip_ds.models.clip import DiscoCLIPModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = CLIPConfig.from_json_file(model_path)
    config.loss_impl = "local"
    base = reset_peak_rss()
    model = DiscoCLIPModel(config).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).train()
    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if mode == "fwdbwd":
        _step(model, config, 1, patch_dropout)  # materialise gradients and lazy buffers outside the region
        base = reset_peak_rss()
        _step(model, config, batch, patch_dropout)
    else:
        teacher = _frozen(CLIPConfig.from_json_file(teacher_path)) if teacher_path else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)
            kept = _teacher_embeddings(teacher, batch) if teacher is not None else None  # noqa: F841 (held)
            _step(model, config, batch, patch_dropout)
            optimizer.step()
            del kept
    peak = rss_mib("VmHWM")
    return {
        "model": model_path,
        "batch": batch,
        "mode": mode,
        "activation_checkpointing": activation_checkpointing,
        "dtype": dtype,
        "patch_dropout": patch_dropout,
        "teacher": teacher_path,
        "params": sum(p.numel() for p in model.parameters()),
        "base_mib": round(base, 2),
        "peak_mib": round(peak, 2),
        "delta_mib": round(peak - base, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="CLIPConfig JSON")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--mode", choices=["fwdbwd", "train"], default="fwdbwd")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="weights, inputs and activations (bf16: checks the planner's halving)",
    )
    parser.add_argument("--patch_dropout", type=float, default=0.0, help="fraction of image patches dropped")
    parser.add_argument("--teacher", help="CLIPConfig JSON of a frozen distillation teacher (--mode train)")
    args = parser.parse_args(argv)
    if MMAP_ENV.items() - os.environ.items():  # glibc reads it when the process starts: re-exec with it
        os.execve(
            sys.executable, [sys.executable, "-m", __spec__.name, *(argv or sys.argv[1:])], {**os.environ, **MMAP_ENV}
        )
    result = measure(
        args.model, args.batch, args.mode, args.activation_checkpointing, args.dtype, args.patch_dropout, args.teacher
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
