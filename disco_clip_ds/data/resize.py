"""The training crop's resize: a box of a uint8 RGB image -> a size x size uint8 tensor, bicubic, antialiased.

torch's own uint8 kernel does it (`interpolate(..., mode="bicubic", antialias=True)` on a uint8 tensor: the kernel
torchvision v2's `resize` calls, vectorised for uint8): Pillow's filter (Keys' cubic, a = -0.5, widened by the
downscale factor), so the crop is PIL's crop-then-resize (torchvision's RandomResizedCrop of a PIL image) up to
fixed-point rounding (bounded in tests/unit/data/test_decode.py), with no dependency beyond torch. OpenCV's
INTER_CUBIC neither widens its filter when downscaling nor uses Pillow's a; bench/data/README.md compares them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def resized_crop(pixels: np.ndarray, box: tuple[float, ...], full: tuple[int, int], size: int) -> torch.Tensor:
    """The `box` (left, top, right, bottom) of an image `full` (width, height) px large, taken from its `pixels`
    (height, width, 3) uint8, decoded at full size or reduced, resized to a uint8 tensor (3, size, size).

    In a reduced decode the box is rounded to whole pixels of it: at most half a reduced pixel off, where PIL
    resampled the fractional box (only images at least twice the crop size are decoded reduced)."""
    height, width = pixels.shape[:2]
    sx, sy = width / full[0], height / full[1]
    left, top = round(box[0] * sx), round(box[1] * sy)
    right, bottom = max(left + 1, round(box[2] * sx)), max(top + 1, round(box[3] * sy))
    # (1, 3, h, w) in channels-last layout, as the pixels lie: no copy before the kernel
    crop = torch.from_numpy(pixels[top:bottom, left:right]).permute(2, 0, 1).unsqueeze(0)
    return F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True)[0]
