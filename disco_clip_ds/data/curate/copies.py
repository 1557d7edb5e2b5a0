"""Copy detection for `disco-clip data filter --dedup_against DIR` and `--dedup`: is a training image a copy of a
reference image (an eval set's) or of a training image before it, re-encoded, resized, slightly cropped or flipped?

An image's fingerprint is the perceptual hash (`imagehash.phash`, 64 bits) of the image and of its horizontal
mirror, so that a flipped copy matches its original. Two images are copies when the Hamming distance between the
hash of one and either hash of the other is at most `threshold` bits. The search over the hashes is faiss's exact
binary index (`IndexBinaryFlat`): memory holds the hashes alone, never the images. docs/data.md ("Dedup against
eval sets") says why a perceptual hash rather than the CLIP teacher's embeddings, and how the default was measured.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable

import numpy as np

from disco_clip_ds.errors import DataError, UsageError

HASH_SIZE = 8  # imagehash's default: an 8 x 8 block of the DCT, 64 bits
HASH_BYTES = HASH_SIZE * HASH_SIZE // 8
MAX_THRESHOLD = HASH_SIZE * HASH_SIZE // 2 - 1  # two unrelated images' hashes differ in about half their bits
DEFAULT_THRESHOLD = 10  # measured: bench/data/README.md, "Dedup"
_CHUNK = 1024  # training hashes compared per step against those before them (`copies_within`)


def check_threshold(value) -> int:
    """`value` as a threshold in bits, or a one-line UsageError when it is not a whole number in range."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= MAX_THRESHOLD:
        raise UsageError(
            f"--dedup_threshold {value!r}: give a whole number of bits from 0 to {MAX_THRESHOLD} (Hamming distance "
            f"between 64-bit perceptual hashes; default {DEFAULT_THRESHOLD})"
        )
    return int(value)


def image_fingerprint(data: bytes) -> tuple[bytes, np.ndarray]:
    """(content digest of the encoded bytes, the perceptual hashes of the image and of its horizontal mirror as a
    (2, 8) uint8 array). Raises DataError when the bytes are not an image PIL can decode."""
    import imagehash
    from PIL import Image, ImageOps

    try:
        image = Image.open(io.BytesIO(data))
        image.draft("L", (4 * HASH_SIZE * 2, 4 * HASH_SIZE * 2))  # JPEG: decode at the smallest scale phash can use
        grey = image.convert("L")
    except Exception as error:  # PIL raises many kinds for bad bytes
        raise DataError(f"not a readable image ({type(error).__name__}: {error})") from None
    hashes = [imagehash.phash(grey, hash_size=HASH_SIZE), imagehash.phash(ImageOps.mirror(grey), hash_size=HASH_SIZE)]
    packed = np.stack([np.packbits(h.hash.reshape(-1)) for h in hashes])
    return hashlib.blake2b(data, digest_size=16).digest(), packed


def fingerprints(images: Iterable[bytes]) -> tuple[list[bytes], np.ndarray]:
    """Digests and stacked hashes ((n, 2, 8) uint8) of `images`."""
    digests, hashes = [], []
    for data in images:
        digest, hashed = image_fingerprint(data)
        digests.append(digest)
        hashes.append(hashed)
    return digests, np.stack(hashes) if hashes else np.zeros((0, 2, HASH_BYTES), np.uint8)


def reference_fingerprints(folders: list[str]) -> np.ndarray:
    """The hashes ((n, 2, 8) uint8) of every image in `folders`: webdataset shards or CLIP_benchmark wds sets
    (`sets.image_samples`). A folder that holds neither is a UsageError; an unreadable image is a DataError naming
    its sample."""
    from disco_clip_ds.data.curate.sets import image_samples

    hashes = [np.zeros((0, 2, HASH_BYTES), np.uint8)]
    for folder in folders:
        for key, data in image_samples(folder):
            try:
                hashes.append(image_fingerprint(data)[1][None])
            except DataError as error:
                raise DataError(f"{folder}: sample {key}: {error}") from None
    return np.concatenate(hashes)


def copies_of_reference(train: np.ndarray, reference: np.ndarray, threshold: int) -> np.ndarray:
    """A bool per training fingerprint: its image's hash is within `threshold` bits of a reference image's hash or
    of its mirror's."""
    threshold = check_threshold(threshold)
    train, reference = _checked(train, "training"), _checked(reference, "reference")
    if not len(train) or not len(reference):
        return np.zeros(len(train), bool)
    index = _index(reference.reshape(-1, HASH_BYTES))
    distance, _ = index.search(np.ascontiguousarray(train[:, 0]), 1)
    return distance[:, 0] <= threshold


def copies_within(digests: list[bytes], train: np.ndarray, threshold: int) -> np.ndarray:
    """A bool per training sample, in order: True when an earlier sample that is kept has the same digest (an exact
    duplicate) or is within `threshold` bits (a near copy, as `copies_of_reference` measures it). The first of each
    group of copies is kept; a sample that resembles only dropped samples is kept too."""
    threshold = check_threshold(threshold)
    train = _checked(train, "training")
    if len(digests) != len(train):
        raise ValueError(f"{len(digests)} digests for {len(train)} fingerprints")
    dropped, seen = np.zeros(len(train), bool), set()
    for i, digest in enumerate(digests):  # exact duplicates first: a digest is cheaper than a search
        dropped[i] = digest in seen
        seen.add(digest)
    index = _index(np.zeros((0, HASH_BYTES), np.uint8))
    for start in range(0, len(train), _CHUNK):
        chunk = train[start : start + _CHUNK]
        dropped[start : start + len(chunk)] |= _chunk_copies(index, chunk, threshold, dropped[start : start + _CHUNK])
        kept = chunk[~dropped[start : start + len(chunk)]]
        index.add(np.ascontiguousarray(kept.reshape(-1, HASH_BYTES)))
    return dropped


def _chunk_copies(index, chunk: np.ndarray, threshold: int, exact: np.ndarray) -> np.ndarray:
    """Which of `chunk` are copies of a kept sample: one in `index` (those before the chunk), or one before it in
    the chunk, decided in order since whether that one is kept depends on the samples before it."""
    dropped = exact.copy()
    if index.ntotal:
        dropped |= index.search(np.ascontiguousarray(chunk[:, 0]), 1)[0][:, 0] <= threshold
    near = hamming(chunk[:, 0], chunk.reshape(-1, HASH_BYTES)).reshape(len(chunk), len(chunk), 2).min(axis=2)
    near = near <= threshold
    for i in range(len(chunk)):
        if not dropped[i]:
            dropped[i] = bool(np.any(near[i, :i] & ~dropped[:i]))
    return dropped


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamming distances (int) between each packed hash of `a` (n, bytes) and each of `b` (m, bytes)."""
    return _BITS[a[:, None, :] ^ b[None, :, :]].sum(axis=2, dtype=np.int64)


_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)  # set bits per byte (numpy < 2 has no bitwise_count)


def _index(hashes: np.ndarray):
    import faiss

    index = faiss.IndexBinaryFlat(HASH_BYTES * 8)
    if len(hashes):
        index.add(np.ascontiguousarray(hashes))
    return index


def _checked(fingerprints: np.ndarray, what: str) -> np.ndarray:
    fingerprints = np.asarray(fingerprints)
    if fingerprints.dtype != np.uint8 or fingerprints.shape[1:] != (2, HASH_BYTES):
        raise ValueError(f"{what} fingerprints: expected uint8 (n, 2, {HASH_BYTES}), got {fingerprints.dtype} "
                         f"{fingerprints.shape}")
    return fingerprints
