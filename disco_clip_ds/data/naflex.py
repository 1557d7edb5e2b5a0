"""NaFlex images (SigLIP 2): each image at its own aspect ratio, resized to the largest size whose patch count fits a
budget (`max_num_patches`), cut into patches in uint8, padded to the budget in the batch.

The steps are Siglip2ImageProcessor's (transformers), written here for the training stream, which needs them on uint8
pixels in the DataLoader worker and after the recipe's per-sample random crop (the processor takes whole images and
returns normalised floats):

- `naflex_size`: the target size. The processor documents it as the size at the largest scale (at most 100x) for
  which ceil(height * scale / patch) * ceil(width * scale / patch) patches fit the budget, each side at least one
  patch; it finds that scale by bisection, this module in closed form over the scales where a side's patch count
  changes (tests/unit/data/test_naflex.py checks it against transformers' function over thousands of sizes).
- `patchify`: (3, h, w) -> (rows, cols, p * p * 3), each patch's pixels row by row, channels innermost, as the
  processor orders them; the stream yields this uint8 grid, whose first two sizes are the image's spatial shape.
- `pack_patches` (the collator): the grids -> `pixel_values` (n, budget, p * p * 3) zero-padded,
  `pixel_attention_mask` (n, budget) int32 and `spatial_shapes` (n, 2) int64, as the processor returns them.
- `PatchNormalize`: x / 255, minus mean, over std, per channel, padding left at 0 (the processor pads after
  normalising), in the worker or (`batch`) on the device.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from disco_clip_ds.data.decode import EncodedImage, centred_aspect, to_rgb
from disco_clip_ds.data.transforms import MAX_IMAGE_PIXELS, Normalize, random_resized_crop_box

MAX_SCALE = 100.0  # the processor's largest scale (its bisection's upper end)
DEFAULT_MAX_NUM_PATCHES = 256  # the processor's and SigLIP 2's default budget
SIGLIP2_MEAN = SIGLIP2_STD = (0.5, 0.5, 0.5)  # Siglip2ImageProcessor's


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def naflex_size(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """(target height, target width), multiples of `patch_size`: the image scaled by the largest factor (at most
    MAX_SCALE) at which ceil(side * factor / patch_size) patches a side, at least one, multiply to at most
    `max_num_patches` (Siglip2ImageProcessor's rule).

    The patch count only grows with the scale and a side's count steps up just after each scale k * patch / side:
    the largest fitting scale is one of those, so trying each side's counts k (exact integer arithmetic: at scale
    k * patch / height the width spans ceil(width * k / height) patches) finds it without a search."""
    best = None  # (scale as a fraction (num, den), rows, cols)
    for side, other, rows_first in ((height, width, True), (width, height, False)):
        for k in range(1, max_num_patches + 1):
            k_other = max(1, _ceil_div(other * k, side))
            if k * k_other > max_num_patches:
                break
            if best is None or k * best[0][1] > best[0][0] * side:  # k / side > best scale, in integers
                best = ((k, side), *((k, k_other) if rows_first else (k_other, k)))
    if best is None:
        raise ValueError(f"max_num_patches {max_num_patches}: give at least 1")
    if best[0][0] * patch_size > MAX_SCALE * best[0][1]:  # the budget holds more than the largest scale gives
        return _scaled_patches(height, patch_size) * patch_size, _scaled_patches(width, patch_size) * patch_size
    return best[1] * patch_size, best[2] * patch_size


def _scaled_patches(side: int, patch_size: int) -> int:
    # patches a side spans just below MAX_SCALE (where the processor's bisection stops): ceil(side * 100 / p)
    return max(1, _ceil_div(side * int(MAX_SCALE), patch_size))


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """uint8 (3, h, w), both multiples of `patch_size` -> (h / p, w / p, p * p * 3): each patch's pixels row by row,
    the channels innermost (the processor's order)."""
    channels, height, width = pixels.shape
    rows, cols = height // patch_size, width // patch_size
    grid = pixels.reshape(channels, rows, patch_size, cols, patch_size).permute(1, 3, 2, 4, 0)
    return grid.reshape(rows, cols, patch_size * patch_size * channels)


def pack_patches(grids, max_num_patches: int, out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Patch grids (rows, cols, dim) -> {"pixel_values" (n, budget, dim) zero-padded, in `grids`' dtype or into
    `out`, "pixel_attention_mask" (n, budget) int32, "spatial_shapes" (n, 2) int64}."""
    dim = grids[0].shape[-1]
    if out is None:
        out = torch.zeros((len(grids), max_num_patches, dim), dtype=grids[0].dtype)
    else:
        out.zero_()
    shapes = torch.tensor([grid.shape[:2] for grid in grids], dtype=torch.int64).reshape(len(grids), 2)
    counts = shapes.prod(-1)
    if len(grids) and int(counts.max()) > max_num_patches:
        raise ValueError(f"an image of {int(counts.max())} patches exceeds the budget of {max_num_patches}")
    for grid, row, count in zip(grids, out, counts.tolist()):
        row[:count].copy_(grid.reshape(count, dim))
    mask = (torch.arange(max_num_patches) < counts[:, None]).to(torch.int32)
    return {"pixel_values": out, "pixel_attention_mask": mask, "spatial_shapes": shapes}


class PatchNormalize(Normalize):
    """uint8 patches (n, budget, p * p * 3), channels innermost -> float32 (x / 255 - mean) / std per channel, the
    padding (where `pixel_attention_mask` is 0) set to 0 as the processor pads."""

    def __init__(self, mean=SIGLIP2_MEAN, std=SIGLIP2_STD):
        super().__init__(mean, std)
        self.mean, self.std = self.mean.view(3), self.std.view(3)

    def batch(self, pixels: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """On the device where `pixels` lie; `pixel_attention_mask` (n, budget) zeroes the padding."""
        scale, mean, std = self._constants(pixels.device)
        shape = pixels.shape
        out = pixels.to(torch.float32).view(*shape[:-1], -1, 3).div_(scale).sub_(mean).div_(std).view(shape)
        if pixel_attention_mask is not None:
            out.mul_(pixel_attention_mask.to(out.device, torch.bool)[..., None])
        return out


class NaflexTransform:
    """Image -> uint8 patch grid (rows, cols, p * p * 3), rows x cols <= `max_num_patches`.

    Training: the recipe's random crop (transforms.random_resized_crop_box, the sample's RNG), then the crop resized
    to `naflex_size` of its own size by torch's uint8 bicubic kernel (as ImageTransform's training crops).
    Eval: the whole image resized to `naflex_size` by PIL's bilinear filter, Siglip2ImageProcessor's steps."""

    def __init__(self, patch_size: int, max_num_patches: int = DEFAULT_MAX_NUM_PATCHES, train: bool = True):
        self.patch_size, self.max_num_patches, self.train = patch_size, max_num_patches, train

    def pixels(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        """The patch grid of a PIL image."""
        image = to_rgb(image)
        if not self.train:
            return self._eval_grid(centred_aspect(image))
        return self._train_grid(np.array(image), image.size, rng or random.Random())

    def from_bytes(self, data: bytes, rng: random.Random, max_pixels: int = MAX_IMAGE_PIXELS) -> torch.Tensor:
        """Encoded image -> patch grid; a BadImage (data/decode.py) for data that is not an image or an image above
        `max_pixels` pixels (before decoding)."""
        encoded = EncodedImage(data, max_pixels)
        if not self.train:
            return self._eval_grid(encoded.whole())
        return self._train_grid(encoded.decode(1), encoded.size, rng)

    def _train_grid(self, pixels: np.ndarray, size: tuple[int, int], rng: random.Random) -> torch.Tensor:
        left, top, right, bottom = random_resized_crop_box(*size, rng)
        target = naflex_size(bottom - top, right - left, self.patch_size, self.max_num_patches)
        crop = torch.from_numpy(pixels[top:bottom, left:right]).permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(crop, size=target, mode="bicubic", antialias=True)[0]
        return patchify(resized.contiguous(), self.patch_size)

    def _eval_grid(self, image: Image.Image) -> torch.Tensor:
        height, width = naflex_size(image.height, image.width, self.patch_size, self.max_num_patches)
        resized = image.resize((width, height), Image.BILINEAR)
        return patchify(torch.from_numpy(np.array(resized)).permute(2, 0, 1).contiguous(), self.patch_size)


def rebudget(
    pixel_values: torch.Tensor, spatial_shapes: torch.Tensor, patch_size: int, max_num_patches: int
) -> dict[str, torch.Tensor]:
    """A packed NaFlex batch (`pack_patches`' keys, float, normalised, on any device) -> the same images at a
    smaller patch budget: each grid back to pixels, resized (bicubic, antialiased: linear, so it commutes with the
    normalisation) to `naflex_size` of its size at `max_num_patches`, cut into patches and packed again. Where a
    progressive resolution schedule (models/resolution.py) trains a step at a budget below the stream's."""
    grids = []
    for row, (rows, cols) in zip(pixel_values, spatial_shapes.tolist()):
        image = row[: rows * cols].reshape(rows, cols, patch_size, patch_size, -1).permute(4, 0, 2, 1, 3)
        image = image.reshape(1, -1, rows * patch_size, cols * patch_size)
        target = naflex_size(rows * patch_size, cols * patch_size, patch_size, max_num_patches)
        if target != tuple(image.shape[-2:]):
            image = F.interpolate(image, size=target, mode="bicubic", antialias=True, align_corners=False)
        grids.append(patchify(image[0], patch_size))
    out = pixel_values.new_zeros((len(grids), max_num_patches, pixel_values.shape[-1]))
    packed = pack_patches(grids, max_num_patches, out=out)
    packed["pixel_attention_mask"] = packed["pixel_attention_mask"].to(pixel_values.device)
    packed["spatial_shapes"] = packed["spatial_shapes"].to(spatial_shapes.device)
    return packed
