"""Copy detection for `disco-clip data filter --dedup_against DIR` and `--dedup`: is a training image a copy of a
reference image (an eval set's) or of a training image before it, re-encoded, resized, slightly cropped or flipped?

An image's fingerprint is the perceptual hash (`imagehash.phash`, 64 bits) of the image and of its horizontal
mirror, so that a flipped copy matches its original; a reference image's adds those of 9 windows cut a few per cent
smaller (`WINDOWS`), so that a slightly cropped copy matches too. A training image is a copy when the Hamming
distance between its hash and any of the other's is at most `threshold` bits. The search over the hashes is exact
and sub-quadratic, multi-index hashing (`hamming_pairs`, data/curate/index.py): memory holds the hashes alone, never
the images. docs/data.md ("Dedup against eval sets") says why a perceptual hash rather than the CLIP teacher's
embeddings, and how the default was measured.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from disco_clip_ds.data.curate.index import hamming_pairs
from disco_clip_ds.data.decode import DRAFT_SCALES, EncodedImage
from disco_clip_ds.errors import DataError, UsageError

HASH_SIZE = 8  # imagehash's default: an 8 x 8 block of the DCT, 64 bits
HASH_BITS = HASH_SIZE * HASH_SIZE
DEFAULT_THRESHOLD = 8  # measured: bench/data/README.md, "Dedup"
# A reference image is also hashed through 9 windows of (1 - WINDOW_CUT) of its width and height, at the corners,
# the edges' middles and the centre: a global hash moves with a crop's shift, and these meet a copy cut by a few
# per cent from any side half way. The eval sets are small; their hashes, 20 per image, cost little.
WINDOW_CUT = 0.06
WINDOWS = [(x, y) for y in (0, WINDOW_CUT / 2, WINDOW_CUT) for x in (0, WINDOW_CUT / 2, WINDOW_CUT)]


def check_threshold(value, *, bits: int = HASH_BITS) -> int:
    """`value` as a threshold in bits, or a one-line UsageError when it is not a whole number from 0 to below half
    of `bits`: two unrelated images' hashes differ in about half their bits, so such a threshold matches anything."""
    most = bits // 2 - 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= most:
        raise UsageError(
            f"--dedup_threshold {value!r}: give a whole number of bits from 0 to {most} (the Hamming distance "
            f"between {bits}-bit perceptual hashes that counts as a copy; default {DEFAULT_THRESHOLD})"
        )
    return int(value)


