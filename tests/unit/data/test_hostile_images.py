"""Hostile images against data/decode.py, the one decode of every reader (training, eval, embed, dedup, download):
whatever the bytes or the header say, a reader gets an RGB image within the pixel cap and the aspect bound, or a
BadImage whose message is the one-line reason it skips and counts; every reader refuses the same images."""

from __future__ import annotations

import io
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from disco_clip_ds.data.decode import MAX_ASPECT, AboveCap, BadImage, EncodedImage, reason, whole_image
from disco_clip_ds.testing.images import hostile_images, image_bytes

CAP = 64 * 64  # a small cap, so that the generated images cross it
FORMATS = {  # the modes each encoder writes
    "PNG": ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"],
    "JPEG": ["L", "RGB", "CMYK"],
    "TIFF": ["LAB", "CMYK", "RGB", "I;16", "F"],
    "GIF": ["L", "P"],
    "WEBP": ["RGB", "RGBA"],
    "BMP": ["1", "L", "P", "RGB"],
}
HOSTILE = hostile_images()
# the images no reader can use: damaged or not images, and bombs (above the default cap)
UNREADABLE = {"truncated jpeg", "truncated png", "not an image", "empty", "png bomb header", "jpeg bomb header"}


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text and len(text) <= 260 and "BytesIO" not in text, text
    return text


def assert_rgb_within(image: Image.Image, cap: int) -> None:
    assert image.mode == "RGB" and image.width * image.height <= cap
    assert max(image.size) <= MAX_ASPECT * min(image.size)


@st.composite
def encoded_images(draw):
    """An image of a random format, mode and size (now and then thin, or above CAP), then maybe damaged: cut short,
    a byte changed, or (PNG) its header's size rewritten with a valid CRC."""
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    mode = draw(st.sampled_from(FORMATS[fmt]))
    width = draw(st.sampled_from([1, 2, 7, 33, 64, 65, 300, 2000]))
    height = draw(st.sampled_from([1, 3, 16, 64, 65]))
    try:
        data = image_bytes(fmt, mode, (width, height), draw(st.integers(0, 255)) if len(mode) < 3 else None)
    except (OSError, ValueError, KeyError, TypeError):  # an encoder that refuses this mode or size
        assume(False)
    damage = draw(st.sampled_from(["none", "cut", "flip", "header"]))
    if damage == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "flip":
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    elif damage == "header" and fmt == "PNG":
        size = draw(st.sampled_from([(1, 1 << 20), (1 << 16, 1 << 16), (0, 5), (300, 300)]))
        head = bytearray(data)
        head[16:24] = struct.pack(">II", *size)
        head[29:33] = struct.pack(">I", zlib.crc32(bytes(head[12:29])))
        data = bytes(head)
    return data


