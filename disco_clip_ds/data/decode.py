"""The one image decode of the package: encoded bytes -> RGB uint8 pixels (height, width, 3), for training, `data
embed`, evaluation (`eval` and training's in-training eval), `data filter`'s fingerprints and `data download`'s check.

Every path reads an image the same way and refuses the same images, each with a one-line reason (`BadImage`, which
the readers skip and count):

- the header is read first (`EncodedImage`), and an image of more than `max_pixels` pixels (`MAX_IMAGE_PIXELS`
  unless the caller's flag says otherwise) is refused before any pixel is decoded: a small file can declare a huge
  flat image (a decompression bomb), whose decoding alone would take gigabytes;
- a file that is not an image, or that is truncated or corrupt, is refused with the decoder's reason;
- every mode becomes RGB the same way (`to_rgb`): transparent pixels white, 16-bit grayscale scaled to 8 bits, CMYK
  and LAB through PIL's conversions; an animated image is its first frame;
- a whole image that is resized as a whole (evaluation, a teacher's centre crop, a fingerprint) is first cut to at
  most `MAX_ASPECT` times as long as it is wide, around its centre (`whole_image`): scaling the short side of a
  1 x 200,000 pixel image to 224 would otherwise make an image of 45 million pixels from one of 200,000. A centre
  crop keeps only the middle square anyway; a training crop takes its box from the full image and resizes only the
  box, so it needs no such cut.

JPEGs go to libjpeg-turbo through simplejpeg, which scales in the DCT domain and converts to RGB in one call, with
the defaults PIL uses (accurate integer IDCT, smooth chroma upsampling), so it gives PIL's pixels at a fraction of the
overhead. Everything else goes to PIL: other formats (PNG, WebP, GIF ...), CMYK and YCCK JPEGs (PIL inverts Adobe
CMYK; libjpeg-turbo would not), and any JPEG simplejpeg refuses, so that a corrupt file gets PIL's reason, and a file
PIL reads despite libjpeg's warnings is read as it was.
"""

from __future__ import annotations

import io
import re

import numpy as np
import simplejpeg
from PIL import Image

from disco_clip_ds.errors import DataError

JPEG_START = b"\xff\xd8\xff"  # what PIL's JPEG plugin accepts a file by
TURBO_COLORSPACES = ("YCbCr", "Gray", "RGB")  # those libjpeg-turbo turns into RGB as PIL's convert("RGB") does
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")  # the modes PIL opens 16-bit grayscale images in
PREMULTIPLIED = {"La": "LA", "RGBa": "RGBA"}  # alpha-premultiplied modes, which PIL converts only to their plain form
# Images above this many pixels are refused unread, in every path: img2dataset's resized shards are far below it.
MAX_IMAGE_PIXELS = 50_000_000
# A whole image resized as a whole is cut to at most this long side : short side, around its centre, first.
MAX_ASPECT = 20
DRAFT_SCALES = (8, 4, 2)  # the reductions libjpeg decodes to directly (in the DCT domain), largest first
REASON_CHARS = 200  # a reason is one line of at most this many characters
BOMB = "pixels, above the cap of {cap} (a decompression bomb?)"  # the reason for an image above the cap


class BadImage(DataError, ValueError):
    """An image that a reader skips and counts; the message is the reason, one line."""


class AboveCap(BadImage):
    """An image whose header declares more pixels than the cap (or than PIL's own limit): refused undecoded."""


def reason(error: BaseException) -> str:
    """One line saying why `error` stopped a decode: a BadImage's message, else the error's type and the first line
    of its message (a MemoryError has none)."""
    if isinstance(error, BadImage):
        return str(error)
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    line = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return line[:REASON_CHARS]


