"""Small shard sets with teacher sidecars made on the spot, for the filter's tests: webdataset shards of flat-colour
JPEGs (disco_clip_ds.testing.images.write_shards) and sidecars whose embeddings the test chooses, written with
data/embeddings.py's writer as `data embed` writes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_sidecar
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.testing.images import write_samples, write_shards

TEACHER = "f00dfeedf00dfeed"  # a teacher fingerprint, as data embed records it


def unit_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    rows = rng.standard_normal((n, dim))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def with_cosine(image: np.ndarray, cosines: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Unit text rows whose cosine with each unit image row is `cosines` exactly (up to float32 rounding): the image
    row times c plus a unit vector orthogonal to it times sqrt(1 - c^2); without `rng`, image rows e1 and that
    vector e2 for every row, so that equal cosines give equal rows and exactly equal scores."""
    if rng is None:
        image = np.zeros_like(image)
        image[:, 0] = 1.0
        other = np.zeros_like(image)
        other[:, 1] = 1.0
        c = np.asarray(cosines, np.float64)[:, None]
        return c * image + np.sqrt(1 - c**2) * other
    other = rng.standard_normal(image.shape)
    other -= np.sum(other * image, axis=1, keepdims=True) * image
    other /= np.linalg.norm(other, axis=1, keepdims=True)
    c = np.asarray(cosines, np.float64)[:, None]
    return c * image + np.sqrt(1 - c**2) * other


def embedded_shards(
    folder: Path,
    num_shards: int,
    per_shard: int,
    cosines=None,
    image=None,
    dim: int = 8,
    seed: int = 0,
    teacher: str = TEACHER,
    skip: tuple[int, ...] = (),
    ties: bool = False,
    images: list[bytes] | None = None,
    captions: list[str] | None = None,
    samples: list[dict] | None = None,
) -> list[str]:
    """`num_shards` shards in FOLDER with sidecars beside them; sample i (in input order) gets image row `image[i]`
    (default: random unit rows) and a text row at cosine `cosines[i]` (default: random in [-0.2, 0.5]). Samples whose
    global index is in `skip` get no row (as data embed skips a sample without caption). With `ties`, every image row
    is e1 and equal cosines give exactly equal scores. `images`: the samples' encoded JPEGs (CLIP_benchmark-style keys
    s00000, ...), instead of flat colours; `captions`: their captions (with smooth JPEGs when no `images`);
    `samples`: the samples' members (dicts of webdataset fields), keys as with `images`. Returns the shard paths."""
    rng = np.random.default_rng(seed)
    if captions is not None and images is None:
        images = [smooth_jpeg(i, size=16) for i in range(len(captions))]
    if images is not None:
        captions = captions or [f"image {i}" for i in range(len(images))]
        samples = [{"jpg": data, "txt": text} for data, text in zip(images, captions)]
    if samples is None:
        urls = write_shards(folder, num_shards, per_shard, seed=seed)
    else:
        write_samples(folder, samples, per_shard)
        urls = [str(folder / f"{s:05d}.tar") for s in range(num_shards)]
    n = num_shards * per_shard
    image = unit_rows(rng, n, dim) if image is None else np.asarray(image, np.float64)
    cosines = rng.uniform(-0.2, 0.5, n) if cosines is None else np.asarray(cosines, np.float64)
    text = with_cosine(image, cosines, None if ties else rng)
    if ties:
        image = np.eye(1, dim).repeat(n, axis=0)
    index = 0
    for url in urls:
        keys, rows = [], []
        for sample in raw_samples(url, read=False):
            if index not in skip:
                keys.append(sample["__key__"])
                rows.append(index)
            index += 1
        meta = {"teacher": teacher, "teacher_name": "tiny-teacher", "model_type": "clip", "logit_scale": "100.0"}
        meta.update(logit_bias="", **shard_facts(url))
        write_sidecar(
            sidecar_path(folder, url),
            keys,
            torch.from_numpy(image[rows]).float(),
            torch.from_numpy(text[rows]).float(),
            meta,
        )
    return urls


def smooth_jpeg(seed: int, size: int = 64, flip: bool = False, scale: float = 1.0, quality: int = 90) -> bytes:
    """A JPEG of smooth random texture (8 x 8 noise upsampled): distinct images have distinct perceptual hashes, and
    a flipped, resized or re-encoded one (`flip`, `scale`, `quality`) stays near its original."""
    import io

    from PIL import Image, ImageOps

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
    if flip:
        image = ImageOps.mirror(image)
    if scale != 1.0:
        image = image.resize((round(size * scale), round(size * scale)), Image.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()
