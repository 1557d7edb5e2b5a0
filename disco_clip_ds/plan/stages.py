"""The planner's view of a progressive resolution schedule (`disco-clip plan --resolution_schedule`, as `disco-clip
train`'s, models/resolution.py): per stage its share of the steps, its micro-batch and accumulation steps
(--stage_micro_batch_sizes), the image tower's tokens, the training FLOPs per sample and the per-GPU memory at that
size and micro-batch, and the schedule's FLOPs against training every step at the last size."""

from __future__ import annotations

import dataclasses

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.models.resolution import parse_micro_batches, parse_schedule, side_problem
from disco_clip_ds.plan.flops import at_size
from disco_clip_ds.plan.memory import ModelShape, Settings


def schedule_stages(text: str, shape: ModelShape) -> list[tuple[float, int]]:
    """(share of the run's steps, size) of each stage of --resolution_schedule `text`, once it is a schedule this
    model can train (a PlanConfigError of one line otherwise)."""
    flag = f"--resolution_schedule {text}"
    try:
        stages = parse_schedule(text)
    except ValueError as error:
        raise PlanConfigError(f"{flag}: {error}") from None
    vision = shape.towers["vision"]
    if shape.image != (1, vision["patches"], vision["patch_pixels"]):  # square images: whole patches a side
        problem = side_problem(stages, round((vision["patch_pixels"] / shape.image[0]) ** 0.5))
        if problem:
            raise PlanConfigError(f"{flag}: {problem}")
    ends = [float(s.start) for s in stages[1:]] + [1.0]
    return [(end - float(s.start), s.size) for s, end in zip(stages, ends)]


def stage_micro_batches(text: str | None, stages: int, settings: Settings) -> list[int]:
    """Each stage's micro-batch per GPU under --stage_micro_batch_sizes `text` (as `disco-clip train`'s: a multiple of
    the config's micro-batch dividing micro x accumulation; None: the config's throughout), or a PlanConfigError."""
    if text is None:
        return [settings.micro_batch] * stages
    flag = f"--stage_micro_batch_sizes {text}"
    per_step = (settings.micro_batch, settings.grad_accum, settings.contrastive_accumulation)
    try:
        return parse_micro_batches(text, stages, *per_step)
    except ValueError as error:
        raise PlanConfigError(f"{flag}: {error}") from None


def plan_stages(
    stages: list[tuple[float, int]], shape: ModelShape, memory, settings: Settings, micro: list[int]
) -> dict:
    """Each stage's figures and the schedule's FLOPs ratio; `memory(shape, settings)`: {impl: (per-GPU bytes, fits)}
    at a stage's shape and batch; `micro`: each stage's micro-batch (its accumulation steps: micro x K / it).
    `shape`: the model at its last size."""
    rows = []
    for (share, size), micro_batch in zip(stages, micro):
        stage = at_size(shape, size)
        flops = sum(stage.training_flops_per_sample().values())
        accumulation = settings.micro_batch * settings.grad_accum // micro_batch
        batch = dataclasses.replace(settings, micro_batch=micro_batch, grad_accum=accumulation)
        rows.append(
            {
                "share": share,
                "size": size,
                "micro_batch": micro_batch,
                "grad_accum": accumulation,
                "vision_tokens": stage.layer_tokens(stage.towers["vision"]),
                "flops_per_sample": flops,
                **_memory_and_fit(memory(stage, batch)),
            }  # fmt: skip
        )
    fixed = sum(shape.training_flops_per_sample().values())
    return {"stages": rows, "flops_vs_fixed": sum(r["share"] * r["flops_per_sample"] for r in rows) / fixed}


def _memory_and_fit(planned: dict) -> dict:
    return {"memory": {i: total for i, (total, _) in planned.items()}, "fits": {i: f for i, (_, f) in planned.items()}}


def format_stages(result: dict, gib: float) -> list[str]:
    """The report's lines for `plan_stages`' result."""
    impls = list(result["stages"][0]["memory"])
    lines = [
        "progressive resolution: per stage (share of the steps, size, micro-batch x accumulation steps, image "
        "tokens, training GFLOP per sample, per-GPU memory per loss)"
    ]
    for r in result["stages"]:
        memory = ", ".join(
            f"{impl} {r['memory'][impl] / gib:.2f} GiB" + ("" if r["fits"][impl] else " (OOM)") for impl in impls
        )
        lines.append(
            f"  {r['share']:6.1%} at {r['size']:>4}: {r['micro_batch']:>5} x {r['grad_accum']:<3}"
            f"{r['vision_tokens']:>5} tokens, {r['flops_per_sample'] / 1e9:8.1f} GFLOP, {memory}"
        )
    lines.append(
        f"  the schedule's training FLOPs: {result['flops_vs_fixed']:.3f} x those of every step at the last size"
    )
    return lines
