"""Where the optimizer set-up follows OpenCLIP rather than the Trainer's defaults: weight-decay groups and warmup.

Torch only, so that bench/vs_open_clip/same_batches.py can run these exact rules beside open_clip in its own virtualenv.
"""

from __future__ import annotations

from torch.optim.lr_scheduler import LambdaLR

NO_DECAY = ("logit_scale", "class_embedding")  # 0/1-dim CLIP parameters the Trainer's stock list would decay


def without_clip_no_decay(names: list[str]) -> list[str]:
    """The Trainer's decay list (no LayerNorm gains, no biases) minus logit_scale and the class embedding: OpenCLIP's
    set (`open_clip_train/main.py` excludes parameters with ndim < 2, gains, biases and logit_scale)."""
    return [n for n in names if not any(part in n for part in NO_DECAY)]


def warmup_from_first_step(scheduler: LambdaLR, warmup: int) -> LambdaLR:
    """The same schedule with its linear warmup one step earlier: step s < warmup gets lr * (s + 1) / warmup.

    transformers' warmups give step s the factor s / warmup, so the first optimizer step runs at lr 0 and is lost.
    OpenCLIP's (`open_clip_train/scheduler.py`, `_warmup_lr`) starts at lr / warmup and reaches the full lr at step
    warmup - 1; from step `warmup` on both are the same (bench/vs_open_clip/same_batches.py measures
    what the lost step costs)."""
    shifted = [lambda step, f=f: f(step + 1) if step < warmup else f(step) for f in scheduler.lr_lambdas]
    # last_epoch - 1: the constructor steps once, back to where the stock scheduler stands
    shifted_scheduler = LambdaLR(scheduler.optimizer, shifted, last_epoch=scheduler.last_epoch - 1)
    shifted_scheduler.warmup = warmup
    return shifted_scheduler
