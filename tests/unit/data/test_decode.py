"""data/decode.py and data/resize.py against PIL, the decoder and resizer training used before: libjpeg-turbo through
simplejpeg gives PIL's pixels bit for bit (full size and DCT-scaled, colour, gray, progressive), odd files go to PIL
(CMYK, PNG, corrupt: PIL's error), and torch's uint8 bicubic resize stays within a stated bound of PIL's."""

import importlib.util
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from disco_clip_ds.data import decode
from disco_clip_ds.data.decode import BadImage, EncodedImage, to_rgb
from disco_clip_ds.data.resize import resized_crop
from disco_clip_ds.data.transforms import random_resized_crop_box

SKLEARN = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])  # found, not imported (seconds)
PHOTO = SKLEARN / "datasets" / "images" / "china.jpg"  # 640 x 427, 4:4:4


def encoded(mode: str = "RGB", fmt: str = "JPEG", size=(640, 427), **save) -> bytes:
    buf = io.BytesIO()
    Image.open(PHOTO).resize(size, Image.BICUBIC).convert(mode).save(buf, fmt, **save)
    return buf.getvalue()


def pil_rgb(data: bytes, scale: int = 1) -> np.ndarray:
    """What training decoded with before: PIL, drafted to 1/scale, then RGB."""
    with Image.open(io.BytesIO(data)) as image:
        if scale > 1:
            image.draft(None, (image.width // scale, image.height // scale))
        image.load()
        return np.array(to_rgb(image))


JPEGS = {
    "photo 4:4:4": PHOTO.read_bytes(),
    "4:2:0 q95": encoded(quality=95, subsampling=2),
    "odd size 4:2:2": encoded(size=(333, 257), quality=90, subsampling=1),
    "gray": encoded("L"),
    "progressive": encoded(quality=90, progressive=True),
}


@pytest.mark.parametrize("name", list(JPEGS))
def test_jpegs_decode_to_pils_pixels_bit_for_bit_at_every_scale(name, monkeypatch):
    data = JPEGS[name]
    image = EncodedImage(data)
    monkeypatch.setattr(image, "_pil", lambda scale: pytest.fail("went to PIL"))
    assert image.size == Image.open(io.BytesIO(data)).size
    for scale in (1, 2, 4, 8):
        got = image.decode(scale)
        assert got.dtype == np.uint8 and np.array_equal(got, pil_rgb(data, scale)), scale


@pytest.mark.parametrize(
    "data",
    [encoded("CMYK"), encoded("RGBA", "PNG", size=(90, 70)), encoded(fmt="WEBP", size=(90, 70)), encoded("P", "GIF")],
    ids=["cmyk-jpeg", "rgba-png", "webp", "gif"],
)
def test_other_images_go_to_pil_as_before(data, monkeypatch):
    monkeypatch.setattr(decode.simplejpeg, "decode_jpeg", lambda *a, **k: pytest.fail("went to libjpeg-turbo"))
    image = EncodedImage(data)
    assert image.size == Image.open(io.BytesIO(data)).size
    assert np.array_equal(image.decode(2), pil_rgb(data, 2))


def test_a_corrupt_jpeg_is_refused_with_pils_reason_and_a_pil_readable_one_decodes():
    data = PHOTO.read_bytes()
    with pytest.raises(BadImage, match=r"^unreadable image \(OSError: image file is truncated"):
        EncodedImage(data[: len(data) // 3]).decode()
    with pytest.raises(BadImage, match=r"^not an image \(none of PIL's formats recognises its 21 bytes\)$"):
        EncodedImage(b"\xff\xd8\xff not a jpeg at all")
    # cut short but closed by an end marker: libjpeg warns (simplejpeg refuses in strict mode), PIL reads it
    cut = data[: len(data) // 2] + b"\xff\xd9"
    assert np.array_equal(EncodedImage(cut).decode(), pil_rgb(cut))


def test_the_resized_crop_is_close_to_pils_crop_then_bicubic_resize():
    """img2dataset-sized images (256 px short side) and upscaled small ones, cropped to 224: against PIL's crop,
    then bicubic resize (torchvision's RandomResizedCrop of a PIL image), |new - PIL| < 0.05 of a uint8 level on
    average and <= 8 at most (1 or 2 but for one image): the same filter; the fixed-point rounding, and the order of
    the passes, whose intermediate is clipped to 0-255, differ."""
    rng = np.random.default_rng(0)
    photo = Image.open(PHOTO).convert("RGB")
    diffs = []
    for i in range(12):
        short = 256 if i < 10 else 150
        w, h = (short, int(rng.integers(short, 456))) if i % 2 else (int(rng.integers(short, 456)), short)
        left, top = int(rng.integers(0, photo.width - 256)), int(rng.integers(0, photo.height - 256))
        image = photo.crop((left, top, left + 256, top + 256)).resize((w, h), Image.BICUBIC)
        box = random_resized_crop_box(w, h, random.Random(i))
        got = resized_crop(np.array(image), box, (w, h), 224)
        assert got.shape == (3, 224, 224) and got.dtype == torch.uint8 and got.is_contiguous()
        ref = np.array(image.crop(box).resize((224, 224), Image.BICUBIC)).astype(np.int16)
        diffs.append(np.abs(got.permute(1, 2, 0).numpy().astype(np.int16) - ref))
    diffs = np.stack(diffs)
    assert 0 < diffs.mean() < 0.05 and diffs.max() <= 8, (diffs.mean(), diffs.max())


def test_a_reduced_decode_maps_the_box_to_its_pixels():
    """A box of the full image, taken from a half-size decode: the crop equals the full decode's crop of the box
    downscaled, within the rounding of the box to whole reduced pixels."""
    data = PHOTO.read_bytes()
    box = (100, 60, 548, 400)
    full = resized_crop(EncodedImage(data).decode(1), box, (640, 427), 112)
    half = resized_crop(EncodedImage(data).decode(2), box, (640, 427), 112)
    assert np.abs(full.numpy().astype(int) - half.numpy().astype(int)).mean() < 2
    # a box thinner than a reduced pixel keeps one pixel
    assert resized_crop(EncodedImage(data).decode(8), (10, 10, 12, 12), (640, 427), 4).shape == (3, 4, 4)


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits_not_clipped():
    """M2: PIL's convert("RGB") clips 16-bit values above 255 to white (a 16-bit image then trains as a white one).
    Reference: each value's high byte, value >> 8, the rule PIL applies to 16-bit RGB PNGs (and libpng's strip_16)."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 65536, size=(33, 47), dtype=np.uint16)
    values[0, :4] = (0, 255, 256, 65535)  # the edges of the scale: 0, 0, 1, 255
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "PNG")
    with Image.open(io.BytesIO(buf.getvalue())) as opened:
        assert opened.mode == "I;16"
        assert (np.array(opened.convert("RGB"))[..., 0] == 255).mean() > 0.99  # what clipping gave
        as_int32 = opened.convert("I")  # mode I: 32-bit integers, as some readers give 16-bit samples
    reference = (values.astype(np.int64) // 256).astype(np.uint8)
    assert list(reference[0, :4]) == [0, 0, 1, 255]
    got = EncodedImage(buf.getvalue()).decode()
    assert got.shape == (33, 47, 3) and got.dtype == np.uint8
    assert all(np.array_equal(got[..., c], reference) for c in range(3))
    assert np.array_equal(np.array(to_rgb(as_int32))[..., 1], reference)
    out_of_range = Image.fromarray(np.array([[-5, 70000, 512]], dtype=np.int32))  # mode I: clipped to 0..65535 first
    assert np.array(decode.eight_bit(out_of_range)).tolist() == [[0, 255, 2]]