@settings(max_examples=15, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(encoded_images())
def test_any_bytes_give_an_rgb_image_within_the_cap_or_a_one_line_reason(data):
    try:
        image = whole_image(data, max_pixels=CAP)
    except BadImage as error:
        one_line(error)
        return
    assert_rgb_within(image, CAP)
    pixels = EncodedImage(data, CAP).decode(2)  # the training decode: the same image, whole
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_image_decodes_or_is_skipped_alike_in_every_reader(name):
    """The same outcome in training (crop and eval crop), NaFlex, data embed's teacher crops, dedup's fingerprint
    and evaluation: every reader decodes it, or every reader refuses it with the same reason."""
    from disco_clip_ds.data.curate.copies import image_fingerprint
    from disco_clip_ds.data.naflex import NaflexTransform
    from disco_clip_ds.data.transforms import ImageTransform
    from disco_clip_ds.eval.sources import decode_batch

    from unit.eval.sets import tiny_image_processor

    data = HOSTILE[name]
    readers = {
        "train": lambda: ImageTransform(32).from_bytes(data, random.Random(0)),
        "eval crop": lambda: ImageTransform(32, train=False).from_bytes(data, None),
        "naflex": lambda: NaflexTransform(8, 16).from_bytes(data, random.Random(0)),
        "naflex eval": lambda: NaflexTransform(8, 16, train=False).from_bytes(data, None),
        "fingerprint": lambda: image_fingerprint(data),
    }
    outcomes = {}
    for reader, read in readers.items():
        try:
            read()
            outcomes[reader] = None
        except BadImage as error:
            outcomes[reader] = one_line(error)
    batch = decode_batch(tiny_image_processor(), ([data], [7]))
    outcomes["eval"] = batch.skipped[0] if batch.skipped else None
    assert batch[1] == ([] if batch.skipped else [7]) and len(batch[0]) == 1  # a blank image when skipped
    assert len(set(outcomes.values())) == 1, outcomes
    assert (outcomes["eval"] is not None) == (name in UNREADABLE), outcomes


def test_the_download_refuses_bombs_and_with_a_short_side_resize_extreme_aspects():
    from disco_clip_ds.data.prep.fetch import check_image_pixels

    for name in ("png bomb header", "jpeg bomb header"):
        with pytest.raises(ValueError, match="^image above --max_image_pixels 50000000$"):
            check_image_pixels(HOSTILE[name])
    check_image_pixels(HOSTILE["thin png 1 x 200000"])  # border, keep_ratio_largest: the long side is bounded
    with pytest.raises(ValueError, match="^image of 200000 x 1 pixels, more than 20 times as long as wide") as error:
        check_image_pixels(HOSTILE["thin png 1 x 200000"], max_aspect=MAX_ASPECT)
    one_line(error.value)
    check_image_pixels(HOSTILE["truncated png"])  # not a header problem: img2dataset's decoder says why


def test_the_cap_is_inclusive_and_read_from_the_header_before_any_decode(monkeypatch):
    data = image_bytes("PNG", "RGB", (40, 30), (1, 2, 3))
    assert EncodedImage(data, 1200).decode().shape == (30, 40, 3)
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("decoded"))
    with pytest.raises(AboveCap, match=r"^40 x 30 pixels, above the cap of 1199 \(a decompression bomb\?\)$"):
        EncodedImage(data, 1199)


def test_an_extreme_aspect_ratio_is_cut_around_its_centre_before_a_whole_image_resize():
    """1 x 200,000 pixels (a 275-byte PNG): its short side scaled to 224 would make 45 million pixels; the eval
    reader cuts it to MAX_ASPECT : 1 around the centre first. Reference: the middle columns of PIL's own decode."""
    row = np.arange(3000, dtype=np.uint8)[None, :].repeat(2, 0)  # 3000 x 2: cut to 40 x 2
    buf = io.BytesIO()
    Image.fromarray(row).save(buf, "PNG")
    image = whole_image(buf.getvalue())
    assert image.size == (2 * MAX_ASPECT, 2)
    assert np.array_equal(np.array(image)[..., 0], row[:, 1480:1520])
    assert whole_image(HOSTILE["thin png 1 x 200000"]).size == (MAX_ASPECT, 1)
    crop = __import__("disco_clip_ds.data.transforms", fromlist=["x"]).ImageTransform(224, train=False)
    assert crop.from_bytes(HOSTILE["thin png 1 x 200000"], None).shape == (3, 224, 224)


def test_a_lab_tiff_is_fingerprinted_as_the_rgb_image_training_reads():
    """`data filter --dedup` converted a LAB image straight to gray, which PIL cannot do: filter aborted on an image
    training, embed and eval read. Reference: the hash of PIL's own LAB -> RGB conversion saved losslessly."""
    from disco_clip_ds.data.curate.copies import image_fingerprint

    rng = np.random.default_rng(0)
    lab = Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8), "LAB")
    buf = io.BytesIO()
    lab.save(buf, "TIFF")
    rgb = io.BytesIO()
    lab.convert("RGB").save(rgb, "PNG")
    assert np.array_equal(image_fingerprint(buf.getvalue())[1], image_fingerprint(rgb.getvalue())[1])


def test_a_reason_is_never_empty():
    """`data embed` logged a MemoryError with an empty reason."""
    assert reason(MemoryError()) == "MemoryError"
    assert reason(OSError("a\nb")) == "OSError: a"
    assert reason(BadImage("x")) == "x"
    assert torch.is_tensor(torch.zeros(0))  # torch imported for the readers above
