"""Samples -> batch: tokenize the captions in one call, normalise the uint8 crops straight into the batch tensor
(or hand the uint8 batch over, for the trainer to normalise on the device), stack the stream positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from disco_clip_ds.data.naflex import PatchNormalize, pack_patches
from disco_clip_ds.data.streams.reinforced import stack_targets
from disco_clip_ds.data.transforms import Normalize
from disco_clip_ds.models.patch_dropout import PATCHES_KEY

# The batch key under which each sample's position row (a stream's `position_fields`) rides to the trainer.
POSITION_KEY = "stream_position"
# The prefix of the batch keys of a distillation teacher's own inputs (train/distill.py reads them back).
TEACHER_PREFIX = "teacher_"


@dataclass
class TeacherInputs:
    """How a distillation teacher's inputs differ from the student's: its own tokenizer and text length (None: it
    reads the student's tokens), its own normalisation and image size (None: it sees the student's pixels)."""

    tokenizer: object = None
    max_length: int | None = None
    normalize: Normalize | None = None
    image_size: int | None = None
    # stored embeddings (--teacher_embeddings) instead of inputs: each sample carries its teachers' (image, text)
    # pairs after its caption (and kept patches), as the stream looked them up (data/streams/reinforced.py)
    stored: bool = False


class ClipCollator:
    """List of (pixel_values, caption[, kept patches][, position]) -> {"pixel_values", "input_ids",
    "attention_mask"[, PATCHES_KEY][, POSITION_KEY]} (kept patches when `patch_dropout`; a sample's dict of them per
    grid, under a --resolution_schedule, one batch key each): tensors only, so that accelerate can dispatch (and
    slice) them, and no `labels` (the model computes its own loss). With `max_num_patches` (SigLIP 2's NaFlex,
    data/naflex.py) the pixels are patch grids, padded to that budget, and the batch also has "pixel_attention_mask"
    and "spatial_shapes", as Siglip2ImageProcessor's.

    uint8 crops (as the streams yield them) are normalised here, straight into the batch tensor, with `mean`/`std`
    (ImageTransform's rule; pass the model's image processor's); with `normalize=False` they stay a uint8 batch (a
    quarter of the bytes to hand over), for the trainer to normalise on the device with `self.normalize.batch`,
    bit-identically. Float pixels are taken as already normalised. Captions are tokenized in one call per batch (a
    fast tokenizer does the batch in Rust) and padded to `max_length` so every batch has one shape. The positions
    (one row per sample) are for the trainer, which takes them out before the model sees the batch."""

    def __init__(
        self,
        tokenizer,
        max_length: int,
        mean=OPENAI_CLIP_MEAN,
        std=OPENAI_CLIP_STD,
        normalize=True,
        patch_dropout=False,
        teacher: TeacherInputs | None = None,
        max_num_patches: int | None = None,
    ):
        self.tokenizer, self.max_length, self.normalizes = tokenizer, max_length, normalize
        self.patch_dropout, self.teacher, self.max_num_patches = patch_dropout, teacher, max_num_patches
        self.normalize = Normalize(mean, std) if max_num_patches is None else PatchNormalize(mean, std)

    def __call__(self, batch: list[tuple]) -> dict[str, torch.Tensor]:
        pixels, captions, *rest = zip(*batch)
        kept, positions = (rest[0], rest[1:]) if self.patch_dropout else (None, rest)
        ids = None
        if self.teacher is not None and not isinstance(self.teacher, (list, tuple)) and self.teacher.stored:
            ids, positions = positions[0], positions[1:]
        tokens = self.tokenizer(
            list(captions), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        shape = (len(pixels), *pixels[0].shape)
        teacher = self._teacher_inputs(captions, pixels, ids) if self.teacher is not None else {}
        image_inputs = {}
        if self.max_num_patches is not None:  # NaFlex patch grids (data/naflex.py): padded to the budget
            shape = (len(pixels), self.max_num_patches, pixels[0].shape[-1])
            image_inputs = pack_patches(pixels, self.max_num_patches, out=batch_tensor(shape, pixels[0].dtype))
            pixels = image_inputs.pop("pixel_values")
            if self.normalizes:
                pixels = self.normalize.batch(pixels, image_inputs["pixel_attention_mask"])
        elif pixels[0].dtype == torch.uint8 and self.normalizes:
            pixels = self.normalize(pixels, out=batch_tensor(shape, torch.float32))
        elif pixels[0].dtype == torch.uint8:
            pixels = torch.stack(pixels, out=batch_tensor(shape, torch.uint8))
        else:
            pixels = torch.stack(pixels)
        collated = {
            "pixel_values": pixels,
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            **image_inputs,
        }
        if kept is not None and isinstance(kept[0], dict):  # each grid's of a --resolution_schedule, by its key
            collated.update({key: torch.stack([k[key] for k in kept]) for key in kept[0]})
        elif kept is not None:
            collated[PATCHES_KEY] = torch.stack(kept)
        if positions:
            collated[POSITION_KEY] = torch.stack(positions[0])
        return {**collated, **teacher}

    def _teacher_inputs(self, captions, pixels, ids) -> dict[str, torch.Tensor]:
        """The teacher's own tokens and pixels, under TEACHER_PREFIX keys, where they differ from the student's; or
        the stored embeddings the samples carry (`targets`), per teacher t under image_embeds.t and text_embeds.t. A
        list of TeacherInputs (a live ensemble, None where a member reads the student's inputs): each member's under
        TEACHER_PREFIX + "INDEX_"."""
        if not isinstance(self.teacher, (list, tuple)):
            return self._member_inputs(self.teacher, captions, pixels, ids)
        out = {}
        for index, member in enumerate(self.teacher):
            made = self._member_inputs(member, captions, pixels, None) if member is not None else {}
            out.update({f"{TEACHER_PREFIX}{index}_{k[len(TEACHER_PREFIX) :]}": v for k, v in made.items()})
        return out

    @staticmethod
    def _member_inputs(teacher: TeacherInputs, captions, pixels, ids) -> dict[str, torch.Tensor]:
        out = {}
        if ids is not None:
            images, texts = stack_targets(list(ids))
            for t, (image, text) in enumerate(zip(images, texts)):
                out[f"{TEACHER_PREFIX}image_embeds.{t}"], out[f"{TEACHER_PREFIX}text_embeds.{t}"] = image, text
            return out
        if teacher.tokenizer is not None:
            tokens = teacher.tokenizer(
                list(captions),
                padding="max_length",
                truncation=True,
                max_length=teacher.max_length,
                return_tensors="pt",
            )
            out[TEACHER_PREFIX + "input_ids"] = tokens["input_ids"]
            if "attention_mask" in tokens:
                out[TEACHER_PREFIX + "attention_mask"] = tokens["attention_mask"]
        if teacher.normalize is not None:
            if pixels[0].dtype != torch.uint8:
                raise ValueError("a teacher with its own image processor needs the stream's uint8 crops")
            crops = torch.stack(pixels)
            if teacher.image_size is not None and teacher.image_size != crops.shape[-1]:
                # the student's crop, resized for the teacher (antialiased bicubic, as image processors resize)
                size = (teacher.image_size, teacher.image_size)
                crops = F.interpolate(crops.float(), size=size, mode="bicubic", antialias=True)
                crops = crops.round_().clamp_(0, 255).to(torch.uint8)
            out[TEACHER_PREFIX + "pixel_values"] = teacher.normalize(crops)
        return out


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool | None = None) -> torch.Tensor:
    """An empty batch tensor, in shared memory when `shared` (by default: in a DataLoader worker), as
    default_collate allocates its stacks (with the same torch calls): a batch in ordinary memory is copied into
    shared memory whole (150 MB for 256 crops of 224 px) on its way to the main process."""
    if not (torch.utils.data.get_worker_info() is not None if shared is None else shared):
        return torch.empty(shape, dtype=dtype)
    like = torch.empty(0, dtype=dtype)
    return like.new(like._typed_storage()._new_shared(math.prod(shape), device=like.device)).resize_(shape)
