"""The copy detector of `data filter --dedup_against` / `--dedup` (data/curate/copies.py): planted copies (re-encoded,
resized, cropped, flipped) found and distinct images spared, exact duplicates and the first of each group kept, the
threshold's refusal, and the faiss search against a brute-force Hamming distance in plain Python integers."""

from __future__ import annotations

import io

import numpy as np
import pytest

from disco_clip_ds.data.curate import index
from disco_clip_ds.data.curate.copies import (
    DEFAULT_THRESHOLD,
    check_threshold,
    copies_of_reference,
    copies_within,
    fingerprints,
    image_fingerprint,
)
from disco_clip_ds.errors import DataError, UsageError


def _smooth_image(rng, size: int = 96):
    """A random image of broad shapes (a 6 x 6 noise field, smoothly upscaled), as photos' low frequencies are."""
    from PIL import Image

    field = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(field).resize((size, size), Image.Resampling.BICUBIC)


def _jpeg(image, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _copies(image) -> list[bytes]:
    from PIL import Image, ImageOps

    w, h = image.size
    return [
        _jpeg(image, quality=60),
        _jpeg(image.resize((round(w * 0.9), round(h * 0.9)), Image.Resampling.BICUBIC)),
        _jpeg(image.resize((round(w * 1.1), round(h * 1.1)), Image.Resampling.BICUBIC)),
        _jpeg(image.crop((1, 6, w - 7, h - 2))),  # 8 % of each side's length cut, off centre
        _jpeg(ImageOps.mirror(image)),
    ]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_planted_copies_are_found_and_distinct_images_spared():
    rng = np.random.default_rng(0)
    originals = [_smooth_image(rng) for _ in range(20)]
    reference = fingerprints([_jpeg(image) for image in originals], windows=True)[1]
    planted = [copy for image in originals for copy in _copies(image)]
    distinct = [_jpeg(_smooth_image(rng)) for _ in range(20)]
    _, train = fingerprints(distinct + planted)
    found = copies_of_reference(train, reference, DEFAULT_THRESHOLD)
    assert found[20:].all(), np.flatnonzero(~found[20:])
    assert not found[:20].any(), np.flatnonzero(found[:20])


def test_fingerprint_holds_a_digest_and_the_mirror_hash():
    from PIL import ImageOps

    image = _smooth_image(np.random.default_rng(1))
    digest, hashes = image_fingerprint(_png(image))
    assert hashes.shape == (2, 8) and hashes.dtype == np.uint8
    windowed = image_fingerprint(_png(image), windows=True)[1]
    assert windowed.shape == (20, 8) and (windowed[:2] == hashes).all()
    assert image_fingerprint(_jpeg(image), hash_size=16)[1].shape == (2, 32)
    assert digest == image_fingerprint(_png(image))[0] != image_fingerprint(_jpeg(image))[0]
    mirrored = image_fingerprint(_png(ImageOps.mirror(image)))[1]
    assert (mirrored[0] == hashes[1]).all() and (mirrored[1] == hashes[0]).all()  # a lossless mirror: exact swap


def test_unreadable_bytes_are_a_data_error():
    with pytest.raises(DataError, match=r"^not an image \(none of PIL.s formats recognises its 12 bytes\)$"):
        image_fingerprint(b"not an image")


def _random_hashes(rng, n: int, near_to: np.ndarray | None = None, flips: int = 0) -> np.ndarray:
    """(n, 2, 8) random hashes, or `near_to`'s with `flips` random bits of each changed."""
    if near_to is None:
        return rng.integers(0, 256, (n, 2, 8), dtype=np.uint8)
    bits = np.unpackbits(near_to.reshape(len(near_to), -1), axis=1)
    for row in bits:
        row[rng.choice(64, size=flips, replace=False)] ^= 1  # in the image's own hash (the first 64 bits)
    return np.packbits(bits, axis=1).reshape(near_to.shape)


def _distance(a: np.ndarray, b: np.ndarray) -> int:
    return (int.from_bytes(a.tobytes(), "big") ^ int.from_bytes(b.tobytes(), "big")).bit_count()


# the search both ways: multi-index hashing whatever the sizes (FLAT_COST inf) and the exhaustive one (FLAT_COST 0)
SEARCHES = pytest.mark.parametrize("flat_cost", [np.inf, 0.0], ids=["multi_index", "exhaustive"])


@SEARCHES
@pytest.mark.parametrize("threshold", [0, 3, 8, 14, 31])
def test_copies_of_reference_agrees_with_brute_force(monkeypatch, flat_cost, threshold):
    monkeypatch.setattr(index, "FLAT_COST", flat_cost)
    rng = np.random.default_rng(threshold)
    reference = np.concatenate([_random_hashes(rng, 30), _random_hashes(rng, 30)], axis=1)  # windows' rows too
    near = [_random_hashes(rng, 0, reference[:10, :2], flips) for flips in (0, 5, 10)]
    at = [_random_hashes(rng, 0, reference[10:20, :2], flips) for flips in {threshold, max(threshold - 1, 0)}]
    beyond = _random_hashes(rng, 0, reference[20:30, :2], threshold + 1)
    train = np.concatenate([_random_hashes(rng, 40), *near, *at, beyond, near[0][:3]])  # and repeated hashes
    train[-3:, 0] = reference[-3:, 1]  # flipped copies: the image's hash is the reference's mirror hash
    train[-6:-3, 0] = reference[-6:-3, 3]  # and some a window's
    expected = [min(_distance(t[0], r[row]) for r in reference for row in range(4)) <= threshold for t in train]
    assert sum(expected) >= 20 and (threshold > 20 or not all(expected))  # 31 bits: random hashes match too
    assert copies_of_reference(train, reference, threshold).tolist() == expected


def _greedy(digests, train, threshold) -> list[bool]:
    """The rule, one sample at a time: dropped when an earlier sample has its digest (here digests and hashes are
    drawn apart, so the rule's two parts act apart) or a kept earlier sample is within threshold."""
    kept, dropped = [], []
    for i, (digest, hashes) in enumerate(zip(digests, train)):
        copy = digest in digests[:i] or any(min(_distance(hashes[0], h[s]) for s in (0, 1)) <= threshold for h in kept)
        dropped.append(copy)
        if not copy:
            kept.append(hashes)
    return dropped


@SEARCHES
@pytest.mark.parametrize("seed", [0, 1])
def test_copies_within_agrees_with_the_rule_one_sample_at_a_time(monkeypatch, flat_cost, seed):
    monkeypatch.setattr(index, "FLAT_COST", flat_cost)
    rng = np.random.default_rng(seed)
    base = _random_hashes(rng, 12)
    for threshold in (0, 6, 20):
        planted = [_random_hashes(rng, 0, base, f) for f in (4, 12, threshold, threshold + 1, max(threshold - 1, 0))]
        chain = [base[:4]]  # each 3 bits from the one before: copies of copies
        for _ in range(3):
            chain.append(_random_hashes(rng, 0, chain[-1], 3))
        train = np.concatenate([base, *planted, *chain, base[:3]])
        train = train[rng.permutation(len(train))]
        digests = [bytes([i % 30]) for i in range(len(train))]  # some digests repeat: exact duplicates
        expected = _greedy(digests, train, threshold)
        assert 0 < sum(expected) < len(train)
        assert copies_within(digests, train, threshold).tolist() == expected
        as_array = np.frombuffer(b"".join(digests), np.uint8).reshape(len(digests), 1)
        assert copies_within(as_array, train, threshold).tolist() == expected


def test_a_chain_of_copies_keeps_every_other_one():
    """a ~ b ~ c ~ d ~ e, each 2 bits from the one before and more than 2 from any other: a, c, e kept."""
    bits = np.zeros((5, 128), np.uint8)
    for i in range(5):
        bits[i, : 2 * i] = 1
    bits[:, 64:] = 255  # mirrors far from every image hash
    train = np.packbits(bits, axis=1).reshape(5, 2, 8)
    assert copies_within([bytes([i]) for i in range(5)], train, 2).tolist() == [False, True, False, True, False]


def test_exact_duplicates_and_the_first_in_order_kept():
    rng = np.random.default_rng(3)
    a, b = _jpeg(_smooth_image(rng)), _jpeg(_smooth_image(rng))
    digests, train = fingerprints([a, b, a, _jpeg(_smooth_image(rng)), b])
    assert copies_within(digests, train, 0).tolist() == [False, False, True, False, True]


def test_a_copy_of_a_dropped_copy_is_kept():
    """a ~ b ~ c with c far from a: b goes as a's copy, c stays (nothing kept resembles it)."""
    bits = np.zeros((3, 128), np.uint8)
    bits[1, :6] = 1  # b: 6 bits from a
    bits[2, :12] = 1  # c: 6 bits from b, 12 from a
    bits[:, 64:] = 255  # mirrors far from every image hash
    train = np.packbits(bits, axis=1).reshape(3, 2, 8)
    assert copies_within([b"a", b"b", b"c"], train, 6).tolist() == [False, True, False]


def test_a_sample_near_only_dropped_ones_is_kept_whenever_they_were_dropped():
    """a, b, x, y, z with bits {}, {0,1}, {0..3}, {0..5}, {0,1,4,5}, threshold 2: b goes (a's copy), x stays (near b
    alone), y goes (x's copy) after b is decided, and z, near b and y only, stays: both its neighbours dropped,
    decided one after the other."""
    sets = [[], [0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 4, 5]]
    bits = np.zeros((5, 128), np.uint8)
    for row, ones in zip(bits, sets):
        row[ones] = 1
    bits[:, 64:] = 1  # mirrors far from every image hash
    train = np.packbits(bits, axis=1).reshape(5, 2, 8)
    assert copies_within([bytes([i]) for i in range(5)], train, 2).tolist() == [False, True, False, True, False]


@pytest.mark.parametrize("value", [-1, 32, 2.5, True, "8", None])
def test_threshold_out_of_range_is_one_line(value):
    with pytest.raises(UsageError, match="--dedup_threshold") as raised:
        check_threshold(value)
    assert "\n" not in str(raised.value)
    hashes = np.zeros((1, 2, 8), np.uint8)
    with pytest.raises(UsageError):
        copies_of_reference(hashes, hashes, value)


def test_thresholds_in_range_are_accepted():
    assert [check_threshold(v) for v in (0, DEFAULT_THRESHOLD, 31, np.int64(5))] == [0, DEFAULT_THRESHOLD, 31, 5]


def test_reference_fingerprints_read_every_folder_and_name_an_unreadable_image(tmp_path):
    from disco_clip_ds.data.curate.copies import reference_fingerprints
    from disco_clip_ds.testing.images import write_samples

    rng = np.random.default_rng(4)
    images = [_png(_smooth_image(rng, size=32)) for _ in range(3)]
    write_samples(tmp_path / "a" / "test", [{"png": image, "cls": b"0"} for image in images[:2]], per_shard=1)
    write_samples(tmp_path / "b", [{"png": images[2]}], per_shard=1)
    hashes = reference_fingerprints([str(tmp_path / "a"), str(tmp_path / "b")])
    assert hashes.shape == (3, 20, 8)
    assert all((hashes[i] == image_fingerprint(image, windows=True)[1]).all() for i, image in enumerate(images))
    write_samples(tmp_path / "c", [{"png": images[0]}, {"png": b"broken"}], per_shard=2)
    with pytest.raises(DataError, match=r"/c: sample s00001: not an image \(none of PIL.s formats"):
        reference_fingerprints([str(tmp_path / "c")])
