"""The batch and its steps: --per_device_train_batch_size, --gradient_accumulation_steps and contrastive
accumulation, a DeepSpeed JSON's fixed batch sizes against them, --max_steps."""

from __future__ import annotations

import os

from disco_clip_ds.errors import AccumulationError, UsageError
from disco_clip_ds.plan.checks import batch_contradictions, expected_batch
from disco_clip_ds.train.args import DiscoTrainingArguments, read_deepspeed_json


def check_contrastive_accumulation(args, loss_impl: str) -> None:
    """Refuse, before training and identically on every rank, settings under which accumulation cannot work.

    `args`: TrainingArguments with `contrastive_accumulation`; `loss_impl`: the model's loss ("tiled", "disco",
    "local")."""
    steps = args.gradient_accumulation_steps
    if not isinstance(steps, int) or steps < 1:
        raise AccumulationError(
            f"--gradient_accumulation_steps must be an integer >= 1 (micro-batches per optimizer step), got {steps!r}"
        )
    if not getattr(args, "contrastive_accumulation", False) or steps == 1:
        return
    if loss_impl == "local":
        raise AccumulationError(
            "--loss_impl local computes each micro-batch's loss on its own, so it cannot be accumulated contrastively: "
            "use --loss_impl tiled (or disco) for a contrastive batch of micro x world x K, or pass "
            "--contrastive_accumulation false to keep independent micro-batch losses"
        )
    if getattr(args, "n_gpu", 1) > 1:
        raise AccumulationError(
            f"one process drives {args.n_gpu} GPUs (torch.nn.DataParallel); the distributed loss needs one process per "
            "GPU: launch with torchrun, deepspeed or accelerate launch"
        )
    parallel = getattr(args, "parallelism_config", None)
    if parallel is not None and any(getattr(parallel, f"{kind}_size", 1) > 1 for kind in ("tp", "cp", "sp")):
        raise AccumulationError(
            "contrastive accumulation supports data parallelism only (DeepSpeed ZeRO, FSDP, DDP); "
            "drop the tensor/context/sequence parallel sizes from parallelism_config"
        )


def deepspeed_path(args) -> str | None:
    """The DeepSpeed JSON file of the run: --deepspeed, or the one accelerate launch's config names."""
    path = args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return path if isinstance(path, str) and not path.lstrip().startswith("{") else None


def deepspeed_json(args) -> dict | None:
    """The run's DeepSpeed JSON: as `parse_args` read it (`args.deepspeed_json`), or read now, once, for arguments
    made without it (`args` is left as it is)."""
    return args.deepspeed_json if args.deepspeed_json is not None else read_deepspeed_json(args.deepspeed)


def check_deepspeed_batch(args: DiscoTrainingArguments, config: dict | None = None) -> None:
    """Fail early, with what to change, when a DeepSpeed JSON's fixed batch sizes contradict the arguments.

    DeepSpeed would also refuse them, but only after the model is built, in an assertion on each rank. `config`: the
    run's DeepSpeed JSON (default: `deepspeed_json(args)`); the arithmetic is the planner's (`batch_contradictions`)."""
    config = deepspeed_json(args) if config is None else config
    if not isinstance(config, dict):
        return
    micro, accum, world = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
    wrong = batch_contradictions(config, micro, accum, world)
    if wrong:
        expected = expected_batch(micro, accum, world)
        raise UsageError(
            f"{deepspeed_path(args)}: {wrong} contradicts --per_device_train_batch_size {micro} x "
            f'--gradient_accumulation_steps {accum} x {world} ranks (= {expected}); set those values to "auto" or '
            "change the arguments to match"
        )


def check_max_steps(args: DiscoTrainingArguments) -> None:
    if args.max_steps == 0:  # the Trainer would read 0 as "not set" and train --num_train_epochs
        raise UsageError(
            "--max_steps 0 trains nothing: give a positive number, or leave it out to train --num_train_epochs"
        )


def check_batch_size(args: DiscoTrainingArguments) -> None:
    if args.per_device_train_batch_size < 1:
        raise UsageError(f"--per_device_train_batch_size {args.per_device_train_batch_size}: must be at least 1")
