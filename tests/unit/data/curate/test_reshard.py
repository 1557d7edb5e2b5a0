"""Resharding (data/curate/reshard.py): kept members copied byte for byte (read back with tarfile, not our reader),
tar headers without this machine's time or owner, the sidecar rows carried over as training looks them up, the
completion check, and the plan of output shards by hand."""

from __future__ import annotations

import tarfile

import numpy as np
import torch

from disco_clip_ds.data.curate.reshard import is_complete, plan_shards, shard_size, write_output_shard
from disco_clip_ds.data.embeddings import EmbeddingStore, read_sidecar, sidecar_path
from disco_clip_ds.data.shards import shards_for_reader

from unit.data.curate.shardsets import TEACHER, embedded_shards


def _members(path):
    with tarfile.open(path) as tar:
        return [(info, tar.extractfile(info).read()) for info in tar.getmembers()]


def test_kept_members_are_copied_byte_for_byte_with_their_embeddings(tmp_path):
    urls = embedded_shards(tmp_path / "in", 2, 5)
    pieces = [
        (urls[0], sidecar_path(tmp_path / "in", urls[0]), [1, 4]),
        (urls[1], sidecar_path(tmp_path / "in", urls[1]), [0]),
    ]
    out = tmp_path / "out" / "00000.tar"
    out.parent.mkdir()
    assert write_output_shard(out, pieces) == 3
    inputs = {info.name: data for url in urls for info, data in _members(url)}
    written = _members(out)
    assert [info.name for info, _ in written] == [
        f"{key}.{ext}" for key in ("000000001", "000000004", "000010005") for ext in ("jpg", "json", "txt")
    ]
    for info, data in written:
        assert data == inputs[info.name]  # the same bytes: no re-encoding
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (0, 0, 0, "", "", 0o644)
    store = EmbeddingStore(out.parent, TEACHER)  # training's own lookup of the carried-over sidecar
    for url, key in ((urls[0], "000000001"), (urls[0], "000000004"), (urls[1], "000010005")):
        rows, image, text, _ = read_sidecar(sidecar_path(tmp_path / "in", url))
        got_image, got_text = store.pair(str(out), key)
        assert torch.equal(got_image, image[rows[key]]) and torch.equal(got_text, text[rows[key]])
    meta = read_sidecar(sidecar_path(out.parent, str(out)))[3]
    assert (meta["teacher"], meta["teacher_name"], meta["logit_scale"]) == (TEACHER, "tiny-teacher", "100.0")


def test_the_same_pieces_give_the_same_bytes_and_a_changed_shard_is_not_complete(tmp_path):
    urls = embedded_shards(tmp_path / "in", 1, 4)
    pieces = [(urls[0], sidecar_path(tmp_path / "in", urls[0]), [0, 2, 3])]
    out = tmp_path / "00000.tar"
    write_output_shard(out, pieces)
    first = out.read_bytes()
    keys = ["000000000", "000000002", "000000003"]
    assert is_complete(out, keys, TEACHER)
    assert not is_complete(out, keys[:2], TEACHER) and not is_complete(out, keys, "another")
    write_output_shard(out, pieces)
    assert out.read_bytes() == first
    damaged = bytearray(first)
    damaged[600] ^= 1  # inside the first member's data: same size, other bytes
    out.write_bytes(bytes(damaged))
    assert not is_complete(out, keys, TEACHER)
    sidecar_path(out.parent, str(out)).unlink()
    out.write_bytes(first)
    assert not is_complete(out, keys, TEACHER)  # a shard renamed into place before its sidecar was written


def test_the_plan_cuts_the_kept_rows_into_shards_of_pieces_by_hand():
    offsets = np.array([0, 4, 6])  # input shards of 4, 2 and 5 samples
    kept = np.array([1, 3, 4, 5, 7, 10])

    def plan(per_shard):
        return [[(shard, rows.tolist()) for shard, rows in pieces] for pieces in plan_shards(kept, offsets, per_shard)]

    assert plan(4) == [[(0, [1, 3]), (1, [0, 1])], [(2, [1, 4])]]
    assert plan(6) == [[(0, [1, 3]), (1, [0, 1]), (2, [1, 4])]]
    assert plan_shards(np.array([], np.int64), offsets, 4) == []


def test_the_default_shard_size_gives_a_shard_to_every_reader_of_a_node_while_the_kept_samples_allow():
    # by hand: the demo's 1,437 training samples cut in shards of 89 (17 shards), 10 kept in 10 shards of 1, a
    # billion in img2dataset's 10,000; a given size is kept as given
    assert [shard_size(n, None) for n in (1437, 10, 0, 10**9, 160_000)] == [89, 1, 1, 10_000, 10_000]
    assert shard_size(1437, 10_000) == 10_000
    for kept in (1, 15, 16, 17, 31, 1437, 159_999, 160_001):
        shards = -(-kept // shard_size(kept, None))
        assert shards >= min(kept, 16), kept
        shards_for_reader([f"{i:05d}.tar" for i in range(shards)], 0, min(kept, 16))  # training's check passes
