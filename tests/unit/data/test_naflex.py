"""data/naflex.py: SigLIP 2's NaFlex pipeline against transformers' Siglip2ImageProcessor (its target size, and the
same image through the eval path and the processor), a hand-computed patch order, the training crop against PIL's
resize of the same box, and the collator's padded batch."""

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from disco_clip_ds.data.collate import ClipCollator
from disco_clip_ds.data.naflex import NaflexTransform, PatchNormalize, naflex_size, pack_patches, patchify
from disco_clip_ds.data.transforms import random_resized_crop_box
from disco_clip_ds.testing.launch import TOKENIZER_DIR


def processor(patch_size, budget):
    """What transformers gives for Siglip2ImageProcessor here: without torchvision, its PIL fallback
    Siglip2ImageProcessorPil (asserted, so that a torchvision install that changes it shows)."""
    from transformers import Siglip2ImageProcessor

    proc = Siglip2ImageProcessor(patch_size=patch_size, max_num_patches=budget)
    assert type(proc).__name__ == "Siglip2ImageProcessorPil"
    return proc


@pytest.mark.parametrize("patch_size, budget", [(16, 256), (4, 64), (4, 144), (14, 576), (16, 16)])
def test_the_target_size_is_transformers_over_a_grid_of_image_sizes(patch_size, budget):
    from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

    sizes = [*range(1, 120, 5), 224, 333, 480, 640, 1024, 2999]
    for height in sizes:
        for width in sizes:
            expected = get_image_size_for_max_num_patches(height, width, patch_size, budget)
            assert naflex_size(height, width, patch_size, budget) == expected, (height, width)


def test_hand_computed_target_sizes():
    assert naflex_size(64, 64, 4, 256) == (64, 64)  # 16 x 16 patches: the whole budget
    assert naflex_size(64, 64, 4, 64) == (32, 32)  # 8 x 8
    assert naflex_size(100, 200, 10, 50) == (50, 100)  # 5 x 10 = 50, the aspect kept exactly
    assert naflex_size(30, 10, 10, 1) == (10, 10)  # one patch at least, whatever the aspect


def test_patches_are_row_by_row_with_channels_innermost():
    pixels = torch.arange(3 * 2 * 4, dtype=torch.uint8).reshape(3, 2, 4)  # (c, h, w), patch 2: 1 x 2 patches
    grid = patchify(pixels, 2)
    assert grid.shape == (1, 2, 12)
    # the second patch: columns 2..3 of rows 0..1, each pixel's (r, g, b)
    expected = [pixels[c, y, x].item() for y in (0, 1) for x in (2, 3) for c in range(3)]
    assert grid[0, 1].tolist() == expected


def test_the_eval_path_gives_the_image_processors_tensors_exactly():
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 64), (50, 90), (120, 33))
    ]
    gray = Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8))
    for budget in (64, 144, 256):
        # the processor takes RGB only (gray fails its 3-channel mean): it is handed the gray image as RGB
        expected = processor(4, budget)(images=[*images, gray.convert("RGB")], return_tensors="pt")
        transform = NaflexTransform(4, budget, train=False)
        batch = pack_patches([transform.pixels(image) for image in (*images, gray)], budget)
        batch["pixel_values"] = PatchNormalize().batch(batch["pixel_values"], batch["pixel_attention_mask"])
        assert batch.keys() == expected.keys()
        for key, value in expected.items():
            assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), (budget, key)


def _jpeg(rng, size):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).resize((size[0] * 4, size[1] * 4))
    smooth = Image.fromarray(rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8))
    smooth.resize(size, Image.BICUBIC).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_training_grids_keep_the_crops_aspect_fit_the_budget_and_follow_the_samples_rng():
    """The crop box is the recipe's (same RNG, same box); the grid is PIL's bicubic resize of that box to
    naflex_size of it, within 2 levels (torch's uint8 kernel vs PIL's, as the square crops)."""
    rng = np.random.default_rng(1)
    for i, size in enumerate(((96, 64), (64, 64), (40, 120))):
        data = _jpeg(rng, size)
        grid = NaflexTransform(4, 144).from_bytes(data, random.Random(f"k{i}"))
        assert torch.equal(grid, NaflexTransform(4, 144).from_bytes(data, random.Random(f"k{i}")))
        image = Image.open(io.BytesIO(data)).convert("RGB")
        box = random_resized_crop_box(*image.size, random.Random(f"k{i}"))
        height, width = naflex_size(box[3] - box[1], box[2] - box[0], 4, 144)
        assert grid.shape == (height // 4, width // 4, 48) and grid.shape[0] * grid.shape[1] <= 144
        pil = np.array(image.crop(box).resize((width, height), Image.BICUBIC))
        diff = (grid.to(torch.int16) - patchify(torch.from_numpy(pil).permute(2, 0, 1).contiguous(), 4)).abs()
        assert diff.max() <= 2, i


def test_the_collator_pads_to_the_budget_and_normalises_in_the_worker_or_on_the_device_alike():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    g = torch.Generator().manual_seed(0)
    grids = [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for shape in ((3, 5, 48), (4, 4, 48))]
    samples = [(grids[0], "seven"), (grids[1], "eight")]
    worker = ClipCollator(tokenizer, 12, mean=(0.5,) * 3, std=(0.5,) * 3, max_num_patches=20)(samples)
    raw = ClipCollator(tokenizer, 12, mean=(0.5,) * 3, std=(0.5,) * 3, max_num_patches=20, normalize=False)(samples)
    assert worker["spatial_shapes"].tolist() == [[3, 5], [4, 4]]
    assert worker["pixel_attention_mask"].tolist() == [[1] * 15 + [0] * 5, [1] * 16 + [0] * 4]
    assert raw["pixel_values"].dtype == torch.uint8 and raw["pixel_values"].shape == (2, 20, 48)
    # hand-computed: (x / 255 - 0.5) / 0.5 at each real patch, 0 in the padding
    expected = torch.zeros(2, 20, 48)
    expected[0, :15] = (grids[0].reshape(15, 48).double() / 255 * 2 - 1).float()
    expected[1, :16] = (grids[1].reshape(16, 48).double() / 255 * 2 - 1).float()
    torch.testing.assert_close(worker["pixel_values"], expected, rtol=0, atol=1e-6)
    on_device = PatchNormalize().batch(raw["pixel_values"], raw["pixel_attention_mask"])
    assert torch.equal(on_device, worker["pixel_values"])


def test_a_grid_over_the_budget_is_refused():
    with pytest.raises(ValueError, match="an image of 25 patches exceeds the budget of 20"):
        pack_patches([torch.zeros(5, 5, 48, dtype=torch.uint8)], 20)
