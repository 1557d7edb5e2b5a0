"""Image bytes -> uint8 crop -> normalised batch: decode (at reduced size where a JPEG allows), augment, normalise.

Every image is decoded by data/decode.py (the pixel cap, the conversions, the reasons for a skip); training crops are
resized by torch's uint8 bicubic kernel (resize.py), the eval transform by PIL's, as CLIPImageProcessor computes it.
The per-sample work stays on uint8; the float batch is made in one place (`Normalize`), with the same float32
operations as normalising each crop alone, so the batch is bit-identical to the per-sample float path: by the
collator in the DataLoader worker, or (`Normalize.batch`) by the trainer on the device, from the uint8 batch the
collator then hands over.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from disco_clip_ds.data.decode import DRAFT_SCALES, MAX_IMAGE_PIXELS, EncodedImage, centred_aspect, to_rgb
from disco_clip_ds.data.resize import resized_crop

CROP_SCALE = (0.9, 1.0)  # OpenCLIP's RandomResizedCrop scale for CLIP training
CROP_RATIO = (3 / 4, 4 / 3)


def random_resized_crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params with our own RNG (torchvision is not a dependency here).

    A per-sample RNG seeded from the sample key makes the augmentation independent of how samples are spread
    over ranks and workers. Returns the crop box (left, top, right, bottom).
    """
    area = width * height
    log_ratio = (np.log(CROP_RATIO[0]), np.log(CROP_RATIO[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*CROP_SCALE)
        aspect = float(np.exp(rng.uniform(*log_ratio)))
        w, h = int(round((target_area * aspect) ** 0.5)), int(round((target_area / aspect) ** 0.5))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    side = min(width, height)  # fallback: central crop, as torchvision does
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def augmentation_rng(seed: int, key: str, augmentation: int) -> random.Random:
    """The RNG of augmentation `augmentation` of sample `key`, as `data embed --augmentations K` draws it: seeded from
    the string f"{seed}/augmentation/{augmentation}/{key}" (a string seed is hashed by sha512, the same in every
    process and Python version), so that a sample's K boxes depend on nothing but the seed, its key and a."""
    return random.Random(f"{seed}/augmentation/{augmentation}/{key}")


def crop_boxes(data_or_size: bytes | tuple[int, int], k: int, seed: int, key: str) -> list[tuple[int, int, int, int]]:
    """The crop boxes (left, top, right, bottom, source pixels) of augmentations 0..k-1 of sample `key`: each the
    training crop (`random_resized_crop_box`, the first draw of `augmentation_rng(seed, key, a)`) of the image
    `data_or_size` (its encoded bytes, whose header alone is read, or its (width, height)). The training pipeline has
    no flip and no RandAugment: the box is the whole augmentation."""
    width, height = data_or_size if isinstance(data_or_size, tuple) else EncodedImage(data_or_size).size
    return [random_resized_crop_box(width, height, augmentation_rng(seed, key, a)) for a in range(k)]


def check_box(box: Sequence[int], size: tuple[int, int]) -> tuple[int, int, int, int]:
    """`box` as four ints, once it is a non-empty box inside an image `size` (width, height) px large; a ValueError
    otherwise (a box stored for another image)."""
    left, top, right, bottom = (int(v) for v in box)
    if not (0 <= left < right <= size[0] and 0 <= top < bottom <= size[1]):
        raise ValueError(f"crop box {(left, top, right, bottom)} does not fit a {size[0]} x {size[1]} image")
    return left, top, right, bottom


def draft_scale(box: tuple[int, int, int, int], size: int) -> int:
    """The largest JPEG reduction (8, 4, 2, else 1) after which `box` still spans at least `size` pixels a side."""
    width, height = box[2] - box[0], box[3] - box[1]
    return next((s for s in DRAFT_SCALES if min(width, height) // s >= size), 1)


class Normalize:
    """uint8 crops -> float32 (x / 255 - mean) / std, in that order: the same float32 operations, element by
    element, as normalising each crop alone in float32 (so bit-identical to it)."""

    def __init__(self, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __call__(self, pixels: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """A crop (3, size, size) -> its float tensor; a batch (n, 3, size, size) or a list of n crops -> the
        float batch (n, 3, size, size), written straight into `out` (float32, that shape) when given."""
        single = torch.is_tensor(pixels) and pixels.dim() == 3
        crops = [pixels] if single else pixels
        if out is None:
            out = torch.empty((len(crops), *crops[0].shape), dtype=torch.float32)
        for crop, row in zip(crops, out):
            # Crop by crop: each pass runs over one crop's ~600 KB, which stays in cache for the next pass; three
            # passes over a whole batch (150 MB at 256 x 224 px) would each go out to memory and back.
            row.copy_(crop).div_(255.0).sub_(self.mean).div_(self.std)
        return out[0] if single else out

    def batch(self, pixels: torch.Tensor) -> torch.Tensor:
        """A uint8 batch (n, 3, size, size) on any device -> float32 (x / 255 - mean) / std, computed where it lies
        (on the GPU when training there): bit-identical to `__call__`, whose operations it repeats."""
        scale, mean, std = self._constants(pixels.device)
        return pixels.to(torch.float32).div_(scale).sub_(mean).div_(std)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        # Kept per device: copying them there each step would wait on the device's queue. 255 is a tensor there, not
        # a Python number: CUDA divides by a CPU scalar as a multiplication by its reciprocal, which can differ in
        # the last bit from the division done on the CPU.
        if device not in self._on_device:
            self._on_device[device] = tuple(
                t.to(device) for t in (torch.tensor(255.0, dtype=torch.float32), self.mean, self.std)
            )
        return self._on_device[device]


class ImageTransform:
    """Image -> normalised float tensor (3, size, size): random resized crop when training, else resize + centre
    crop (CLIPImageProcessor's eval transform), bicubic, normalised with `mean`/`std` (CLIP's by default; the model's
    image processor's when it has its own, e.g. SigLIP's 0.5).

    `pixels` stops before normalisation (uint8), `normalize` (a `Normalize`) does it, also for a whole batch,
    bit-identically; `from_bytes` decodes too. Training crops are decoded by libjpeg-turbo (PIL for other formats)
    and resized by torch's uint8 bicubic kernel, which keeps them within about a level of PIL's resize of the same
    box (tests/unit/data/test_transforms.py bounds it); with `draft`, a JPEG whose crop is at least twice the output
    size is decoded at 1/2, 1/4 or 1/8 scale (the largest that still leaves the crop >= size a side). The eval
    transform is PIL's throughout, as the image processor's.
    """

    def __init__(self, image_size: int, train: bool = True, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, draft=True):
        self.image_size, self.train, self.draft = image_size, train, draft
        self.normalize = Normalize(mean, std)

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        return self.normalize(self.pixels(image, rng))

    def pixels(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        """The crop of a PIL image as a uint8 tensor (3, size, size), before normalisation."""
        image = to_rgb(image)
        if not self.train:
            return self._eval_crop(centred_aspect(image))
        box = random_resized_crop_box(*image.size, rng or random.Random())
        return resized_crop(np.array(image), box, image.size, self.image_size)

    def from_bytes(
        self,
        data: bytes,
        rng: random.Random | None,
        max_pixels: int = MAX_IMAGE_PIXELS,
        box: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Encoded image -> uint8 crop (3, size, size), as `pixels` of the decoded image, but decoded at reduced
        size when `draft` allows it. With `box` (left, top, right, bottom, in source pixels; e.g. a stored
        augmentation's) the crop is that box instead of one drawn from `rng`, train or not: the same decode (draft
        rule included) and resize as the drawn path gives for that box, bit for bit. A BadImage (data/decode.py: its
        one-line reason) for data that is not an image or an image of more than `max_pixels` pixels (refused before
        decoding); a ValueError for a box outside the image."""
        encoded = EncodedImage(data, max_pixels)
        if box is None and not self.train:
            return self._eval_crop(encoded.whole())
        if box is None:
            box = random_resized_crop_box(*encoded.size, rng)
        return self.box_crops(encoded, [box])[0]

    def box_crops(
        self, encoded: EncodedImage, boxes: Sequence[Sequence[int]], decoded: dict[int, np.ndarray] | None = None
    ) -> list[torch.Tensor]:
        """The uint8 crops (3, size, size) of several boxes of one image (its header read: `EncodedImage`), each as
        `from_bytes(data, None, box=box)` gives it, bit for bit, the image decoded once per draft scale: `decoded`
        ({scale: pixels}) keeps the decodes, and may be shared by transforms of other sizes (several teachers).
        `EncodedImage` has checked the image's pixel count. A ValueError for a box outside the image."""
        decoded = {} if decoded is None else decoded
        crops = []
        for box in boxes:
            box = check_box(box, encoded.size)
            scale = draft_scale(box, self.image_size) if self.draft else 1
            if scale not in decoded:
                decoded[scale] = encoded.decode(scale)
            crops.append(resized_crop(decoded[scale], box, encoded.size, self.image_size))
        return crops

    def _eval_crop(self, image: Image.Image) -> torch.Tensor:
        """Resize the short side of an RGB image to size, then the central size x size: CLIPImageProcessor's steps,
        with PIL. The caller has cut the image to data/decode.py's MAX_ASPECT, which bounds what the resize makes."""
        size = self.image_size
        scale = size / min(image.size)
        new_size = (max(size, round(image.width * scale)), max(size, round(image.height * scale)))
        image = image.resize(new_size, Image.BICUBIC)
        left, top = (image.width - size) // 2, (image.height - size) // 2
        image = image.crop((left, top, left + size, top + size))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)  # a writable copy, as torch wants
