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
    """--stage_micro_batch_sizes: parse_micro_batches' rules, one line for a value that breaks one."""
    text = args.stage_micro_batch_sizes
    if text is None:
        return
    per_step = (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.contrastive_accumulation)
    try:
        parse_micro_batches(text, stages, *per_step)
    except ValueError as error:
        raise UsageError(f"--stage_micro_batch_sizes {text}: {error}") from None
