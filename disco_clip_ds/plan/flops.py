"""A run's training FLOPs per sample, from the planner's count (plan/memory.py's `ModelShape`): the student's forward
and backward over the tokens its layers see (patch dropout and the SigLIP 2 NaFlex budget included), plus a live
distillation teacher's forward (each member's, for an ensemble). Model FLOPs, as MFU counts them: a recomputed
forward (gradient checkpointing, contrastive accumulation's embedding pass) is work done twice, not counted twice;
the loss's share is left out."""

from __future__ import annotations

from dataclasses import replace

from disco_clip_ds.plan.memory import ModelShape


def model_shape(config, max_num_patches: int | None = None) -> ModelShape:
    """The planner's ModelShape of a loaded model config (a CLIPConfig, SiglipConfig or Siglip2Config), SigLIP 2's
    images at `max_num_patches` patches (None: its whole grid)."""
    return ModelShape.from_config(config, max_num_patches=max_num_patches)


def forward_flops_per_sample(shape: ModelShape) -> float:
    """One forward of both towers per sample (the planner counts a training step as 3 x the forward)."""
    return sum(shape.training_flops_per_sample().values()) / 3


def training_flops_per_sample(
    student: ModelShape, patch_dropout: float = 0.0, teacher: ModelShape | list[ModelShape] | None = None
):
    """Training FLOPs per sample: the student's forward and backward at `patch_dropout`, plus `teacher`'s forward (a
    live teacher, or a list of an ensemble's: each member's forward; None: no teacher, or one whose embeddings are
    stored)."""
    flops = sum(student.with_patch_dropout(patch_dropout).training_flops_per_sample().values())
    teachers = teacher if isinstance(teacher, (list, tuple)) else [] if teacher is None else [teacher]
    return flops + sum(forward_flops_per_sample(t) for t in teachers)


def at_size(shape: ModelShape, size: int) -> ModelShape:
    """`shape` with its images at another size: square images of side `size`, or for SigLIP 2 (NaFlex) a budget of
    `size` patches (a progressive resolution stage, models/resolution.py). The text tower is unchanged."""
    vision = dict(shape.towers["vision"])
    class_tokens = vision["tokens"] - vision["patches"]
    if shape.image == (1, vision["patches"], vision["patch_pixels"]):  # NaFlex: (1, patches, pixels per patch)
        patches, image = size, (1, size, shape.image[2])
    else:
        patch = round((vision["patch_pixels"] / shape.image[0]) ** 0.5)
        patches, image = (size // patch) ** 2, (shape.image[0], size, size)
    vision.update(patches=patches, tokens=patches + class_tokens)
    return replace(shape, towers={**shape.towers, "vision": vision}, image=image)
