"""Progressive resolution (Perception Encoder, FLIP, SigLIP 2): a schedule of image sides (or NaFlex patch budgets)
over the run's optimizer steps, the batch resized to the side of the step it trains at, and the position embeddings
of a model resized once to the schedule's last side.

The schedule is a function of the optimizer step alone: the step's side is read where the step runs (the trainer,
on the device), never in a DataLoader worker, so prefetching, accumulation, a resume and a resume on another number
of ranks all train at the side the uninterrupted run trained that step at. The model holds its position embeddings
at the last side; an earlier stage interpolates them as transformers' `interpolate_pos_encoding=True` does (the same
function), and the last stage uses them as they are, so the saved model is a plain transformers model at that side.

Under ZeRO-3 a module's weights are gathered when its own forward runs; `interpolate_pos_encoding` reads the position
embedding's weight from its parent's (the embeddings module's) forward, so `gather_position_embedding` registers the
weight with that module (DeepSpeed's external parameters), and the resize at build time gathers it to read it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Stage:
    """A stage of the schedule: from `start` (a fraction of the run's steps, in [0, 1)) on, images of side `size`
    (a NaFlex schedule: `size` patches per image)."""

    start: Fraction
    size: int


def parse_schedule(text: str) -> list[Stage]:
    """'0:98,0.35:154,0.7:224' -> its stages; a ValueError of one line for a schedule that does not start at 0, a
    fraction outside [0, 1), fractions or sizes that do not increase, or an entry that is not FRACTION:SIZE."""
    stages = []
    for entry in text.split(","):
        fraction, _, size = entry.strip().partition(":")
        try:
            stage = Stage(Fraction(fraction.strip()), int(size.strip()))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"entry {entry.strip()!r}: give FRACTION:SIZE, e.g. 0.35:154") from None
        if not 0 <= stage.start < 1:
            raise ValueError(f"entry {entry.strip()!r}: the fraction of the run's steps must be at least 0 and below 1")
        if stage.size < 1:
            raise ValueError(f"entry {entry.strip()!r}: the size must be positive")
        if stages and not (stage.start > stages[-1].start and stage.size > stages[-1].size):
            raise ValueError(
                f"entry {entry.strip()!r} after {float(stages[-1].start):g}:{stages[-1].size}: fractions and sizes "
                "must both increase"
            )
        stages.append(stage)
    if stages[0].start != 0:
        raise ValueError(f"the first stage starts at {float(stages[0].start):g}: start it at 0")
    return stages


def side_problem(stages: list[Stage], patch_size: int) -> str | None:
    """What is wrong with the sides of a square-image schedule for `patch_size` px patches (None: nothing): each
    side must be a whole number of patches."""
    for stage in stages:
        if stage.size % patch_size:
            lower, upper = stage.size // patch_size * patch_size, (stage.size // patch_size + 1) * patch_size
            fix = f"{lower} or {upper}" if lower else str(upper)
            return f"side {stage.size} is not a multiple of the patch size {patch_size}; use {fix}"
    return None


def parse_micro_batches(text: str, stages: int, micro: int, accumulation: int, contrastive: bool = True) -> list[int]:
    """'256,128,64' -> each stage's micro-batch per rank (--stage_micro_batch_sizes): a ValueError of one line unless
    there is one per stage of the schedule, each a multiple of `micro` (--per_device_train_batch_size, what the
    stream yields) dividing the `micro` x `accumulation` samples a rank contrasts per optimizer step, so that the
    global batch stays the same (a stage's accumulation steps: micro x accumulation / its micro-batch). One above
    `micro` needs contrastive accumulation (`contrastive`): the step's loss must span all its micro-batches, or a
    merged forward would contrast more pairs per loss."""
    try:
        sizes = [int(entry.strip()) for entry in text.split(",")]
    except ValueError:
        raise ValueError(f"give one whole number per stage, e.g. {micro * accumulation},{micro}") from None
    if len(sizes) != stages:
        raise ValueError(f"{len(sizes)} micro-batch sizes for {stages} stages: give one per stage")
    per_step = micro * accumulation
    for size in sizes:
        if size < micro or size % micro or per_step % size:
            fits = [m for m in range(micro, per_step + 1, micro) if per_step % m == 0]
            raise ValueError(
                f"micro-batch {size}: each stage's must be a multiple of --per_device_train_batch_size {micro} that "
                f"divides its {micro} x {accumulation} samples per step (one of {', '.join(map(str, fits))})"
            )
    if max(sizes) > micro and not contrastive:
        raise ValueError(
            "with contrastive accumulation off (--contrastive_accumulation false) a larger micro-batch would contrast "
            f"more pairs per loss: leave it on (the default), or give {micro} for every stage"
        )
    return sizes


class ResolutionSchedule:
    """`stages` over a run of `max_steps` optimizer steps: stage i trains steps floor(start_i x max_steps) onwards
    (0-based; the logged step is this + 1); `micro_batches`: each stage's micro-batch per rank where
    --stage_micro_batch_sizes sets them (parse_micro_batches; None: the run's throughout)."""

    def __init__(self, stages: list[Stage], max_steps: int, micro_batches: list[int] | None = None):
        self.stages, self.max_steps, self.micro_batches = list(stages), max_steps, micro_batches
        self.starts = [math.floor(s.start * max_steps) for s in self.stages]

    @property
    def final(self) -> int:
        """The last stage's size: the model's and the export's."""
        return self.stages[-1].size

    def stage_at(self, step: int) -> int:
        """The index of the stage of 0-based optimizer step `step` (the Trainer's global_step while it runs)."""
        return next(i for i in reversed(range(len(self.stages))) if step >= self.starts[i])

    def size_at(self, step: int) -> int:
        """The size of 0-based optimizer step `step`."""
        return self.stages[self.stage_at(step)].size

    def micro_batch_at(self, step: int) -> int | None:
        """The micro-batch per rank of 0-based optimizer step `step` (None: the run's)."""
        return None if self.micro_batches is None else self.micro_batches[self.stage_at(step)]

    def steps_per_stage(self) -> list[tuple[int, int]]:
        """(size, optimizer steps) of each stage (a stage may get 0 steps in a short run)."""
        ends = [*self.starts[1:], self.max_steps]
        return [(s.size, max(0, end - start)) for s, start, end in zip(self.stages, self.starts, ends)]

    def describe(self) -> str:
        """As run.json and the model card show it: each stage's size and first step (and micro-batch per rank)."""
        micro = self.micro_batches or [None] * len(self.stages)
        return ", ".join(
            f"{stage.size} from step {start + 1}" + (f" (micro-batch {m})" if m else "")
            for stage, start, m in zip(self.stages, self.starts, micro)
        )


def describe_schedule(
    text: str | None, max_steps: int, micro_batches: str | None = None, micro: int = 1, accumulation: int = 1
) -> str | None:
    """--resolution_schedule as run.json and the model card show it: each stage's size and first step, and its
    micro-batch per rank under --stage_micro_batch_sizes `micro_batches` (None: off)."""
    if not text:
        return None
    stages = parse_schedule(text)
    sizes = parse_micro_batches(micro_batches, len(stages), micro, accumulation) if micro_batches else None
    return ResolutionSchedule(stages, max_steps, sizes).describe()


def resize_images(pixel_values: torch.Tensor, side: int) -> torch.Tensor:
    """A float batch (n, 3, h, w) -> (n, 3, side, side): bicubic, antialiased (torchvision's resize of a tensor).
    Linear with weights summing to 1, so it commutes with the per-channel normalisation: resizing the normalised
    batch is normalising the resized one."""
    if pixel_values.shape[-1] == side and pixel_values.shape[-2] == side:
        return pixel_values
    return F.interpolate(pixel_values, size=(side, side), mode="bicubic", antialias=True, align_corners=False)


def resize_position_embeddings(model: nn.Module, side: int) -> None:
    """The image tower's (a CLIP or SigLIP model's `vision_model`) learned position embeddings resized in place to
    images of `side` px, by the tower's own `interpolate_pos_encoding` (what it computes at that side with
    interpolate_pos_encoding=True), and its config's image_size set to `side`: the tower then runs at `side` with
    no flag, and saves as a plain transformers model of that size."""
    embeddings = model.vision_model.embeddings
    if embeddings.image_size == side:
        return
    patch, dim = embeddings.patch_size, embeddings.embed_dim
    weight = embeddings.position_embedding.weight
    with _gathered(weight), torch.no_grad():  # ZeRO-3 (zero.Init): each rank holds a partition; read the whole
        tokens = weight.shape[0] - embeddings.num_patches + (side // patch) ** 2
        resized = embeddings.interpolate_pos_encoding(weight.new_zeros(1, tokens, dim), side, side)[0]
    # a plain parameter, alike on every rank: under ZeRO-3 the engine partitions it with the model's others
    embeddings.position_embedding = nn.Embedding(tokens, dim, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        embeddings.position_embedding.weight.copy_(resized)
    embeddings.position_ids = torch.arange(tokens, device=embeddings.position_ids.device).expand((1, -1))
    embeddings.image_size, embeddings.num_patches, embeddings.num_positions = side, (side // patch) ** 2, tokens
    for config in (embeddings.config, model.vision_model.config, model.config.vision_config):
        config.image_size = side  # one object or copies, by transformers' version: each says the new side


def gather_position_embedding(model: nn.Module) -> None:
    """Under ZeRO-3 (transformers' `is_deepspeed_zero3_enabled`: the run's DeepSpeed config has stage 3), the image
    tower's position embedding weight registered as an external parameter of the embeddings module, so that ZeRO-3
    gathers it whenever that module's forward runs: `interpolate_pos_encoding` (an earlier stage of a schedule) and
    SigLIP 2's NaFlex resize read the weight there, not through the nn.Embedding's own forward. Without it only
    DeepSpeed's automatic discovery gathers it, which works inside the engine's forward alone (a tower called
    directly, `get_image_features`, would read an empty partition). Nothing otherwise."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    embeddings = getattr(getattr(model, "vision_model", None), "embeddings", None)
    position = getattr(embeddings, "position_embedding", None)
    if position is None or not is_deepspeed_zero3_enabled():
        return
    from deepspeed.runtime.zero import register_external_parameter

    register_external_parameter(embeddings, position.weight)


def _gathered(weight: torch.Tensor):
    """A context in which `weight`, a ZeRO-3 partition (it has a ds_id), is whole on every rank; else nothing."""
    if not hasattr(weight, "ds_id"):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters([weight], modifier_rank=None)
