"""Samples -> batch: tokenize the captions in one call, normalise the uint8 crops straight into the batch tensor
(or hand the uint8 batch over, for the trainer to normalise on the device), stack the stream positions."""

from __future__ import annotations

import math

import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from disco_clip_ds.data.transforms import Normalize
from disco_clip_ds.models.patch_dropout import PATCHES_KEY

# The batch key under which each sample's position row (a stream's `position_fields`) rides to the trainer.
POSITION_KEY = "stream_position"


class ClipCollator:
    """List of (pixel_values, caption[, kept patches][, position]) -> {"pixel_values", "input_ids",
    "attention_mask"[, PATCHES_KEY][, POSITION_KEY]} (kept patches when `patch_dropout`): tensors only, so that
    accelerate can dispatch (and slice) them, and no `labels` (the model computes its own loss).

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
    ):
        self.tokenizer, self.max_length, self.normalizes = tokenizer, max_length, normalize
        self.patch_dropout = patch_dropout
        self.normalize = Normalize(mean, std)

    def __call__(self, batch: list[tuple]) -> dict[str, torch.Tensor]:
        pixels, captions, *rest = zip(*batch)
        kept, positions = (rest[0], rest[1:]) if self.patch_dropout else (None, rest)
        tokens = self.tokenizer(
            list(captions), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        shape = (len(pixels), *pixels[0].shape)
        if pixels[0].dtype == torch.uint8 and self.normalizes:
            pixels = self.normalize(pixels, out=batch_tensor(shape, torch.float32))
        elif pixels[0].dtype == torch.uint8:
            pixels = torch.stack(pixels, out=batch_tensor(shape, torch.uint8))
        else:
            pixels = torch.stack(pixels)
        collated = {
            "pixel_values": pixels,
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
        }
        if kept is not None:
            collated[PATCHES_KEY] = torch.stack(kept)
        if positions:
            collated[POSITION_KEY] = torch.stack(positions[0])
        return collated


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool | None = None) -> torch.Tensor:
    """An empty batch tensor, in shared memory when `shared` (by default: in a DataLoader worker), as
    default_collate allocates its stacks (with the same torch calls): a batch in ordinary memory is copied into
    shared memory whole (150 MB for 256 crops of 224 px) on its way to the main process."""
    if not (torch.utils.data.get_worker_info() is not None if shared is None else shared):
        return torch.empty(shape, dtype=dtype)
    like = torch.empty(0, dtype=dtype)
    return like.new(like._typed_storage()._new_shared(math.prod(shape), device=like.device)).resize_(shape)
