"""SemDeDup (data/curate/semdedup.py, `data filter --semdedup_eps`): the removals against SemDeDup's rule written out
here over every pair in float64 (pairs planted well clear of the threshold), hand-made groups (the one least similar
to the centre kept; a chain), the filter's decision on planted near-copies; eps out of range refused in one line."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from disco_clip_ds.commands.data import filter_main
from disco_clip_ds.data.curate import semdedup
from disco_clip_ds.errors import run_main

from unit.data.curate.shardsets import embedded_shards, unit_rows


def _all_pairs(rows: np.ndarray, assigned: np.ndarray, centres: np.ndarray, eps: float) -> np.ndarray:
    """SemDeDup's rule, pair by pair: within a cluster, j is removed when some i before it (less similar to the centre,
    or as similar and earlier in input order) has cosine(i, j) > 1 - eps."""
    cos = lambda a, b: float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    gone = np.zeros(len(rows), bool)
    for c in np.unique(assigned):
        members = [i for i in range(len(rows)) if assigned[i] == c]
        ranked = sorted(members, key=lambda i: (cos(rows[i], centres[c]), i))
        for b, j in enumerate(ranked):
            gone[j] = any(cos(rows[i], rows[j]) > 1 - eps for i in ranked[:b])
    return gone


def _planted(rng, groups: int, copies: int, singles: int, dim: int = 16, noise: float = 0.01) -> np.ndarray:
    """Unit rows: `groups` originals with `copies` near-copies each (cosine about 1 - noise^2 dim / 2), then
    `singles` distinct rows, shuffled."""
    originals = unit_rows(rng, groups + singles, dim)
    rows = [originals[g] + noise * rng.standard_normal(dim) for g in range(groups) for _ in range(copies)]
    rows = np.concatenate([originals, np.array(rows).reshape(-1, dim)])
    return rows[rng.permutation(len(rows))]


def test_removals_are_semdedups_rule_over_every_pair():
    rng = np.random.default_rng(0)
    rows = _planted(rng, groups=12, copies=3, singles=40)
    centres = unit_rows(rng, 4, 16)
    assigned = np.argmax(rows @ centres.T, axis=1)
    sims = rows @ rows.T / np.outer(np.linalg.norm(rows, axis=1), np.linalg.norm(rows, axis=1))
    for eps in (0.01, 0.3):  # copies sit near cosine 0.9992, distinct rows below 0.9 here: both clear of 1 - eps
        assert not np.any(np.abs(sims - (1 - eps)) < 1e-6)
        expected = _all_pairs(rows, assigned, centres, eps)
        assert np.array_equal(semdedup.removed(rows.astype(np.float32), assigned, centres, eps), expected)
    assert semdedup.removed(rows, assigned, centres, 0.01).sum() > 12  # the copies are found


def test_of_a_group_the_one_least_similar_to_the_centre_is_kept_and_a_chain_loses_both_later_links():
    centre = np.array([[1.0, 0.0]])
    angle = lambda degrees: [np.cos(np.radians(degrees)), np.sin(np.radians(degrees))]
    group = np.array([angle(10), angle(11), angle(12)])  # within 2 degrees of each other; 12 is furthest out
    assert semdedup.removed(group, np.zeros(3, int), centre, 0.01).tolist() == [True, True, False]
    chain = np.array([angle(30), angle(20), angle(10)])  # neighbours 10 degrees apart (cos 0.985), ends 20 (0.94)
    assert semdedup.removed(chain, np.zeros(3, int), centre, 0.02).tolist() == [False, True, True]
    apart = np.zeros(3, int) + np.array([0, 1, 0])  # the middle link in another cluster: the ends are not compared
    assert not semdedup.removed(chain, apart, np.array([[1.0, 0.0], [0.0, 1.0]]), 0.02).any()


def test_the_filter_drops_the_planted_copies_and_no_distinct_sample(tmp_path):
    rng = np.random.default_rng(1)
    groups = np.eye(8)[[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 0]]  # samples 8, 9, 10, 11 repeat 0, 1, 2, 0
    rows = groups + 0.01 * rng.standard_normal(groups.shape)
    embedded_shards(tmp_path / "in", 3, 4, image=rows / np.linalg.norm(rows, axis=1, keepdims=True))
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--semdedup_eps", 0.01]
    assert run_main(filter_main, [str(a) for a in [*argv, "--semdedup_clusters", 3]], "disco-clip data filter") == 0
    dropped = pq.read_table(tmp_path / "out" / "filter.parquet").to_pydict()["dropped_by"]
    copies = [[0, 8, 11], [1, 9], [2, 10]]
    assert all(sum(dropped[i] is None for i in group) == 1 for group in copies)  # one of each group kept
    assert [dropped[i] for i in range(3, 8)] == [None] * 5 and dropped.count("semdedup") == 4


@pytest.mark.parametrize("eps", [0, 1, -0.1, 1.5])
def test_eps_outside_zero_one_is_refused_in_one_line_before_anything_is_written(eps, tmp_path, capsys):
    embedded_shards(tmp_path / "in", 1, 2)
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--semdedup_eps", eps]
    assert run_main(filter_main, [str(a) for a in argv], "disco-clip data filter") == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"--semdedup_eps {float(eps)}: give a number between 0 and 1" in said[0], said
    assert not (tmp_path / "out").exists()


def test_semdedup_without_embeddings_names_the_embed_command(tmp_path, capsys):
    from disco_clip_ds.data.embeddings import sidecar_path

    urls = embedded_shards(tmp_path / "in", 1, 2)
    sidecar_path(tmp_path / "in", urls[0]).unlink()
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--semdedup_eps", 0.05]
    assert run_main(filter_main, [str(a) for a in argv], "disco-clip data filter") == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "disco-clip data embed" in said[0], said
    assert not (tmp_path / "out").exists()
