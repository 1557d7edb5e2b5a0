"""The refusals of --resolution_schedule (progressive resolution, models/resolution.py): the schedule's form, its
sides against the patch size (or SigLIP 2's patch budgets), and the flags it does not combine with."""

from __future__ import annotations

from disco_clip_ds.errors import UsageError
from disco_clip_ds.models.resolution import parse_micro_batches, parse_schedule, side_problem
from disco_clip_ds.train.args import DiscoTrainingArguments, ModelArguments


def check_resolution_schedule(
    args: DiscoTrainingArguments, model_args: ModelArguments, config, image_size, naflex
) -> tuple[int | None, tuple[int, int] | None]:
    """(image size, NaFlex's (patch size, budget)) the run's data and model take: the schedule's last side (or
    budget) with --resolution_schedule, else `image_size` and `naflex` as checked. A UsageError of one line for a
    schedule that cannot work."""
    text = args.resolution_schedule
    if text is None:
        if args.stage_micro_batch_sizes is not None:
            raise UsageError("--stage_micro_batch_sizes sets each --resolution_schedule stage's: give the schedule")
        return image_size, naflex
    flag = f"--resolution_schedule {text}"
    try:
        stages = parse_schedule(text)
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None
    _check_stage_micro_batches(args, len(stages))
    for other, given in (
        ("--teacher", model_args.teacher),
        ("--image_size", model_args.image_size),
    ):
        if given:
            raise UsageError(f"{flag} with {other}: not supported together; leave one out (the schedule sets the size)")
    final = stages[-1].size
    if naflex is not None:
        patch, budget = naflex
        if model_args.max_num_patches is not None and model_args.max_num_patches != final:
            raise UsageError(
                f"{flag}: its last budget {final} differs from --max_num_patches {budget}; leave that flag out"
            )
        return None, (patch, final)
    problem = side_problem(stages, config.vision_config.patch_size)
    if problem:
        raise UsageError(f"{flag}: {problem}")
    return final, None


def _check_stage_micro_batches(args: DiscoTrainingArguments, stages: int) -> None:
    """--stage_micro_batch_sizes: one per stage, each a multiple of the stream's micro-batch dividing a rank's samples
    per step; a larger one runs several micro-batches in one forward, which keeps the loss only when the step's loss
    is over all of them (contrastive accumulation)."""
    text = args.stage_micro_batch_sizes
    if text is None:
        return
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    flag = f"--stage_micro_batch_sizes {text}"
    try:
        sizes = parse_micro_batches(text, stages, micro, accumulation)
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None
    if max(sizes) > micro and not args.contrastive_accumulation:
        raise UsageError(
            f"{flag} with --contrastive_accumulation false: a larger micro-batch would contrast more pairs per loss; "
            "leave contrastive accumulation on (the default) or the flag out"
        )
