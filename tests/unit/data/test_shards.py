"""Shard lists: expansion, '::' sources, counting from sizes.json / img2dataset stats, disjoint reader split."""

import json

import pytest

from disco_clip_ds.data.shards import (
    count_samples,
    empty_reader,
    epoch_order,
    expand_shards,
    shard_sizes,
    shards_for_reader,
)


def test_brace_expansion_and_sources_joined_with_double_colon():
    urls = expand_shards("a/{00000..00002}.tar::https://host/b/{0..1}.tar")
    assert urls == ["a/00000.tar", "a/00001.tar", "a/00002.tar", "https://host/b/0.tar", "https://host/b/1.tar"]


def test_directory_stands_for_its_tars(tmp_path):
    for name in ("00001.tar", "00000.tar", "sizes.json"):
        (tmp_path / name).write_text("x")
    assert expand_shards(str(tmp_path)) == [str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards"):
        expand_shards(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no shards"):
        expand_shards(" :: ")


def test_counts_from_sizes_json_and_img2dataset_stats(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "sizes.json").write_text(json.dumps({"00000.tar": 7, "00001.tar": 5}))
    (b / "00000_stats.json").write_text(json.dumps({"count": 10, "successes": 9, "failures": 1}))
    urls = expand_shards(f"{a}/{{00000..00001}}.tar::{b}/00000.tar")
    assert count_samples(urls) == 7 + 5 + 9
    with pytest.raises(ValueError, match="--train_num_samples"):
        count_samples([f"{a}/00002.tar"])
    with pytest.raises(ValueError, match="--train_num_samples"):
        count_samples(["https://host/00000.tar"])
    (a / "sizes.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="unreadable"):
        count_samples([f"{a}/00000.tar"])


def test_readers_get_disjoint_shares_covering_everything():
    urls = [f"{i:05d}.tar" for i in range(10)]
    ranks, workers = 2, 2
    shares = [shards_for_reader(urls, r * workers + w, ranks * workers) for r in range(ranks) for w in range(workers)]
    assert sorted(sum(shares, [])) == urls
    assert all(len(s) in (2, 3) for s in shares)
    with pytest.raises(ValueError, match="lower --dataloader_num_workers"):
        shards_for_reader(urls[:3], 0, 4)


def test_epoch_order_is_a_reproducible_permutation_that_changes_per_epoch():
    shards = [f"{i}.tar" for i in range(8)]
    orders = [epoch_order(shards, seed=1, epoch=e, reader=0) for e in range(3)]
    assert all(sorted(o) == shards for o in orders)
    assert orders[0] == epoch_order(shards, seed=1, epoch=0, reader=0)
    assert len({tuple(o) for o in orders}) > 1


def test_empty_reader_is_found_from_recorded_counts_only(tmp_path):
    (tmp_path / "sizes.json").write_text(json.dumps({f"{i:05d}.tar": n for i, n in enumerate([4, 0, 3, 0, 0])}))
    urls = [str(tmp_path / f"{i:05d}.tar") for i in range(5)]
    assert shard_sizes(urls) == dict(zip(urls, [4, 0, 3, 0, 0]))
    assert empty_reader(urls, 1) is None and empty_reader(urls[1:3], 1) is None  # an empty shard among others: fine
    assert empty_reader(urls, 2) == (1, [urls[1], urls[3]])  # reader 1: both of its shards are empty
    assert empty_reader(urls, 5) == (1, [urls[1]])  # the first such reader
    assert empty_reader(urls + ["https://host/00005.tar"], 2) is None  # a count unknown: the stream finds out
