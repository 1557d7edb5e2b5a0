"""The optimizer and step settings: --save_steps, --learning_rate, --weight_decay and the per-tower ones (against a
DeepSpeed JSON's own optimizer), --optim lamb (likewise), --patch_dropout, --torch_compile, and --push_to_hub's
token."""

from __future__ import annotations

import math

from disco_clip_ds.checkpoint.resume import TOWER_FLAGS
from disco_clip_ds.errors import ExportError, UsageError
from disco_clip_ds.train.args import DiscoTrainingArguments


def check_save_steps(args: DiscoTrainingArguments) -> None:
    if args.save_strategy == "steps" and args.save_steps <= 0:
        raise UsageError(f"--save_steps {args.save_steps:g}: give a positive number, or --save_strategy no")


def check_learning_rates(args: DiscoTrainingArguments, deepspeed: dict | None) -> None:
    """--learning_rate, --weight_decay and the per-tower settings; `deepspeed`: the run's DeepSpeed JSON."""
    # A non-finite or absurd rate trains on to exit 0 with NaN weights; refuse it before any work.
    if not (math.isfinite(args.learning_rate) and 0 < args.learning_rate <= 1):
        raise UsageError(
            f"--learning_rate {args.learning_rate:g}: give a finite number in (0, 1]; CLIP trains at 1e-4 to 1e-3"
        )
    if not (math.isfinite(args.weight_decay) and 0 <= args.weight_decay * args.learning_rate < 1):
        raise UsageError(
            f"--weight_decay {args.weight_decay:g}: give a finite number of at least 0 and below 1 / --learning_rate "
            "(AdamW scales the weights by 1 - lr x wd every step); CLIP uses 0.1 to 0.2"
        )
    for tower in ("vision", "text"):
        lr, wd, decay = (getattr(args, f"{tower}_{what}") for what in ("lr", "weight_decay", "layer_decay"))
        if lr is not None and not (math.isfinite(lr) and 0 < lr <= 1):
            raise UsageError(f"--{tower}_lr {lr:g}: give a finite number in (0, 1], or leave it to --learning_rate")
        if wd is not None and not (math.isfinite(wd) and 0 <= wd * (lr or args.learning_rate) < 1):
            raise UsageError(
                f"--{tower}_weight_decay {wd:g}: give a finite number of at least 0 and below 1 / the tower's "
                "learning rate, or leave it to --weight_decay"
            )
        if not (math.isfinite(decay) and 0 < decay <= 1):
            raise UsageError(
                f"--{tower}_layer_decay {decay:g}: give a number in (0, 1] (1: no decay; EVA-CLIP 0.75-0.85)"
            )
    towers = [f"--{flag}" for flag, default in TOWER_FLAGS.items() if getattr(args, flag) != default]
    if towers and "optimizer" in (deepspeed or {}):
        raise UsageError(
            f'{" ".join(towers)}: the --deepspeed config\'s "optimizer" block makes DeepSpeed build the optimizer '
            "over one parameter group; remove that block so that the Trainer builds it with the per-tower groups"
        )


def check_own_optimizer(args: DiscoTrainingArguments, deepspeed: dict | None) -> None:
    """--optim lamb: built by DiscoTrainer (train/lamb.py), so neither DeepSpeed's optimizer block nor --optim_args."""
    if args.optim != "lamb":
        return
    block = (deepspeed or {}).get("optimizer")
    if block is not None:
        kind = block.get("type") if isinstance(block, dict) else None
        why = (
            "DeepSpeed's own Lamb, a fused CUDA op that under ZeRO takes its trust ratio per flat partition"
            if str(kind).lower() == "lamb"
            else f"its {kind} optimizer, not LAMB"
        )
        raise UsageError(
            f'--optim lamb: the --deepspeed config\'s "optimizer" block would make DeepSpeed build {why}; remove '
            "that block so that the Trainer builds LAMB with a trust ratio per parameter"
        )
    if args.optim_args:
        raise UsageError(
            f"--optim_args {args.optim_args}: --optim lamb takes none (timm's Lamb at its defaults; --adam_beta1, "
            "--adam_beta2, --adam_epsilon and --weight_decay set it)"
        )


def check_patch_dropout(args: DiscoTrainingArguments) -> None:
    if not (math.isfinite(args.patch_dropout) and 0 <= args.patch_dropout < 1):
        raise UsageError(
            f"--patch_dropout {args.patch_dropout:g}: give the fraction of patches to drop, at least 0 and below 1 "
            "(FLIP: 0.5 or 0.75; 0: off)"
        )
    until = args.patch_dropout_until_step
    if until is not None and args.patch_dropout == 0:
        raise UsageError(f"--patch_dropout_until_step {until} without --patch_dropout: give a rate, e.g. 0.5")
    if until is not None and until < 1:
        raise UsageError(
            f"--patch_dropout_until_step {until}: give the step from which every patch is seen, at least 1"
        )


def check_torch_compile(args: DiscoTrainingArguments) -> None:
    """A backend or mode that torch.compile does not know would fail at the first step (train/compile.py)."""
    if not args.torch_compile:
        return
    import torch._dynamo
    import torch._inductor

    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.torch_compile_backend not in backends:
        raise UsageError(
            f"--torch_compile_backend {args.torch_compile_backend}: not a torch.compile backend here; one of "
            f"{', '.join(backends)} (default inductor)"
        )
    modes = list(torch._inductor.list_mode_options())
    if args.torch_compile_mode is not None and args.torch_compile_backend != "inductor":
        raise UsageError(
            f"--torch_compile_mode is inductor's: leave it out with --torch_compile_backend "
            f"{args.torch_compile_backend}"
        )
    if args.torch_compile_mode is not None and args.torch_compile_mode not in modes:
        raise UsageError(f"--torch_compile_mode {args.torch_compile_mode}: one of {', '.join(modes)}")


def check_peak_tflops(args: DiscoTrainingArguments) -> None:
    """--peak_tflops, the device's dense peak that MFU is taken against, is a positive number of TFLOPs."""
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise UsageError(
            f"--peak_tflops {args.peak_tflops}: give one device's dense peak in TFLOPs, finite and above 0"
        )


def check_ema(args: DiscoTrainingArguments, zeroshot_steps: int) -> None:
    """--ema_decay in [0, 1), --ema_start_step at least 0, --eval_ema with an EMA and an in-training eval."""
    decay = args.ema_decay
    if decay is not None and not (math.isfinite(decay) and 0 <= decay < 1):
        raise UsageError(f"--ema_decay {decay:g}: give a number at least 0 and below 1 (e.g. 0.999)")
    if args.ema_start_step < 0:
        raise UsageError(f"--ema_start_step {args.ema_start_step}: give the step the EMA starts at, at least 0")
    if args.eval_ema and decay is None:
        raise UsageError("--eval_ema evaluates the EMA of the weights: give --ema_decay too (e.g. 0.999)")
    if args.eval_ema and zeroshot_steps <= 0:
        raise UsageError("--eval_ema runs with the in-training eval: give --zeroshot_data and --zeroshot_steps N too")


def check_push_to_hub(args: DiscoTrainingArguments) -> str | None:
    """The hub repo to push to at the end (None: no push), once a token is known to be there."""
    if not args.push_to_hub:
        return None
    if not args.hub_model_id:
        raise UsageError("--push_to_hub needs --hub_model_id USER/NAME")
    from disco_clip_ds.export.hub import require_hub_token

    try:
        require_hub_token()  # now, not after hours of training
    except ExportError as error:
        raise UsageError(str(error)) from error
    return args.hub_model_id
