"""data/transforms.py: RGB conversion, CLIP normalisation, crops drawn from the RNG alone; and the fast input path
(uint8 crops, libjpeg-turbo decoding, torch's uint8 resize, draft decoding, bulk normalisation in the collator)
against the paths written out below: PIL's crop as training computed it before (bit for bit for the eval crop, within
a stated bound for the training crop), and per-sample float normalisation (bit for bit)."""

import importlib.util
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoTokenizer
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from disco_clip_ds.data.collate import ClipCollator
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.transforms import ImageTransform, draft_scale, random_resized_crop_box, to_rgb
from disco_clip_ds.testing.launch import TOKENIZER_DIR

SIGLIP = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
SKLEARN = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])  # found, not imported (seconds)
PHOTO = SKLEARN / "datasets" / "images" / "china.jpg"  # a 640 x 427 photograph, JPEG


def pil_crop(data: bytes, size: int, train: bool, rng: random.Random) -> torch.Tensor:
    """The decode -> crop path as it was before the fast decoder and resizer: a full-size PIL decode, PIL's bicubic
    resize (of the random box when training; of the short side, then the centre, for eval)."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        image = to_rgb(image)
        if train:
            box = random_resized_crop_box(*image.size, rng)
            image = image.resize((size, size), Image.BICUBIC, box=box)
        else:
            scale = size / min(image.size)
            new_size = (max(size, round(image.width * scale)), max(size, round(image.height * scale)))
            image = image.resize(new_size, Image.BICUBIC)
            left, top = (image.width - size) // 2, (image.height - size) // 2
            image = image.crop((left, top, left + size, top + size))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def training_crop(data: bytes, size: int, rng: random.Random) -> torch.Tensor:
    """The training crop as the new path means it, written with PIL's decoder: the same box, its pixels resized by
    torch's uint8 bicubic antialiased kernel."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        pixels = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1)
    left, top, right, bottom = random_resized_crop_box(pixels.shape[2], pixels.shape[1], rng)
    crop = pixels[:, top:bottom, left:right].unsqueeze(0)
    return F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True)[0]


