"""Sidecars read by block (format 3; data/sidecar_file.py, data/embeddings.py EmbeddingStore): a lookup reads its
block alone (bytes counted from the safetensors header by hand), verified when first read; a block, the header or
the file's length altered is refused before any row of it is used; the LRU of open sidecars and of blocks; the
older formats still read, verified whole; the memory bound's terms by hand."""

from __future__ import annotations

import json
import pickle
import re
import tracemalloc

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.data import reinforced
from disco_clip_ds.data.embeddings import (
    EmbeddingStore,
    Reinforced,
    TeacherFacts,
    read_reinforced,
    shard_facts,
    sidecar_path,
    store_memory_bound,
    stored_row_bytes,
    write_reinforced,
)
from disco_clip_ds.data.sidecar_file import open_sidecar
from disco_clip_ds.errors import DataError

WIDTHS, K, CAPTIONS = (8, 4), 2, ["txt", "syn0.txt"]
ROW = (K + len(CAPTIONS)) * sum(WIDTHS) * 2 + 16 * K  # float16 embeddings and int32 boxes: 96 + 32 = 128 bytes


def _stored(shard: str, n: int, seed: int = 0, dtype: str = "float16") -> Reinforced:
    gen = torch.Generator().manual_seed(seed)
    return Reinforced(
        [f"k{i}" for i in range(n)],
        [TeacherFacts("a", "A", "clip", 100.0), TeacherFacts("b", "B", "siglip", 10.0, -10.0)],
        [F.normalize(torch.randn(n, K, d, generator=gen), dim=-1) for d in WIDTHS],
        [{c: F.normalize(torch.randn(n, d, generator=gen), dim=-1) for c in CAPTIONS} for d in WIDTHS],
        torch.randint(0, 99, (n, K, 4), generator=gen, dtype=torch.int32),
        CAPTIONS,
        K,
        dtype,
        3,
        shard_facts(shard),
    )


def _sidecars(tmp_path, monkeypatch, shards: int = 1, n: int = 10, rows: int = 4):
    """`shards` shards of n samples each, their sidecars written with blocks of `rows` rows."""
    monkeypatch.setattr(reinforced, "BLOCK_ROWS", rows)
    urls, written = [], []
    for s in range(shards):
        url = tmp_path / f"{s:05d}.tar"
        url.write_bytes(b"x")
        stored = _stored(str(url), n, seed=s)
        write_reinforced(sidecar_path(tmp_path, str(url)), stored)
        urls.append(str(url))
        written.append(stored)
    return urls, written


def _header(path):
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), 8 + length


def test_a_lookup_reads_its_block_alone_and_a_kept_block_again_costs_nothing(tmp_path, monkeypatch):
    (url,), (stored,) = _sidecars(tmp_path, monkeypatch)
    header, data_start = _header(sidecar_path(tmp_path, url))
    assert header["__metadata__"]["format"] == "3" and header["__metadata__"]["block_rows"] == "4"
    tensors = [v for name, v in header.items() if name != "__metadata__"]
    assert sum(end - start for start, end in (v["data_offsets"] for v in tensors)) == 10 * ROW  # the row by hand
    assert stored_row_bytes(list(WIDTHS), K, len(CAPTIONS), "float16") == ROW
    store = EmbeddingStore(tmp_path, ["b", "a"])
    sample = store.lookup(url, "k5")  # block 1: rows 4-7
    assert (store.stats.opens, store.stats.blocks, store.stats.bytes) == (1, 1, data_start + 4 * ROW)
    for t, teacher in enumerate((1, 0)):  # the store's teacher order
        assert torch.equal(sample.images[t], stored.images[teacher][5].half().float())
        assert all(torch.equal(sample.texts[t][c], stored.texts[teacher][c][5].half().float()) for c in CAPTIONS)
    assert sample.images[0].dtype == torch.float32 and torch.equal(sample.boxes, stored.boxes[5])
    store.lookup(url, "k7")
    assert store.stats.bytes == data_start + 4 * ROW  # a kept block
    store.lookup(url, "k9")  # the last block: rows 8-9
    assert (store.stats.blocks, store.stats.bytes) == (2, data_start + 6 * ROW)


