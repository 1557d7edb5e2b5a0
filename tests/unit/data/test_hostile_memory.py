"""No image, whatever its header says, costs a reader more memory than the pixel cap allows, in any path: each
path's decode runs in a forked child (testing/memory.forked_peak_mib) whose address space may grow by 2 GiB at most,
on a 1 x 200,000 PNG (which took 4.1 GB through eval's resize at 64 px, about 12x more at 224), two decompression-bomb
headers and a real image just under the cap. Slow: each child decodes up to 49 million pixels."""

from __future__ import annotations

import random

import pytest

from disco_clip_ds.data.decode import MAX_IMAGE_PIXELS
from disco_clip_ds.testing.images import hostile_images, image_bytes
from disco_clip_ds.testing.memory import forked_peak_mib

pytestmark = pytest.mark.slow

# what a decode may cost per pixel of the cap: the decoded mode, its RGB conversion and the copies a reader hands on
BYTES_PER_CAPPED_PIXEL = 16
SMALL_MIB = 32  # what a skipped image, or one of 200,000 pixels, may cost


def readers():
    from transformers import CLIPImageProcessor

    from disco_clip_ds.data.curate.copies import image_fingerprint
    from disco_clip_ds.data.naflex import NaflexTransform
    from disco_clip_ds.data.prep.fetch import check_image_pixels
    from disco_clip_ds.data.transforms import ImageTransform
    from disco_clip_ds.eval.sources import decode_batch

    processor = CLIPImageProcessor()  # shortest edge 224, then the centre crop
    return {
        "train": lambda data: ImageTransform(224).from_bytes(data, random.Random(0)),
        "embed (centre crop)": lambda data: ImageTransform(224, train=False).from_bytes(data, None),
        "naflex eval": lambda data: NaflexTransform(16, 256, train=False).from_bytes(data, None),
        "eval": lambda data: decode_batch(processor, ([data], [0])),
        "filter (fingerprint)": image_fingerprint,
        "download (keep_ratio)": lambda data: check_image_pixels(data, max_aspect=20),
    }


@pytest.fixture(scope="module")
def near_cap():
    side = int(MAX_IMAGE_PIXELS**0.5)  # 7071 x 7071: decoded in full, as it is within the cap
    return image_bytes("PNG", "L", (side, side), 90)


@pytest.mark.parametrize("reader", list(readers()))
def test_each_reader_stays_within_the_caps_memory(reader, near_cap):
    read = readers()[reader]
    hostile = hostile_images()
    for name in ("thin png 1 x 200000", "png bomb header", "jpeg bomb header"):
        outcome, extra = forked_peak_mib(lambda: read(hostile[name]))
        assert "MemoryError" not in outcome and extra < SMALL_MIB, (name, outcome, extra)
    if reader.startswith("download"):  # the header alone: nothing decoded
        return
    outcome, extra = forked_peak_mib(lambda: read(near_cap))
    assert outcome == "ok" and extra < BYTES_PER_CAPPED_PIXEL * MAX_IMAGE_PIXELS / 2**20, (outcome, extra)
