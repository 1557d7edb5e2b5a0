"""Images and shards made on the spot: flat-colour and noise images, img2dataset-layout training shards and
CLIP_benchmark-layout eval shards."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path


def image_bytes(fmt: str = "JPEG", mode: str = "RGB", size: tuple[int, int] = (40, 40), color=0, **save) -> bytes:
    """One flat-colour image encoded as `fmt` (`save`: PIL's encoder options, e.g. quality=90): its pixels
    identify it."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt, **save)
    return buf.getvalue()


def declaring_size(fmt: str, size: tuple[int, int]) -> bytes:
    """A small PNG or JPEG whose header declares `size` (width, height), far beyond its pixel data: a decompression
    bomb's header, without the bomb. Made from a 16 x 16 image with its header's dimensions rewritten (PNG: IHDR and
    its CRC; JPEG: the SOF0 segment)."""
    import struct
    import zlib

    data = bytearray(image_bytes(fmt, "L", (16, 16), 0))
    width, height = size
    if fmt == "PNG":  # signature (8), IHDR length + type (8), then width, height (4 bytes each), and the CRC after
        data[16:24] = struct.pack(">II", width, height)
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    else:  # SOF0: FF C0, length (2), precision (1), then height, width (2 bytes each)
        sof = data.index(b"\xff\xc0")
        data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def noise_image_bytes(rng, fmt: str = "PNG", size: int = 40) -> bytes:
    """A size x size RGB image of uniform noise from the numpy Generator `rng`."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def random_clip_batch(config, size: int, seed: int) -> dict:
    """`size` random (token ids, image) pairs for a CLIP-style `config`, as the model takes them: for benches and
    tests that measure or check the model and loss, not decoding. Ids bracketed by the config's bos and eos."""
    import torch

    text, vision = config.text_config, config.vision_config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, text.vocab_size, (size, text.max_position_embeddings), generator=g)
    ids[:, 0], ids[:, -1] = text.bos_token_id, text.eos_token_id
    pixels = torch.randn(size, 3, vision.image_size, vision.image_size, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def write_shards(folder: Path, num_shards: int, per_shard: int, seed: int = 0, bad: dict | None = None) -> list[str]:
    """img2dataset-layout training shards (key.jpg/.txt/.json) plus sizes.json, captioned with the demo's digit
    words; `bad` = {sample index: kind} with kinds 'corrupt' (truncated JPEG bytes), 'no_text', 'empty_text'
    (whitespace only), 'gray', 'rgba', 'large' (400 x 400 pixels, where the others have 40 to 90 a side).
    Returns the shard paths."""
    import webdataset as wds

    from disco_clip_ds.data.prep.demo import DIGITS

    folder.mkdir(parents=True, exist_ok=True)
    rng, bad, sizes, index = random.Random(seed), bad or {}, {}, 0

    def random_image(mode, fmt="JPEG", large=False):
        size = (400, 400) if large else (rng.randint(40, 90), rng.randint(40, 90))
        color = tuple(rng.randrange(256) for _ in range(len(mode)))
        return image_bytes(fmt, mode, size, color if len(mode) > 1 else color[0])

    for s in range(num_shards):
        name = f"{s:05d}.tar"
        with wds.TarWriter(str(folder / name)) as sink:
            for _ in range(per_shard):
                kind = bad.get(index)
                key = f"{s:05d}{index:04d}"
                sample = {"__key__": key, "json": json.dumps({"key": key}).encode()}
                if kind == "rgba":
                    sample["png"] = random_image("RGBA", "PNG")
                else:
                    sample["jpg"] = random_image("L" if kind == "gray" else "RGB", large=kind == "large")
                if kind == "corrupt":
                    sample["jpg"] = sample["jpg"][: len(sample["jpg"]) // 3]
                if kind == "empty_text":
                    sample["txt"] = b" \n\t "
                elif kind != "no_text":
                    sample["txt"] = f"a photo of the digit {DIGITS[index % 10]}".encode()
                sink.write(sample)
                index += 1
        sizes[name] = per_shard
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return [str(folder / f"{s:05d}.tar") for s in range(num_shards)]


def write_samples(folder: Path, samples: list[dict], per_shard: int) -> None:
    """Write `samples` (dicts of webdataset fields, e.g. {"png": bytes, "cls": "3"}) as NNNNN.tar shards with keys
    s00000, s00001, ... (CLIP_benchmark's layout)."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(samples), per_shard)):
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as sink:
            for i, sample in enumerate(samples[start : start + per_shard], start):
                sink.write({"__key__": f"s{i:05d}", **sample})


def empty_second_shard(folder: Path, sizes: bool) -> str:
    """Two shards in FOLDER, the second a valid tar without members, as a brace pattern; sizes.json (when `sizes`)
    records 5 and 0 samples, else it is removed (the counts are then unknown)."""
    import tarfile

    urls = write_shards(folder, num_shards=1, per_shard=5)
    tarfile.open(folder / "00001.tar", "w").close()
    if sizes:
        (folder / "sizes.json").write_text(json.dumps({"00000.tar": 5, "00001.tar": 0}))
    else:
        (folder / "sizes.json").unlink()
    return urls[0].replace("00000.tar", "{00000..00001}.tar")


def add_synthetic_captions(url: str, skip: set[str] = frozenset(), seed: int = 0) -> None:
    """Rewrite shard `url` (write_shards') as a reinforced set's: a synthetic caption KEY.syn0.txt ("a picture
    showing " + the real one) after each KEY.txt, as DataCompDR ships them (none for the keys in `skip`), and each JPEG
    made noise of its own size, so that two crops of it differ (every crop of a flat colour is the same)."""
    import tarfile

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    with tarfile.open(url) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(url, "w") as tar:
        for member, data in members:
            key, ext = member.name.split(".", 1)
            if ext == "jpg":
                with Image.open(io.BytesIO(data)) as image:
                    width, height = image.size
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
                data = buf.getvalue()
            added = [(member.name, data)] + (
                [(f"{key}.syn0.txt", b"a picture showing " + data)] if ext == "txt" else []
            )
            for name, content in added[: 1 if key in skip else 2]:
                info = tarfile.TarInfo(name)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))


def thin_png(length: int = 200_000) -> bytes:
    """A 1 x `length` gray PNG (under a kilobyte at the default): a tiny file whose short side, scaled to a model's
    image size, would make an image `length` times as long."""
    return image_bytes("PNG", "L", (length, 1), 128, optimize=True)


def hostile_images() -> dict[str, bytes]:
    """Named images every reader must either decode to RGB within the pixel cap or skip with a one-line reason:
    damaged bytes, decompression-bomb headers, extreme aspect ratios, the odd modes (CMYK, LAB, 16-bit, palette
    with transparency, animated), and formats under another name. All small: a test can run each through every
    reader."""
    from PIL import Image

    def saved(image, fmt: str, **save) -> bytes:
        buf = io.BytesIO()
        image.save(buf, fmt, **save)
        return buf.getvalue()

    jpeg = image_bytes("JPEG", "RGB", (64, 48), (200, 30, 30))
    palette = Image.new("P", (24, 16), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    frames = [Image.new("P", (20, 20), i) for i in range(3)]
    return {
        "truncated jpeg": jpeg[: len(jpeg) // 2],
        "truncated png": image_bytes("PNG", "RGB", (64, 48), (1, 2, 3))[:60],
        "not an image": b"<html>404 not found</html>",
        "empty": b"",
        "png bomb header": declaring_size("PNG", (30000, 30000)),
        "jpeg bomb header": declaring_size("JPEG", (8000, 8000)),
        "thin png 1 x 200000": thin_png(),
        "tall png 3000 x 1": image_bytes("PNG", "RGB", (1, 3000), (9, 9, 9)),
        "cmyk jpeg": image_bytes("JPEG", "CMYK", (32, 32), (0, 255, 0, 0)),
        "lab tiff": image_bytes("TIFF", "LAB", (32, 32), (50, 10, 10)),
        "16-bit png": image_bytes("PNG", "I;16", (32, 32), 40000),
        "palette png with transparency": saved(palette, "PNG", transparency=0),
        "animated gif": saved(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "webp named jpg": image_bytes("WEBP", "RGB", (32, 32), (0, 0, 255)),
        "rgba png": image_bytes("PNG", "RGBA", (32, 32), (0, 0, 0, 0)),
    }