def check_pixels(size: tuple[int, int], max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """A BadImage for an image of more than `max_pixels` pixels (its (width, height) read from its header)."""
    if size[0] * size[1] > max_pixels:
        raise AboveCap(f"{size[0]} x {size[1]} {BOMB.format(cap=max_pixels)}")


def eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (PIL mode I;16 or I) as 8-bit ("L"): each value's high byte (value >> 8), the rule PIL
    itself applies to 16-bit RGB PNGs and libpng's png_set_strip_16; PIL's convert would clip every value above 255
    to white. Mode "I" holds 32-bit integers: read as 16-bit samples, values outside 0..65535 are clipped first.
    Any other image is returned as it is. Works in the image's own width (16 or 32 bits), never wider."""
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image).astype(np.uint16, copy=False)  # I;16B is big-endian: as native uint16
    elif image.mode == "I":
        values = np.clip(np.asarray(image), 0, 65535)
    else:
        return image
    return Image.fromarray((values >> 8).astype(np.uint8))  # uint8 (h, w): mode "L"


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to RGB; transparent pixels become white rather than whatever colour they hide; 16-bit grayscale
    is scaled to 8 bits (`eight_bit`). A BadImage for a mode PIL cannot convert."""
    image = eight_bit(image)
    if image.mode == "RGB":
        return image
    try:
        if image.mode in PREMULTIPLIED:
            image = image.convert(PREMULTIPLIED[image.mode])
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image.convert("RGB")
    except ValueError as error:  # "conversion from X to RGB not supported"
        raise BadImage(f"image mode {image.mode} cannot be read as RGB ({reason(error)})") from None


class EncodedImage:
    """An encoded image whose header is read (`size`: width, height) and checked, and whose pixels are not, until
    `decode`. A BadImage, at once, for bytes that are not an image, or an image above `max_pixels` pixels."""

    def __init__(self, data: bytes, max_pixels: int = MAX_IMAGE_PIXELS):
        self.data = data
        self._turbo = data[:3] == JPEG_START and self._turbo_header()
        if not self._turbo:
            try:
                with Image.open(io.BytesIO(data)) as image:  # reads the header only
                    self.size = image.size
            except Image.DecompressionBombError as error:  # PIL's own refusal, at twice its limit
                declared = re.search(r"\((\d+) pixels\)", str(error))
                cap = min(max_pixels, 2 * (Image.MAX_IMAGE_PIXELS or max_pixels))
                raise AboveCap(f"{declared[1] if declared else 'more'} {BOMB.format(cap=cap)}") from None
            except Image.UnidentifiedImageError:  # its message names the BytesIO object: say what it means
                raise BadImage(f"not an image (none of PIL's formats recognises its {len(data)} bytes)") from None
            except Exception as error:  # PIL raises many kinds for a header it cannot read
                raise BadImage(f"not a readable image ({reason(error)})") from None
        check_pixels(self.size, max_pixels)

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
        `scale`. A BadImage with the decoder's reason for data that cannot be decoded."""
        pixels = self._turbo_pixels(scale)
        return pixels if pixels is not None else np.array(self._guarded(self._pil, scale))  # writable, as torch wants

    def whole(self, max_aspect: float = MAX_ASPECT, scale: int = 1) -> Image.Image:
        """The image as `decode(scale)` gives it, as an RGB PIL image cut around its centre to at most `max_aspect`
        times as long as wide (`centred_aspect`): what a resize of the whole image may read. No numpy copy on the
        way: a whole-image reader holds the decoded mode and its RGB conversion, nothing more."""
        pixels = self._turbo_pixels(scale)
        image = Image.fromarray(pixels) if pixels is not None else self._guarded(self._pil, scale)
        return centred_aspect(image, max_aspect)

    def _turbo_pixels(self, scale: int) -> np.ndarray | None:
        if not self._turbo:
            return None
        width, height = self.size
        try:
            return simplejpeg.decode_jpeg(
                self.data, "RGB", min_height=-(-height // scale), min_width=-(-width // scale)
            )
        except ValueError:  # corrupt, or a warning in strict mode: PIL decides, as it did before
            return None

    @staticmethod
    def _guarded(decode, scale: int):
        try:
            return decode(scale)
        except BadImage:
            raise
        except Exception as error:  # truncated, corrupt, out of memory: skipped with the reason, never a traceback
            raise BadImage(f"unreadable image ({reason(error)})") from None

    def _pil(self, scale: int) -> Image.Image:
        image = Image.open(io.BytesIO(self.data))  # not closed: a loaded image keeps its pixels, and RGB is returned
        if image.size != self.size:  # a header that reads differently the second time
            raise BadImage(f"the image's size changed between reads ({self.size} then {image.size})")
        if scale > 1:
            # a no-op for formats but JPEG; PIL divides by the requested size, so never 0
            image.draft(None, (max(1, image.width // scale), max(1, image.height // scale)))
        image.load()  # the first frame of an animated image
        return to_rgb(image)


def centred_aspect(image: Image.Image, max_aspect: float = MAX_ASPECT) -> Image.Image:
    """The middle of `image`, its long side cut to at most `max_aspect` times its short one (round down, at least 1
    pixel); the image itself when it is within the bound."""
    width, height = image.size
    if width > max_aspect * height:
        keep = max(1, int(max_aspect * height))
        left = (width - keep) // 2
        return image.crop((left, 0, left + keep, height))
    if height > max_aspect * width:
        keep = max(1, int(max_aspect * width))
        top = (height - keep) // 2
        return image.crop((0, top, width, top + keep))
    return image


def whole_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS, max_aspect: float = MAX_ASPECT) -> Image.Image:
    """The whole image of encoded `data` as an RGB PIL image, cut to `max_aspect` (`EncodedImage.whole`): what
    evaluation hands the model's image processor. A BadImage (the one-line reason) for anything that is not an image
    within the cap."""
    return EncodedImage(data, max_pixels).whole(max_aspect)
