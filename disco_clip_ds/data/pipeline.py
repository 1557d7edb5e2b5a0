"""Training stream: webdataset shards -> decode -> augment -> tokenize -> collated CLIP batches.

Runs inside DataLoader workers. Each (rank, worker) reads a disjoint set of shards and passes over it again
and again, in a fresh order each time, so multi-epoch runs never run dry (the Trainer stops at max_steps).
Unreadable shards and corrupt or incomplete samples are skipped and counted in a counter shared by all workers.
"""

from __future__ import annotations

import io
import itertools
import logging
import multiprocessing
import random

import numpy as np
import torch
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from webdataset.tariterators import tarfile_samples

from .shards import IMAGE_EXTS, epoch_order, shards_for_reader

logger = logging.getLogger(__name__)

TEXT_KEYS = ("txt", "text", "caption")
# Images above this many pixels are skipped unread: a small file can hold a huge flat image (a decompression bomb)
# whose decoding alone would take gigabytes; img2dataset's resized shards are far below it.
MAX_IMAGE_PIXELS = 50_000_000
CROP_SCALE = (0.9, 1.0)  # OpenCLIP's RandomResizedCrop scale for CLIP training
CROP_RATIO = (3 / 4, 4 / 3)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to RGB; transparent pixels become white rather than whatever colour they hide."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


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


class ImageTransform:
    """PIL image -> normalised float tensor (3, size, size): random resized crop when training, else resize +
    centre crop (CLIPImageProcessor's eval transform), bicubic, CLIP mean/std."""

    def __init__(self, image_size: int, train: bool = True):
        self.image_size, self.train = image_size, train
        self.mean = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
        self.std = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        image = to_rgb(image)
        size = self.image_size
        if self.train:
            box = random_resized_crop_box(*image.size, rng or random.Random())
            image = image.resize((size, size), Image.BICUBIC, box=box)
        else:
            scale = size / min(image.size)
            new_size = (max(size, round(image.width * scale)), max(size, round(image.height * scale)))
            image = image.resize(new_size, Image.BICUBIC)
            left, top = (image.width - size) // 2, (image.height - size) // 2
            image = image.crop((left, top, left + size, top + size))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - self.mean) / self.std


class ShardStream(torch.utils.data.IterableDataset):
    """Endless stream of (pixel_values, caption) from webdataset shards.

    `rank`/`world_size` are this process's place among the readers (pass 0/1 when one process reads for all,
    e.g. accelerate's dispatch_batches); `num_workers`, the DataLoader workers per rank, is only used to check
    up front that every reader gets a shard. Samples whose caption is empty or whitespace, and images of more
    than `max_image_pixels` pixels, are skipped. `skipped` counts skipped samples and shards, `decoded` the samples
    produced, across all workers.
    """

    def __init__(
        self,
        urls: list[str],
        image_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        train: bool = True,
        num_workers: int = 0,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ):
        super().__init__()
        self.urls, self.rank, self.world_size, self.seed = list(urls), rank, world_size, seed
        self.max_image_pixels = max_image_pixels
        self.shuffle_buffer = shuffle_buffer
        self.transform = ImageTransform(image_size, train=train)
        spawn = multiprocessing.get_context("spawn")
        self.skipped, self.decoded = spawn.Value("q", 0), spawn.Value("q", 0)  # shared with forked/spawned workers
        workers = max(1, num_workers)
        shards_for_reader(self.urls, rank * workers, world_size * workers)  # fail early, in the main process

    def _count_skip(self, what: str, error: BaseException | str) -> None:
        with self.skipped.get_lock():
            self.skipped.value += 1
        logger.warning("skipping %s: %s", what, error)

    def _reader(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self):
        reader, num_readers = self._reader()
        shards = shards_for_reader(self.urls, reader, num_readers)
        rng = random.Random(f"{self.seed}/shuffle/{reader}")
        samples = self._decoded(shards, reader)
        if self.shuffle_buffer <= 1:
            yield from samples
            return
        buffer = []
        for sample in samples:  # reservoir-style buffer, as webdataset's shuffle()
            buffer.append(sample)
            if len(buffer) >= self.shuffle_buffer:
                yield buffer.pop(rng.randrange(len(buffer)))

    def _decoded(self, shards: list[str], reader: int):
        for epoch in itertools.count():
            produced = 0
            for sample in self._raw_samples(epoch_order(shards, self.seed, epoch, reader)):
                item = self._decode(sample, epoch)
                if item is not None:
                    produced += 1
                    with self.decoded.get_lock():
                        self.decoded.value += 1
                    yield item
            if produced == 0:  # without this an unreadable shard set would spin forever
                raise RuntimeError(f"no readable samples in shards {shards}: check the paths and the tar files")

    def _raw_samples(self, shards: list[str]):
        def on_error(error: BaseException) -> bool:
            self._count_skip("unreadable shard or tar member", error)
            return True  # keep going with the next member or shard

        return tarfile_samples(({"url": url} for url in shards), handler=on_error)

    def _decode(self, sample: dict, epoch: int):
        key = sample.get("__key__", "?")
        image_key = next((k for k in IMAGE_EXTS if k in sample), None)
        text_key = next((k for k in TEXT_KEYS if k in sample), None)
        if image_key is None or text_key is None:
            self._count_skip(f"sample {key} of {sample.get('__url__')}", "no image or no caption")
            return None
        try:
            caption = sample[text_key].decode("utf-8").strip()
            if not caption:
                raise ValueError("empty caption")
            with Image.open(io.BytesIO(sample[image_key])) as image:  # reads the header only
                if image.width * image.height > self.max_image_pixels:
                    raise ValueError(f"{image.width} x {image.height} pixels, above {self.max_image_pixels}")
                image.load()
                rng = random.Random(f"{self.seed}/{epoch}/{key}")
                pixels = self.transform(image, rng)
        except Exception as error:  # PIL raises many types for corrupt data; any of them means skip this one
            self._count_skip(f"sample {key} of {sample.get('__url__')}", error)
            return None
        return pixels, caption


class ClipCollator:
    """List of (pixel_values, caption) -> {"pixel_values", "input_ids", "attention_mask"}: tensors only, so that
    accelerate can dispatch them, and no `labels` (the model computes its own loss). Captions are padded to
    `max_length` so every batch has one shape."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch: list[tuple[torch.Tensor, str]]) -> dict[str, torch.Tensor]:
        pixels, captions = zip(*batch)
        tokens = self.tokenizer(
            list(captions), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return {
            "pixel_values": torch.stack(pixels),
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
        }
