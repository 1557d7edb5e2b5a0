"""MetaCLIP's balancing (data/curate/balance.py, `data filter --metadata --balance_t`): the matching against a
brute-force substring search written here from MetaCLIP's rule, the keep probability against hand-computed values and
a seeded large draw, the decision against hand-computed cases; every bad list refused in one line, exit 2, before
anything is written."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disco_clip_ds.commands.data import filter_main
from disco_clip_ds.data.curate import balance
from disco_clip_ds.errors import UsageError, run_main

from unit.data.curate.shardsets import embedded_shards

WORDS = ["dog", "Dog", "cat", "cats", "hot", "hot dog", "a", "New York", "York"]
MARKS = [" ", " ", " ", ",", ".", "!", "(", "-", "\n", "\t", "`"]


def _brute_force(caption: str, entries: list[str]) -> list[int]:
    """MetaCLIP's rule written out: each listed mark made a word of its own, blanks made spaces, then " entry " is a
    substring of " caption "."""
    spaced = " " + re.sub(r"[\t\n\r]", " ", re.sub(r"([,.;:?!`])", r" \1 ", caption)) + " "
    return [i for i, entry in enumerate(entries) if f" {entry} " in spaced]


@settings(max_examples=15, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(MARKS)), max_size=8))
def test_matching_is_the_brute_force_substring_search(pieces):
    entries = ["dog", "cat", "hot dog", "New York", "York", "a", "Dog", "dog dog"]
    caption = "".join(word + mark for word, mark in pieces)
    assert balance.Matcher(entries).match(caption) == _brute_force(caption, entries)


def test_matching_is_case_sensitive_whole_words_with_metaclips_punctuation():
    match = balance.Matcher(["cat", "apple", "apple pie", "St. Louis"]).match
    assert match("a cat") == [0] and match("A Cat") == [] and match("cats") == [] and match("concat") == []
    assert match("the cat, sat.") == [0] and match("cat!") == [0] and match("(cat)") == [] and match("cat-like") == []
    assert match("apple pie") == [1, 2]  # overlapping entries both count
    assert match("St. Louis") == []  # the caption's "." is spaced, the entry's is not: as MetaCLIP


def test_the_probability_is_min_one_t_over_count():
    assert balance.keep_probability(np.array([0, 5, 10, 40]), 10.0).tolist() == [1.0, 1.0, 1.0, 0.25]


def test_a_sample_is_kept_when_any_of_its_entries_draws_it_at_the_computed_rate():
    n = 60_000  # per kind: one entry at 0.25, one at 0.6, both (1 - 0.75 x 0.4 = 0.7), none (0)
    ids = np.array([0] * n + [1] * n + [0, 1] * n, np.int32)
    per_sample = np.r_[np.ones(2 * n, np.int64), np.full(n, 2), np.zeros(n, np.int64)]
    starts = np.r_[0, np.cumsum(per_sample)]
    kept = balance.draw_shard(ids, starts, np.array([0.25, 0.6]), seed=3, shard=0)
    for part, p in zip(np.split(kept, 4), [0.25, 0.6, 0.7, 0.0]):
        assert abs(part.mean() - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-12  # 4 sigma
    again = balance.draw_shard(ids, starts, np.array([0.25, 0.6]), seed=3, shard=0)
    assert np.array_equal(kept, again)  # seeded
    assert not np.array_equal(kept, balance.draw_shard(ids, starts, np.array([0.25, 0.6]), seed=3, shard=1))


def _scan(path, matches: list[list[int]]):
    starts = np.r_[0, np.cumsum([len(m) for m in matches])]
    ids = np.array([i for m in matches for i in m], np.int32)
    np.savez(path, meta_ids=ids, meta_starts=starts)
    return path


def test_counts_are_over_the_pool_of_every_shard_and_unmatched_samples_are_dropped(tmp_path):
    # entry 0 in 3 pool samples over two shards (p = 2/3 at t = 2), entry 1 in one (p = 1); sample 3 matches nothing
    scans = [_scan(tmp_path / "0.npz", [[0], [0, 1], [0]]), _scan(tmp_path / "1.npz", [[], [0], [0]])]
    pool = np.array([True, True, False, True, True, False])  # samples 2 and 5 dropped by an earlier rule
    drops = balance.balance_drops(scans, [0, 3], pool, 2.0, seed=0, size=2)
    assert not drops[[2, 5]].any() and drops[3]  # not in the pool: not this rule's; matched nothing: dropped
    assert not drops[1]  # entry 1 keeps it whatever entry 0 draws
    everything = balance.balance_drops(scans, [0, 3], pool, 3.0, seed=0, size=2)  # t = count: p = 1
    assert np.flatnonzero(everything).tolist() == [3]
    n = 40_000  # one shard of n samples of entry 0 alone: each kept with p = t / n = 1/4
    big = balance.balance_drops([_scan(tmp_path / "2.npz", [[0]] * n)], [0], np.ones(n, bool), n / 4, seed=0, size=1)
    assert abs(1 - big.mean() - 0.25) <= 4 * np.sqrt(0.25 * 0.75 / n)


def test_the_filter_keeps_the_matched_samples_and_drops_the_others(tmp_path):
    captions = ["a red dog.", "Dog", "the cat, sat", "cats", "a dog and a cat", "nothing", "dog", "dog dog"]
    embedded_shards(tmp_path / "in", 2, 4, captions=captions, skip=(6,))  # sample 6 not embedded: not matched
    (tmp_path / "meta.txt").write_text("dog\ncat\n\n  dog  \n", encoding="utf-8")  # blank and repeated lines ignored
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--metadata", tmp_path / "meta.txt"]
    assert run_main(filter_main, [str(a) for a in [*argv, "--balance_t", 100]], "disco-clip data filter") == 0
    dropped = pq.read_table(tmp_path / "out" / "filter.parquet").to_pydict()["dropped_by"]
    assert dropped == [None, "balance", None, "balance", None, "balance", "no_embedding", None]


def test_a_resume_with_the_list_changed_matches_again(tmp_path):
    embedded_shards(tmp_path / "in", 1, 3, captions=["dog", "cat", "bird"])
    (tmp_path / "meta.txt").write_text("dog\n", encoding="utf-8")
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--metadata", tmp_path / "meta.txt"]
    argv = [str(a) for a in [*argv, "--balance_t", 10]]
    assert run_main(filter_main, argv, "disco-clip data filter") == 0
    (tmp_path / "meta.txt").write_text("bird\ncat\n", encoding="utf-8")  # the same arguments, another list
    assert run_main(filter_main, argv, "disco-clip data filter") == 0
    dropped = pq.read_table(tmp_path / "out" / "filter.parquet").to_pydict()["dropped_by"]
    assert dropped == ["balance", None, None]


def test_captions_are_read_alike_from_a_plain_and_a_compressed_shard(tmp_path):
    import gzip

    from disco_clip_ds.testing.images import write_samples

    samples = [{"txt": "a dog"}, {"caption": "a cat"}, {"text": "cat", "txt": "dog"}, {"cls": "3"}, {"txt": "cat"}]
    write_samples(tmp_path, [{"jpg": b"x", **s} for s in samples], per_shard=5)
    plain = tmp_path / "00000.tar"
    (tmp_path / "00000.tar.gz").write_bytes(gzip.compress(plain.read_bytes()))
    keys, rows = [f"s{i:05d}" for i in range(5)], np.array([0, 1, 2, 3, -1])  # the last one not embedded
    match = balance.Matcher(["dog", "cat"])
    expected = {"meta_ids": [0, 1, 0], "meta_starts": [0, 1, 2, 3, 3, 3]}  # txt first, then text, then caption
    for url in (plain, tmp_path / "00000.tar.gz"):  # located by its headers; read by tarfile
        found = balance.shard_matches(str(url), None, keys, rows, match)
        assert {k: v.tolist() for k, v in found.items()} == expected


LISTS = {
    "empty": (b"", "no entries (the file is empty)"),
    "blank": (b"  \n\n", "no entries (the file is empty)"),
    "latin1": ("caf\u00e9\n".encode("latin-1"), "line 1 is not UTF-8 text (byte 0xe9 at column 4): save it as UTF-8"),
    "binary": (b"dog\0\0\0cat", "holds NUL bytes, not a text file"),
}


@pytest.mark.parametrize("case", list(LISTS))
def test_a_bad_metadata_list_is_refused_in_one_line_before_anything_is_written(case, tmp_path, capsys):
    embedded_shards(tmp_path / "in", 1, 2, captions=["dog", "cat"])
    content, message = LISTS[case]
    (tmp_path / "meta.txt").write_bytes(content)
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--metadata", tmp_path / "meta.txt"]
    assert run_main(filter_main, [str(a) for a in [*argv, "--balance_t", 5]], "disco-clip data filter") == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("disco-clip data filter: --metadata ") and message in said[0], said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "metadata, t, message",
    [("m.txt", 0, "--balance_t 0"), ("m.txt", -1, "--balance_t -1"), ("m.txt", None, "go together"), (None, 5, "go")],
)
def test_t_must_be_positive_and_go_with_a_list(metadata, t, message):
    with pytest.raises(UsageError, match=message):
        balance.check_balance(metadata, t)
