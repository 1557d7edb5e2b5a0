"""What would make a plan that does not fit fit: each change planned again (memory.memory_plan), one at a time, and
named only when its plan fits: a higher ZeRO stage, activation checkpointing, or a smaller micro-batch with more
accumulation steps, which keeps the batch each optimizer step contrasts (contrastive accumulation) or trains on.
"""

from __future__ import annotations

from dataclasses import replace

from disco_clip_ds.plan.memory import Settings, max_micro_batch, memory_plan


def fitting_changes(
    shape, settings: Settings, fit, impl, checkpointing, capacity, overhead, chunk_size=None, teacher=None
):
    """The changes (a phrase each, with the flag or config key) whose plan fits where `settings`' does not; empty
    when none does alone."""
    plan = lambda s, ckpt: memory_plan(shape, s, fit, impl, ckpt, capacity, overhead, None, chunk_size, teacher)
    changes = []
    for stage in range(settings.stage + 1, 4):
        if plan(replace(settings, stage=stage), checkpointing).fits:
            changes.append(f"ZeRO-{stage} (zero_optimization.stage {stage})")
            break
    if not checkpointing and plan(settings, True).fits:
        changes.append("activation checkpointing (train --activation_checkpointing)")
    smaller = _smaller_micro(shape, settings, fit, impl, checkpointing, capacity, overhead, chunk_size, teacher)
    if smaller is not None:
        changes.append(smaller)
    return changes


def _smaller_micro(shape, settings, fit, impl, checkpointing, capacity, overhead, chunk_size, teacher) -> str | None:
    """The largest micro-batch below the config's, dividing micro x accumulation, whose plan at the accumulation
    steps that keep micro x accumulation fits; None when none does."""
    per_rank = settings.micro_batch * settings.grad_accum  # the samples a rank trains on per optimizer step
    args = (fit, impl, checkpointing, capacity, overhead)
    largest = max_micro_batch(shape, settings, *args, chunk_size, teacher)
    contrastive = settings.contrastive_accumulation and impl != "local"
    for micro in range(min(largest, settings.micro_batch - 1), 0, -1):
        if per_rank % micro:
            continue
        changed = replace(settings, micro_batch=micro, grad_accum=per_rank // micro)
        if memory_plan(shape, changed, *args, None, chunk_size, teacher).fits:
            contrasted = micro * (1 if impl == "local" else settings.world)
            kept = (
                f"the same contrastive batch {changed.contrastive_batch} under contrastive accumulation"
                if contrastive
                else f"the same train batch; each micro-step contrasts {contrasted}"
            )
            return (
                f"micro-batch {micro} x {changed.grad_accum} accumulation steps (--per_device_train_batch_size "
                f"{micro} --gradient_accumulation_steps {changed.grad_accum}: {kept})"
            )
    return None