def test_a_verified_block_no_longer_kept_is_read_again_a_row_at_a_time(tmp_path, monkeypatch):
    (url,), (stored,) = _sidecars(tmp_path, monkeypatch, n=12, rows=2)
    store = EmbeddingStore(tmp_path, ["a", "b"])  # one source: 4 blocks kept
    for row in range(0, 12, 2):  # 6 blocks: the first two are dropped
        store.lookup(url, f"k{row}")
    assert store.stats.blocks == 6 and len(store._blocks) == 4
    before = store.stats.bytes
    sample = store.lookup(url, "k1")  # block 0: verified, no longer kept
    assert (store.stats.blocks, store.stats.rows, store.stats.bytes - before) == (6, 1, ROW)
    assert torch.equal(sample.images[1], stored.images[1][1].half().float()) and torch.equal(
        sample.boxes, stored.boxes[1]
    )


def test_the_open_sidecars_are_least_recently_used_first_out_and_sized_by_the_sources(tmp_path, monkeypatch):
    urls, _ = _sidecars(tmp_path, monkeypatch, shards=6, n=2)
    store = EmbeddingStore(tmp_path, "a")  # 4 open
    for url in [
        *urls[:4],
        urls[0],
        urls[4],
        urls[0],
    ]:  # a hit refreshes: the fifth shard closes the second, not the first
        store.lookup(url, "k0")
    assert store.stats.opens == 5
    store.lookup(urls[1], "k0")
    assert store.stats.opens == 6
    mixed = EmbeddingStore(tmp_path, "a", sources=3)  # 6 open: two passes over 6 shards open each once
    for url in urls + urls:
        mixed.lookup(url, "k1")
    assert mixed.stats.opens == 6 and mixed.capacity == 6
    copy = pickle.loads(pickle.dumps(mixed))  # as a DataLoader worker gets it: nothing open, nothing counted
    assert copy.stats.opens == 0 and not copy._files and copy.lookup(urls[0], "k1").boxes is not None
    mixed.close()


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_an_altered_block_is_refused_before_any_of_its_rows_and_other_blocks_still_serve(tmp_path, monkeypatch):
    (url,), (stored,) = _sidecars(tmp_path, monkeypatch)
    path = sidecar_path(tmp_path, url)
    header, data_start = _header(path)
    start, end = header["text/b/syn0.txt"]["data_offsets"]
    _flip(path, data_start + start + 5 * (end - start) // 10)  # row 5 of one tensor: block 1
    store = EmbeddingStore(tmp_path, ["a", "b"])
    with pytest.raises(DataError, match=f"{path}: its checksum does not match its contents \\(rows 4 to 7"):
        store.lookup(url, "k4")  # a row of that block other than the altered one
    with pytest.raises(DataError, match="rows 4 to 7"):
        store.lookup(url, "k5")  # still refused: a refused block is never kept
    assert torch.equal(store.lookup(url, "k0").boxes, stored.boxes[0])  # block 0 is intact
    with pytest.raises(DataError, match="checksum does not match"):
        read_reinforced(path)


@pytest.mark.parametrize("alter", ["key", "block checksum", "truncate", "extend"])
def test_an_altered_header_or_a_cut_file_is_refused_at_open(tmp_path, monkeypatch, alter):
    (url,), _ = _sidecars(tmp_path, monkeypatch)
    path = sidecar_path(tmp_path, url)
    data = path.read_bytes()
    header, _ = _header(path)
    if alter == "key":  # one sample key for another, of the same length: the JSON still parses
        data = data.replace(b'\\"k3\\"', b'\\"k8\\"', 1)
    elif alter == "block checksum":
        first = json.loads(header["__metadata__"]["block_xxh3"])[0]
        data = data.replace(first.encode(), first[::-1].encode(), 1)
    else:
        data = data[:-1] if alter == "truncate" else data + b"\0"
    assert data != path.read_bytes()
    path.write_bytes(data)
    said = "cut short or extended" if alter in ("truncate", "extend") else "its header does not match its checksum"
    with pytest.raises(DataError, match=f"{path}: .*{said}"):
        EmbeddingStore(tmp_path, "a").lookup(url, "k0")
    with pytest.raises(DataError, match=re.escape(str(path))):  # safetensors' own words for a cut file
        read_reinforced(path)


def _format_2(path, stored: Reinforced) -> None:
    """A sidecar as the writer before format 3 made it: metadata "format" 2 and one sha256 of the whole file."""
    from safetensors.torch import save

    from disco_clip_ds.data.sidecar_io import _canonical

    tensors = {n: (t if n == "boxes" else t.to(torch.float16)).contiguous() for n, t in stored.tensors().items()}
    header = {**stored.header(), "format": "2"}
    header["sha256"] = reinforced.reinforced_checksum(header, tensors)
    path.write_bytes(_canonical(save(tensors, metadata=header)))


def test_a_format_2_sidecar_is_verified_whole_at_its_first_read(tmp_path):
    url = tmp_path / "00000.tar"
    url.write_bytes(b"x")
    stored, path = _stored(str(url), 10), sidecar_path(tmp_path, str(url))
    _format_2(path, stored)
    store = EmbeddingStore(tmp_path, ["a", "b"])
    assert store.augmentations == K and store.seed == 3  # from its header
    sample = store.lookup(str(url), "k6")
    _, data_start = _header(path)
    assert (store.stats.blocks, store.stats.rows) == (1, 1)
    assert store.stats.bytes == data_start + path.stat().st_size + ROW  # header, the whole file, the row
    assert torch.equal(sample.texts[1]["syn0.txt"], stored.texts[1]["syn0.txt"][6].half().float())
    assert torch.equal(read_reinforced(path).boxes, stored.boxes)
    _flip(path, path.stat().st_size - 1)
    with pytest.raises(DataError, match="checksum does not match"):
        EmbeddingStore(tmp_path, "a").lookup(str(url), "k0")  # any row: the whole file is one block


def test_data_embed_writes_an_older_formats_sidecar_again():
    from disco_clip_ds.data.prep.embed import Settings

    meta = {"format": "2", "teachers": json.dumps([{"fingerprint": "f"}]), "augmentations": "0"}
    assert Settings(["m"]).matches(meta, ["f"]) == "made by an older version (format 2, not 3)"


def test_the_row_bytes_and_the_memory_bound_by_hand():
    """DataCompDR's row: K = 30, two 768-wide teachers, 6 captions, float16: (30 + 6) x 1536 x 2 + 30 x 16 = 111072
    bytes, over 64 kB: a block of its own. 8 sources: 16 blocks kept + 1 read = 17 x 111072; 16 open sidecars of
    10,000 keys x 256 and 10,000 block checksums x 96 = 3520000 each; one row as float32, 2 x 111072. Rows of 1000
    bytes: 64 rows a block (65536 // 1000 = 65, at most 64), 157 blocks a shard of 10,000."""
    assert stored_row_bytes([768, 768], 30, 6, "float16") == 111072
    assert stored_row_bytes([512], 0, 1, "float32") == 4096  # the centre crop: one image row, no boxes
    assert store_memory_bound(8, 111072) == 17 * 111072 + 16 * 3520000 + 2 * 111072
    assert store_memory_bound(1, 111072) == 5 * 111072 + 4 * 3520000 + 2 * 111072  # at least 4 kept
    assert store_memory_bound(2, 1000) == 5 * 64 * 1000 + 4 * (2560000 + 157 * 96) + 2000  # at most 64 rows a block


def test_the_plan_counts_the_same_row():
    from disco_clip_ds.plan import storage_plan

    for widths, k, c, dtype in [([768, 768], 10, 6, "float16"), ([512], 0, 1, "float32"), ([64], 3, 2, "bfloat16")]:
        plan = storage_plan(1, k, widths, c, dtype)
        assert stored_row_bytes(widths, k, c, dtype) == plan.images + plan.texts + plan.boxes


@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_open_sidecar_holds_less_than_the_bound_allows_per_key(tmp_path, monkeypatch):
    """KEY_BYTES and DIGEST_BYTES, the bound's allowance per sample key and block of an open sidecar, against
    Python's own count of what one holds (64-character keys, a block per row)."""
    from disco_clip_ds.data.embeddings import DIGEST_BYTES, KEY_BYTES

    (url,), _ = _sidecars(tmp_path, monkeypatch, n=2, rows=1)
    n = 3000
    stored = _stored(url, n)
    stored.keys = [f"{i:064d}" for i in range(n)]
    path = sidecar_path(tmp_path, url)
    write_reinforced(path, stored)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sidecar = open_sidecar(path)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    sidecar.close()
    assert len(sidecar.digests) == n and held < n * (KEY_BYTES + DIGEST_BYTES), held / n