def image_fingerprint(data: bytes, *, windows: bool = False, hash_size: int = HASH_SIZE) -> tuple[bytes, np.ndarray]:
    """(content digest of the encoded bytes, perceptual hashes as a uint8 array): the hashes of the image and of its
    horizontal mirror, (2, 8) by default; with `windows`, then those of the WINDOWS crops of the image and their
    mirrors, (2 + 2 * len(WINDOWS), 8): a reference image's, so that a slightly cropped copy matches one of them.
    `hash_size` 16 makes 256-bit hashes (32 bytes each). The image is read by data/decode.py, as training reads it
    (the pixel cap, RGB by the same conversions, then gray; a JPEG decoded at the largest DCT reduction that keeps
    `8 * hash_size` pixels a side); a BadImage (a DataError) with the reason when it cannot be."""
    import imagehash
    from PIL import ImageOps

    encoded = EncodedImage(data)
    scale = next((s for s in DRAFT_SCALES if min(encoded.size) // s >= 8 * hash_size), 1)
    grey = encoded.whole(scale=scale).convert("L")
    w, h = grey.size
    views = [grey] + [
        grey.crop((x * w, y * h, (x + 1 - WINDOW_CUT) * w, (y + 1 - WINDOW_CUT) * h))
        for x, y in (WINDOWS if windows else ())
    ]
    hashes = [imagehash.phash(v, hash_size=hash_size) for view in views for v in (view, ImageOps.mirror(view))]
    packed = np.stack([np.packbits(h.hash.reshape(-1)) for h in hashes])
    return hashlib.blake2b(data, digest_size=16).digest(), packed


def fingerprints(images: Iterable[bytes], *, windows: bool = False, hash_size: int = HASH_SIZE):
    """(digests, stacked hashes (n, 2, 8) uint8, or (n, 20, 8) with `windows`) of `images`: `image_fingerprint`'s."""
    rows = 2 + 2 * len(WINDOWS) * windows
    digests, hashes = [], [np.zeros((0, rows, hash_size**2 // 8), np.uint8)]
    for data in images:
        digest, hashed = image_fingerprint(data, windows=windows, hash_size=hash_size)
        digests.append(digest)
        hashes.append(hashed[None])
    return digests, np.concatenate(hashes)


def reference_fingerprints(folders: list[str], *, windows: bool = True, hash_size: int = HASH_SIZE) -> np.ndarray:
    """The hashes ((n, 20, 8) uint8: `image_fingerprint` with `windows`) of every image in `folders`: webdataset
    shards or CLIP_benchmark wds sets (`sets.image_samples`). A folder that holds neither is a UsageError; an
    unreadable image is a DataError naming its sample."""
    from disco_clip_ds.data.curate.sets import image_samples

    rows = 2 + 2 * len(WINDOWS) * windows
    hashes = [np.zeros((0, rows, hash_size**2 // 8), np.uint8)]
    for folder in folders:
        for key, data in image_samples(folder):
            try:
                hashes.append(image_fingerprint(data, windows=windows, hash_size=hash_size)[1][None])
            except DataError as error:
                raise DataError(f"{folder}: sample {key}: {error}") from None
    return np.concatenate(hashes)


def copies_of_reference(train: np.ndarray, reference: np.ndarray, threshold: int) -> np.ndarray:
    """A bool per training fingerprint (`train`: (n, 2 or more, bytes)): its image's hash (the first) is within
    `threshold` bits of any hash of a reference image (`reference`: (m, k, bytes), as `reference_fingerprints` makes
    them: the image, its mirror, their windows). Each distinct hash is searched once (`hamming_pairs`)."""
    train, reference = _checked(train, "training"), _checked(reference, "reference")
    threshold = check_threshold(threshold, bits=train.shape[2] * 8)
    if train.shape[2] != reference.shape[2]:
        raise ValueError(f"hashes of {train.shape[2] * 8} bits against hashes of {reference.shape[2] * 8} bits")
    if not len(train) or not len(reference):
        return np.zeros(len(train), bool)
    queries, inverse = _distinct(train[:, 0], inverse=True)
    found = np.zeros(len(queries), bool)
    found[hamming_pairs(queries, _distinct(reference.reshape(-1, reference.shape[2])), threshold)[0]] = True
    return found[inverse]


def copies_within(digests, train: np.ndarray, threshold: int) -> np.ndarray:
    """A bool per training sample, in order: True when an earlier sample has the same digest (an exact duplicate)
    or a kept earlier sample is within `threshold` bits (a near copy: its image's hash against the image and mirror
    hashes of the kept sample). The first of each group of copies is kept; a sample that resembles only dropped
    samples is kept too. `digests`: a list of equal-length bytes, or their (n, bytes) uint8 array.

    Only the first sample of each image hash, among those that are not exact duplicates, can be kept: a later one
    is within 0 bits of it, or of whatever kept sample dropped it. These are searched against each other once
    (`hamming_pairs`), and the rule is then applied to the pairs found (`_dropped_in_order`)."""
    train = _checked(train, "training")[:, :2]  # the image and its mirror: windows are for references
    threshold = check_threshold(threshold, bits=train.shape[2] * 8)
    if len(digests) != len(train):
        raise ValueError(f"{len(digests)} digests for {len(train)} fingerprints")
    live = np.flatnonzero(~_repeated(digests))  # exact duplicates first: a digest is cheaper than a search
    firsts = live[np.sort(_distinct(train[live, 0], first=True))]
    dropped = np.ones(len(train), bool)
    later, row = hamming_pairs(train[firsts, 0], train[firsts].reshape(-1, train.shape[2]), threshold)
    earlier = row // 2  # rows 2k and 2k + 1: the image and mirror hashes of firsts[k]
    dropped[firsts] = _dropped_in_order(len(firsts), earlier[earlier < later], later[earlier < later])
    return dropped


def _distinct(hashes: np.ndarray, *, inverse: bool = False, first: bool = False):
    """np.unique of packed hashes (rows of uint8): the distinct rows, and the index of each row's distinct row
    (`inverse`) or the first row of each distinct one (`first`). Rows of 8 bytes are sorted as one uint64 each."""
    hashes = np.ascontiguousarray(hashes, np.uint8)
    keys = hashes.view("<u8")[:, 0] if hashes.shape[1] == 8 else hashes.view(np.dtype((np.void, hashes.shape[1])))
    if first:
        return np.unique(keys, return_index=True)[1]
    values, index = np.unique(keys, return_inverse=True)
    distinct = values.view(np.uint8).reshape(len(values), hashes.shape[1])
    return (distinct, index.reshape(-1)) if inverse else distinct


def _dropped_in_order(n: int, earlier: np.ndarray, later: np.ndarray) -> np.ndarray:
    """The rule `copies_within` states, on n samples in order and the pairs of near ones (earlier < later): a sample
    is dropped when a kept sample before it is near. Decided in rounds, each a few numpy passes over the pairs not
    yet decided: a sample with a kept earlier neighbour is dropped; one whose earlier neighbours are all dropped is
    kept; the first undecided sample is decided in every round, and a group of copies of one kept sample in one."""
    dropped, undecided = np.zeros(n, bool), np.zeros(n, bool)
    undecided[later] = True  # a sample with no earlier neighbour is kept
    while len(later):
        kept_before = ~undecided[earlier] & ~dropped[earlier]
        dropped[later[kept_before]] = True
        undecided[later[kept_before]] = False
        waiting = np.zeros(n, bool)
        waiting[later[undecided[earlier]]] = True
        undecided &= waiting  # no kept and no undecided earlier neighbour: kept
        pending = undecided[later]
        earlier, later = earlier[pending], later[pending]
    return dropped


def _repeated(digests) -> np.ndarray:
    """True for each digest equal to one before it; one array of the digests' bytes, not a set of Python objects."""
    if not len(digests):
        return np.zeros(0, bool)
    if isinstance(digests, np.ndarray):
        rows = np.ascontiguousarray(digests, np.uint8).reshape(len(digests), -1)
    else:
        if any(len(d) != len(digests[0]) for d in digests):
            raise ValueError("digests of different lengths: give those of image_fingerprint")
        rows = np.frombuffer(b"".join(digests), np.uint8).reshape(len(digests), -1)
    repeated = np.ones(len(rows), bool)
    repeated[np.unique(rows, axis=0, return_index=True)[1]] = False  # np.unique's index: the first occurrence
    return repeated


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamming distances (int) between each packed hash of `a` (n, bytes) and each of `b` (m, bytes)."""
    return _BITS[a[:, None, :] ^ b[None, :, :]].sum(axis=2, dtype=np.int64)


_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)  # bits set per byte (numpy 1 has no bitwise_count)


def _checked(fingerprints: np.ndarray, what: str) -> np.ndarray:
    fingerprints = np.asarray(fingerprints)
    if fingerprints.dtype != np.uint8 or fingerprints.ndim != 3 or fingerprints.shape[1] < 2:
        raise ValueError(
            f"{what} fingerprints: expected uint8 (n, 2 or more, bytes), got {fingerprints.dtype} {fingerprints.shape}"
        )
    return fingerprints
