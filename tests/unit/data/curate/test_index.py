"""faiss and imagehash are each used from one module (data/curate/index.py, data/curate/copies.py), and the binary
index's nearest distance is the brute-force Hamming distance."""

import re
from pathlib import Path

import numpy as np

import disco_clip_ds
from disco_clip_ds.data.curate.index import HashIndex

PACKAGE = Path(disco_clip_ds.__file__).parent


def importers(module: str) -> list[str]:
    pattern = re.compile(rf"^\s*(import|from) {module}\b", re.M)
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text()))


def test_faiss_and_imagehash_are_each_imported_by_one_module():
    assert importers("faiss") == ["data/curate/index.py"]
    assert importers("imagehash") == ["data/curate/copies.py"]


def test_hash_index_nearest_distance_is_the_brute_force_hamming_distance():
    rng = np.random.default_rng(0)
    base, queries = rng.integers(0, 256, (50, 8), dtype=np.uint8), rng.integers(0, 256, (7, 8), dtype=np.uint8)
    index = HashIndex(8)
    index.add(base)
    brute = [
        min(bin(int.from_bytes(q.tobytes(), "big") ^ int.from_bytes(b.tobytes(), "big")).count("1") for b in base)
        for q in queries
    ]
    assert index.size == 50 and index.nearest_distance(queries).tolist() == brute
