"""faiss, imagehash and numba are each used from one module (data/curate/index.py, copies.py, hamming_loop.py), and
the binary Hamming-radius search (multi-index hashing, and the exhaustive faiss search) finds the brute-force pairs."""

import re
from pathlib import Path

import numpy as np
import pytest

import disco_clip_ds
from disco_clip_ds.data.curate import index
from disco_clip_ds.data.curate.index import hamming_pairs

PACKAGE = Path(disco_clip_ds.__file__).parent


def importers(module: str) -> list[str]:
    pattern = re.compile(rf"^\s*(import|from) {module}\b", re.M)
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text()))


def test_faiss_imagehash_and_numba_are_each_imported_by_one_module():
    assert importers("faiss") == ["data/curate/index.py"]
    assert importers("imagehash") == ["data/curate/copies.py"]
    assert importers("numba") == ["data/curate/hamming_loop.py"]


def _brute_pairs(queries: np.ndarray, base: np.ndarray, radius: int) -> list[tuple[int, int]]:
    """Every pair within radius, by Python integers' bit counts."""
    q, b = ([int.from_bytes(c.tobytes(), "big") for c in codes] for codes in (queries, base))
    return [(i, j) for i, x in enumerate(q) for j, y in enumerate(b) if (x ^ y).bit_count() <= radius]


def _planted(rng, width: int, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """Random codes of `width` bytes; the first base codes are queries' with radius - 1, radius, radius + 1 bits
    changed, and two base codes repeat a query's: pairs on each side of the radius, and shared buckets."""
    queries, base = rng.integers(0, 256, (60, width), dtype=np.uint8), rng.integers(0, 256, (90, width), dtype=np.uint8)
    bits = np.unpackbits(queries[:30], axis=1)
    for row, flips in zip(bits, [radius - 1, radius, radius + 1] * 10):
        row[rng.choice(width * 8, size=max(flips, 0), replace=False)] ^= 1
    base[:30] = np.packbits(bits, axis=1)
    base[30:32] = queries[0]
    return queries, base


SEARCHES = {  # FLAT_COST, SLOT_COST: multi-index hashing with one or two slots (hamming_loop.py), exhaustive
    "multi_index": (np.inf, 1e9),
    "multi_index_2_slots": (np.inf, 0.0),
    "exhaustive": (0.0, index.SLOT_COST),
}


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize(
    ("width", "radius"), [(8, 0), (8, 1), (8, 2), (8, 8), (8, 9), (8, 20), (8, 31), (3, 5), (32, 40)]
)
def test_hamming_pairs_are_the_brute_force_pairs(monkeypatch, search, width, radius):
    """Multi-index hashing (forced: FLAT_COST inf; a probe comparing a bucket's first code, or its first two, before
    any branch on its size) and the exhaustive faiss search (FLAT_COST 0) each give every pair within the radius and
    no other, pairs at radius - 1, radius and radius + 1 planted; 3-byte codes (padded to a word) and 256-bit codes
    (pieces across words) too."""
    monkeypatch.setattr(index, "FLAT_COST", SEARCHES[search][0])
    monkeypatch.setattr(index, "SLOT_COST", SEARCHES[search][1])
    queries, base = _planted(np.random.default_rng(radius * 100 + width), width, radius)
    assert (index._plan(width * 8, radius, len(queries), len(base)) is None) == (search == "exhaustive")
    expected = _brute_pairs(queries, base, radius)
    assert sum(i < 30 and j == i for i, j in expected) == 20  # the planted ones within radius, not those beyond
    rows, columns = hamming_pairs(queries, base, radius)
    assert list(zip(rows.tolist(), columns.tolist())) == expected


@pytest.mark.parametrize("slot_cost", [1e9, 0.0], ids=["1_slot", "2_slots"])
def test_more_pairs_than_the_first_output_holds_are_all_found(monkeypatch, slot_cost):
    """The compiled search stops where its output could overflow, which then doubles, and goes on from there: 6,000
    pairs (identical codes, shared buckets) against a first output of 1,024, each found once."""
    monkeypatch.setattr(index, "FLAT_COST", np.inf)
    monkeypatch.setattr(index, "SLOT_COST", slot_cost)
    rng = np.random.default_rng(0)
    queries = np.repeat(rng.integers(0, 256, (2, 8), dtype=np.uint8), [40, 20], axis=0)
    base = np.concatenate(
        [queries[:1].repeat(100, 0), queries[-1:].repeat(100, 0), rng.integers(0, 256, (50, 8), dtype=np.uint8)]
    )
    assert index._plan(64, 3, len(queries), len(base)) is not None
    expected = _brute_pairs(queries, base, 3)
    assert len(expected) >= 6000
    rows, columns = hamming_pairs(queries, base, 3)
    assert list(zip(rows.tolist(), columns.tolist())) == expected


def test_the_plan_covers_the_radius_and_is_multi_index_at_scale():
    """Every plan's pieces are disjoint and their flips cover the radius (pieces * (flip bits + 1) > radius: a pair
    within it is within the flips on one piece at least); at the sizes of bench/data/dedup_scale.py (24,000 to a
    million against about twice as many 64-bit codes), radius 8, it is multi-index: 3 pieces probed within 2 bits
    from 250,000 queries on, of 21, 21 and 22 bits (every bit) at a million, a probe comparing 2 codes before any
    branch where its buckets hold half a code or more, else 1; fewer codes take more, narrower pieces
    (smaller tables); the smallest searches are exhaustive."""
    for bits, radius in [(64, r) for r in range(32)] + [(256, r) for r in (0, 8, 40, 127)]:
        plan = index._plan(bits, radius, 10**6, 2 * 10**6)
        if plan is not None:
            pieces, flip_bits = plan
            assert len(pieces) * (flip_bits + 1) > radius
            covered = [bit for start, width in pieces for bit in range(start, start + width)]
            assert len(covered) == len(set(covered)) and max(covered) < bits
    assert index._plan(64, 8, 10**6, 2 * 10**6) == ([(0, 21), (21, 21), (42, 22)], 2)  # dedup_scale.py's largest
    assert [index._slots(2 * 10**6 / 2**w) for w in (21, 22)] == [2, 2]  # 2 where buckets hold a code or half
    pieces, flip_bits = index._plan(64, 8, 250_000, 500_000)
    assert (len(pieces), flip_bits) == (3, 2)
    assert len(index._flips(21, 2)) == 1 + 21 + 210
    pieces, flip_bits = index._plan(64, 8, 24_000, 47_000)
    assert len(pieces) > 3 and max(width for _, width in pieces) < 21
    assert index._plan(64, 8, 50, 100) is None


def test_bucket_order_is_a_stable_sort():
    """The counting sort that buckets the codes: numpy's stable argsort, and each key's first position."""
    from disco_clip_ds.data.curate.hamming_loop import bucket_order

    keys = np.random.default_rng(0).integers(0, 16, 500)
    order, starts = bucket_order(keys, 4)
    assert order.tolist() == np.argsort(keys, kind="stable").tolist()
    assert starts.tolist() == [0, *np.cumsum(np.bincount(keys, minlength=16)).tolist()]


def test_empty_and_mismatched_codes():
    codes = np.zeros((3, 8), np.uint8)
    assert [a.tolist() for a in hamming_pairs(codes[:0], codes, 4)] == [[], []]
    with pytest.raises(ValueError, match="8 bytes against codes of 4 bytes"):
        hamming_pairs(codes, codes[:, :4], 4)
