"""The planner's view of a progressive resolution schedule (`disco-clip plan --resolution_schedule`, as `disco-clip
train`'s, models/resolution.py): per stage its share of the steps, the image tower's tokens, the training FLOPs per
sample and the per-GPU memory at that size, and the schedule's FLOPs against training every step at the last size."""

from __future__ import annotations

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.models.resolution import parse_schedule, side_problem
from disco_clip_ds.plan.flops import at_size
from disco_clip_ds.plan.memory import ModelShape


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


def plan_stages(stages: list[tuple[float, int]], shape: ModelShape, memory) -> dict:
    """Each stage's figures and the schedule's FLOPs ratio; `memory(shape)`: {impl: per-GPU bytes} at a stage's
    shape. `shape`: the model at its last size."""
    rows = []
    for share, size in stages:
        stage = at_size(shape, size)
        flops = sum(stage.training_flops_per_sample().values())
        rows.append(
            {
                "share": share,
                "size": size,
                "vision_tokens": stage.layer_tokens(stage.towers["vision"]),
                "flops_per_sample": flops,
                "memory": memory(stage),
            }  # fmt: skip
        )
    fixed = sum(shape.training_flops_per_sample().values())
    return {"stages": rows, "flops_vs_fixed": sum(r["share"] * r["flops_per_sample"] for r in rows) / fixed}


def format_stages(result: dict, gib: float) -> list[str]:
    """The report's lines for `plan_stages`' result."""
    impls = list(result["stages"][0]["memory"])
    lines = [
        "progressive resolution: per stage (share of the steps, size, image tokens, training GFLOP per sample, "
        "per-GPU memory per loss)"
    ]
    for r in result["stages"]:
        memory = ", ".join(f"{impl} {r['memory'][impl] / gib:.2f} GiB" for impl in impls)
        lines.append(
            f"  {r['share']:6.1%} at {r['size']:>4}: {r['vision_tokens']:>5} tokens, "
            f"{r['flops_per_sample'] / 1e9:8.1f} GFLOP, {memory}"
        )
    lines.append(
        f"  the schedule's training FLOPs: {result['flops_vs_fixed']:.3f} x those of every step at the last size"
    )
    return lines
