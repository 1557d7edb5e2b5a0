"""Encoded image -> RGB uint8 array (height, width, 3), at 1/2, 1/4 or 1/8 of its size when asked (JPEG only).

JPEGs go to libjpeg-turbo through simplejpeg, which scales in the DCT domain and converts to RGB in one call, with
the defaults PIL uses (accurate integer IDCT, smooth chroma upsampling), so it gives PIL's pixels at a fraction of the
overhead. Everything else goes to PIL, as before: other formats (PNG, WebP, GIF ...), CMYK and YCCK JPEGs (PIL
inverts Adobe CMYK; libjpeg-turbo would not), and any JPEG simplejpeg refuses, so that a corrupt file raises PIL's
error, and a file PIL reads despite libjpeg's warnings is read as it was.
"""

from __future__ import annotations

import io

import numpy as np
import simplejpeg
from PIL import Image

JPEG_START = b"\xff\xd8\xff"  # what PIL's JPEG plugin accepts a file by
TURBO_COLORSPACES = ("YCbCr", "Gray", "RGB")  # those libjpeg-turbo turns into RGB as PIL's convert("RGB") does
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # the modes PIL opens 16-bit grayscale images in
# Images above this many pixels are skipped unread, in training and in a download: a small file can hold a huge flat
# image (a decompression bomb) whose decoding alone would take gigabytes; img2dataset's resized shards are far below it.
MAX_IMAGE_PIXELS = 50_000_000


def check_pixels(size: tuple[int, int], max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """A ValueError for an image of more than `max_pixels` pixels (its (width, height) read from its header)."""
    if size[0] * size[1] > max_pixels:
        raise ValueError(f"{size[0]} x {size[1]} pixels, above {max_pixels}")


def eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (PIL mode I;16 or I) as 8-bit ("L"): each value's high byte (value >> 8), the rule PIL
    itself applies to 16-bit RGB PNGs and libpng's png_set_strip_16; PIL's convert would clip every value above 255
    to white. Mode "I" holds 32-bit integers: read as 16-bit samples, values outside 0..65535 are clipped first.
    Any other image is returned as it is."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
    return Image.fromarray((values >> 8).astype(np.uint8))  # uint8 (h, w): mode "L"


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to RGB; transparent pixels become white rather than whatever colour they hide; 16-bit grayscale
    is scaled to 8 bits (`eight_bit`)."""
    image = eight_bit(image)
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


class EncodedImage:
    """An encoded image whose header is read (`size`: width, height) and whose pixels are not, until `decode`."""

    def __init__(self, data: bytes):
        self.data = data
        self._turbo = data[:3] == JPEG_START and self._turbo_header()
        if not self._turbo:
            with Image.open(io.BytesIO(data)) as image:  # reads the header only
                self.size = image.size

    def _turbo_header(self) -> bool:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(self.data)
        except ValueError:  # an odd or damaged header: PIL's to judge
            return False
        self.size = (width, height)
        return colorspace in TURBO_COLORSPACES

    def decode(self, scale: int = 1) -> np.ndarray:
        """The RGB pixels (height, width, 3), uint8, of the image reduced `scale` (1, 2, 4 or 8) times by libjpeg in
        the DCT domain: ceil(width / scale) x ceil(height / scale), as PIL's `draft` gives; other formats ignore
        `scale`. Raises PIL's errors for data PIL cannot read either."""
        if self._turbo:
            width, height = self.size
            try:
                return simplejpeg.decode_jpeg(
                    self.data, "RGB", min_height=-(-height // scale), min_width=-(-width // scale)
                )
            except ValueError:  # corrupt, or a warning in strict mode: PIL decides, as it did before
                pass
        return self._pil(scale)

    def _pil(self, scale: int) -> np.ndarray:
        with Image.open(io.BytesIO(self.data)) as image:
            if scale > 1:
                image.draft(None, (image.width // scale, image.height // scale))  # a no-op for formats but JPEG
            image.load()
            return np.array(to_rgb(image))  # a writable copy, as torch wants