def float_path(crop: torch.Tensor, mean, std) -> torch.Tensor:
    """One uint8 crop normalised alone, in float32, as the per-sample path did."""
    pixels = torch.from_numpy(crop.permute(1, 2, 0).numpy().astype(np.float32) / 255.0).permute(2, 0, 1)
    return (pixels - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def reference(data: bytes, size: int, train: bool, rng: random.Random, mean, std) -> torch.Tensor:
    """The crop the path should make (PIL's for eval, the new training crop), normalised alone."""
    crop = training_crop(data, size, rng) if train else pil_crop(data, size, False, rng)
    return float_path(crop, mean, std)


def textured(rng: np.random.Generator, size: tuple[int, int], mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    """A crop of the photograph, resized to `size` and saved as img2dataset does (JPEG quality 95)."""
    photo = Image.open(PHOTO)
    w, h = int(rng.integers(200, 400)), int(rng.integers(200, 400))
    left, top = int(rng.integers(0, photo.width - w)), int(rng.integers(0, photo.height - h))
    image = photo.crop((left, top, left + w, top + h)).resize(size, Image.BICUBIC).convert(mode)
    buf = io.BytesIO()
    image.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """img2dataset-like images (256 px on the short side) and odd ones: gray, RGBA PNG, CMYK, smaller than 224."""
    rng = np.random.default_rng(0)
    sizes = [(256, 341), (384, 256), (256, 256), (256, 455), (300, 256)]
    out = [textured(rng, s) for s in sizes]
    out += [textured(rng, (256, 320), "L"), textured(rng, (280, 256), "RGBA", "PNG"), textured(rng, (256, 300), "CMYK")]
    return out + [textured(rng, (150, 120))]


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("mean_std", [(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD), SIGLIP], ids=["clip", "siglip"])
def test_uint8_crops_normalised_per_batch_equal_the_float_path_bit_for_bit(images, train, mean_std):
    """The batch the collator normalises equals per-sample float32 normalisation of the crop exactly: PIL's crop
    for eval; for training, the box's pixels (libjpeg-turbo's decode, equal to PIL's) resized by torch's kernel."""
    transform = ImageTransform(224, train=train, mean=mean_std[0], std=mean_std[1])
    expected = [reference(data, 224, train, random.Random(f"k{i}"), *mean_std) for i, data in enumerate(images)]
    crops = [transform.from_bytes(data, random.Random(f"k{i}")) for i, data in enumerate(images)]
    assert all(c.dtype == torch.uint8 for c in crops)
    collate = ClipCollator(AutoTokenizer.from_pretrained(TOKENIZER_DIR), 8, mean=mean_std[0], std=mean_std[1])
    batch = collate([(c, "a photo") for c in crops])["pixel_values"]
    assert batch.dtype == torch.float32 and torch.equal(batch, torch.stack(expected))
    # ImageTransform's own call (a PIL image in, a normalised tensor out) gives the same crop
    with Image.open(io.BytesIO(images[0])) as image:
        assert torch.equal(transform(image, random.Random("k0")), expected[0])


ON_DEVICE = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("device", ON_DEVICE)
@pytest.mark.parametrize("mean_std", [(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD), SIGLIP], ids=["clip", "siglip"])
def test_a_uint8_batch_normalised_on_the_device_equals_the_worker_normalised_one_bit_for_bit(images, mean_std, device):
    """ClipCollator(normalize=False) in a DataLoader worker hands over the uint8 batch (in shared memory); the
    trainer's `collator.normalize.batch` on the device (the CPU as CPU ranks would; a GPU where there is one) makes
    the float32 batch the workers make by default, and the per-sample float path, exactly."""
    transform = ImageTransform(224, train=True, mean=mean_std[0], std=mean_std[1])
    items = [(transform.from_bytes(data, random.Random(f"k{i}")), "a photo") for i, data in enumerate(images)]
    expected = [reference(data, 224, True, random.Random(f"k{i}"), *mean_std) for i, data in enumerate(images)]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    batches = {}
    for normalize in (True, False):
        collate = ClipCollator(tokenizer, 8, mean=mean_std[0], std=mean_std[1], normalize=normalize)
        loader = torch.utils.data.DataLoader(items, batch_size=len(items), num_workers=1, collate_fn=collate)
        batches[normalize] = next(iter(loader))
    uint8 = batches[False]["pixel_values"]
    assert uint8.dtype == torch.uint8 and torch.equal(uint8, torch.stack([pixels for pixels, _ in items]))
    assert torch.equal(batches[False]["input_ids"], batches[True]["input_ids"])
    on_device = collate.normalize.batch(uint8.to(device)).cpu()
    assert on_device.dtype == torch.float32 and torch.equal(on_device, batches[True]["pixel_values"])
    assert torch.equal(on_device, torch.stack(expected))


def test_normalisation_is_the_correctly_rounded_float32_of_the_exact_value():
    """Independent of both paths: every uint8 value and channel, against float64 arithmetic."""
    values = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    collate = ClipCollator(AutoTokenizer.from_pretrained(TOKENIZER_DIR), 4)
    got = collate([(values[0], "x")])["pixel_values"][0].double()
    mean, std = (torch.tensor(v, dtype=torch.float64).view(3, 1, 1) for v in (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    exact = (values[0].double() / 255 - mean) / std
    assert (got - exact).abs().max() < 1e-6  # three float32 roundings on values of magnitude < 2.2


@pytest.mark.slow  # beyond the fast tier's time budget
def test_stream_and_collator_give_the_expected_tensors_for_every_sample(tmp_path, images):
    """Through ShardStream (key-seeded crops, draft decoding on) and ClipCollator, as training gets them."""
    import webdataset as wds

    keys = [f"{i:09d}" for i in range(len(images))]
    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        for key, data in zip(keys, images):
            ext = "png" if data.startswith(b"\x89PNG") else "jpg"
            sink.write({"__key__": key, ext: data, "txt": f"caption {key}".encode()})
    stream = ShardStream([str(tmp_path / "00000.tar")], 224, seed=3, shuffle_buffer=4)
    items = [item for item, _ in zip(stream, range(len(images)))]
    collate = ClipCollator(AutoTokenizer.from_pretrained(TOKENIZER_DIR), 8)
    batch = collate(items)
    # in a DataLoader worker the batch is written straight into shared memory: the same values
    in_worker = next(iter(torch.utils.data.DataLoader(items, batch_size=len(items), num_workers=1, collate_fn=collate)))
    assert torch.equal(in_worker["pixel_values"], batch["pixel_values"])
    for row, (_, caption, _) in zip(batch["pixel_values"], items):
        key = caption.split()[1]
        data = images[keys.index(key)]
        assert torch.equal(
            row, reference(data, 224, True, random.Random(f"3/0/{key}"), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
        )


@pytest.mark.slow  # beyond the fast tier's time budget
def test_draft_decoding_fires_only_when_the_crop_is_twice_the_size_and_stays_close():
    """A 640 x 427 photograph cropped to 128 px: every crop spans >= 2 x 128 pixels, so it decodes at half size.
    Bound: the normalised tensors differ by at most 0.25 on average and 2.0 at worst (the normalised range is
    about 4 wide); an image too small for a halved decode is untouched."""
    data = PHOTO.read_bytes()
    drafted, full = ImageTransform(128), ImageTransform(128, draft=False)
    diffs = []
    for i in range(8):
        box = random_resized_crop_box(640, 427, random.Random(f"d{i}"))
        assert draft_scale(box, 128) == 2 and draft_scale(box, 224) == 1
        a = drafted.normalize(drafted.from_bytes(data, random.Random(f"d{i}")))
        b = full.normalize(full.from_bytes(data, random.Random(f"d{i}")))
        assert torch.equal(b, reference(data, 128, True, random.Random(f"d{i}"), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
        diffs.append((a - b).abs())
    diff = torch.stack(diffs)
    assert 0 < diff.mean() < 0.25 and diff.max() < 2.0
    # at 224 the same photograph needs its full size: the draft path gives the same bytes
    assert torch.equal(
        ImageTransform(224).from_bytes(data, random.Random("x")),
        ImageTransform(224, draft=False).from_bytes(data, random.Random("x")),
    )


@pytest.mark.slow  # beyond the fast tier's time budget
def test_training_crops_stay_within_a_stated_bound_of_pils_crop_of_the_same_box(images):
    """The new training crop against PIL's on the same box, on img2dataset-like images and the odd ones (gray,
    RGBA PNG, CMYK, upscaled), in uint8 levels. Against PIL's crop, then bicubic resize (torchvision's
    RandomResizedCrop of a PIL image, open_clip's): mean < 0.15, max <= 2. Against PIL's resize of the box within
    the image (the old training crop), which lets the filter read pixels beyond the box and differs from PIL's own
    crop-then-resize by up to 5 levels inside: mean < 0.15, max <= 32, the most along the crop's edge of an
    upscaled image."""
    cropped_first, old = [], []
    for i, data in enumerate(images):
        new = ImageTransform(224).from_bytes(data, random.Random(f"k{i}")).to(torch.int16)
        image = to_rgb(Image.open(io.BytesIO(data)))
        box = random_resized_crop_box(*image.size, random.Random(f"k{i}"))
        pil = np.array(image.crop(box).resize((224, 224), Image.BICUBIC))
        cropped_first.append((new - torch.from_numpy(pil).permute(2, 0, 1)).abs())
        old.append((new - pil_crop(data, 224, True, random.Random(f"k{i}"))).abs())
    cropped_first, old = torch.stack(cropped_first).float(), torch.stack(old).float()
    assert 0 < cropped_first.mean() < 0.15 and cropped_first.max() <= 2
    assert old.mean() < 0.15 and old.max() <= 32


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("processor", ["clip", "siglip"])
def test_eval_reads_pixels_as_before_and_only_training_takes_the_new_path(images, processor, tmp_path, monkeypatch):
    """Evaluation's pixels are the model's image processor's, on PIL's decode, bit for bit (what the exported
    model's processor computes; data/decode.py's one decode gives PIL's pixels); the eval transform is PIL's crop;
    the torch resizer serves train=True only (made to fail here, it fails only the training crop)."""
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    from disco_clip_ds.data import transforms
    from disco_clip_ds.eval.sources import shard_batches
    from disco_clip_ds.testing.images import write_samples

    def refused(*a, **k):
        raise AssertionError("the training path")

    monkeypatch.setattr(transforms, "resized_crop", refused)
    made = CLIPImageProcessor(size={"shortest_edge": 224}) if processor == "clip" else SiglipImageProcessor()
    jpegs = [data for data in images if data.startswith(b"\xff\xd8")]
    write_samples(tmp_path, [{"jpg": data, "cls": str(i)} for i, data in enumerate(jpegs)], per_shard=4)
    pixels = torch.cat([batch for batch, _ in shard_batches(str(tmp_path), made, "cls", 3)])  # DecodedBatch: a pair
    decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in jpegs]
    assert torch.equal(pixels, made(images=decoded, return_tensors="pt")["pixel_values"])
    for i, data in enumerate(images):
        eval_crop = ImageTransform(224, train=False).from_bytes(data, random.Random(f"k{i}"))
        assert torch.equal(eval_crop, pil_crop(data, 224, False, random.Random(f"k{i}")))
    with pytest.raises(AssertionError, match="the training path"):
        ImageTransform(224).from_bytes(images[0], random.Random("k0"))


# --- the transform itself ---


def test_to_rgb_converts_gray_and_composites_alpha_on_white():
    assert to_rgb(Image.new("L", (4, 4), 7)).getpixel((0, 0)) == (7, 7, 7)
    assert to_rgb(Image.new("RGBA", (4, 4), (10, 20, 30, 0))).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("RGBA", (4, 4), (10, 20, 30, 255))).getpixel((0, 0)) == (10, 20, 30)


def test_transform_normalises_with_clip_mean_std():
    image = Image.new("RGB", (50, 70), (255, 0, 128))
    for train in (True, False):
        x = ImageTransform(32, train=train)(image, random.Random(0))
        assert x.shape == (3, 32, 32)
        expected = (
            torch.tensor([1.0, 0.0, 128 / 255]) - torch.tensor([0.48145466, 0.4578275, 0.40821073])
        ) / torch.tensor([0.26862954, 0.26130258, 0.27577711])
        torch.testing.assert_close(x[:, 16, 16], expected, atol=2e-3, rtol=0)


def test_random_crop_depends_on_the_rng_only():
    gradient = Image.fromarray(np.tile(np.arange(100, dtype=np.uint8), (80, 1)))
    t = ImageTransform(16, train=True)
    a, b = t(gradient, random.Random("k1")), t(gradient, random.Random("k1"))
    assert torch.equal(a, b)
    assert any(not torch.equal(a, t(gradient, random.Random(f"k{i}"))) for i in range(2, 6))
