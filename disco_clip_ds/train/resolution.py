"""The trainer's side of progressive resolution (--resolution_schedule, models/resolution.py): each training forward
of optimizer step s sees its batch at the schedule's size for s, resized on the device from the stream's batch
(made at the last size), with the position embeddings interpolated; SigLIP 2's NaFlex batches are packed again at
the step's patch budget. The size depends on the step alone, never on the DataLoader worker that made the batch."""

from __future__ import annotations

import contextlib

from disco_clip_ds.data.naflex import rebudget
from disco_clip_ds.models.resolution import ResolutionSchedule, parse_micro_batches, parse_schedule, resize_images


class StepResolution:
    """The schedule of `args.resolution_schedule` over `args.max_steps` (None: off), applied by `resized` to the
    forwards run inside `at_step(step)`; outside (evaluation) a batch passes unchanged. With
    --stage_micro_batch_sizes, `merged_at` says how many of the stream's micro-batches a step's forward takes at once
    (the contrastive accumulation runs them so: train/accumulation.py)."""

    def __init__(self, args, model_config):
        text, micro = getattr(args, "resolution_schedule", None), getattr(args, "stage_micro_batch_sizes", None)
        self.schedule = None
        if text:
            stages = parse_schedule(text)
            per_step = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
            sizes = parse_micro_batches(micro, len(stages), *per_step) if micro else None
            self.schedule = ResolutionSchedule(stages, args.max_steps, sizes)
        self.micro_batch = args.per_device_train_batch_size
        self.naflex = model_config.model_type == "siglip2"
        self.patch_size = model_config.vision_config.patch_size
        self._step = None

    def size_at(self, step: int) -> int | None:
        """The image side (SigLIP 2: patch budget) of 0-based optimizer step `step`; None without a schedule."""
        return None if self.schedule is None else self.schedule.size_at(step)

    def merged_at(self, step: int) -> int:
        """How many of the stream's micro-batches 0-based optimizer step `step` runs as one forward (its stage's
        micro-batch under --stage_micro_batch_sizes over --per_device_train_batch_size; 1: each alone)."""
        micro = None if self.schedule is None else self.schedule.micro_batch_at(step)
        return 1 if micro is None else micro // self.micro_batch

    def patches_per_image(self, step: int) -> int | None:
        """The patches of a square image at 0-based optimizer step `step`'s side (the grid its patch dropout masks,
        models/patch_dropout.py `at_grid`); None without a schedule or for SigLIP 2 (which has no patch dropout)."""
        if self.schedule is None or self.naflex:
            return None
        return (self.schedule.size_at(step) // self.patch_size) ** 2

    @contextlib.contextmanager
    def at_step(self, step: int):
        """While inside, `resized` makes the batches of 0-based optimizer step `step`."""
        self._step = step
        try:
            yield
        finally:
            self._step = None

    def resized(self, inputs: dict) -> dict:
        """`inputs` (prepared: normalised, on the device) at the current step's size; a new dict where it changes."""
        if self.schedule is None or self._step is None or inputs.get("pixel_values") is None:
            return inputs
        size, pixels = self.schedule.size_at(self._step), inputs["pixel_values"]
        if self.naflex:
            if pixels.shape[1] == size:
                return inputs
            packed = rebudget(pixels.float(), inputs["spatial_shapes"], self.patch_size, size)
            packed["pixel_attention_mask"] = packed["pixel_attention_mask"].to(inputs["pixel_attention_mask"].dtype)
            return {**inputs, **packed, "pixel_values": packed["pixel_values"].to(pixels.dtype)}
        if pixels.shape[-1] == size:
            return inputs
        resized = resize_images(pixels.float(), size).to(pixels.dtype)  # in float32 whatever the compute dtype
        return {**inputs, "pixel_values": resized, "interpolate_pos_encoding": True}
