"""`disco-clip data filter` (commands/data.py, data/curate/pipeline.py) on small shard sets whose scores the test
chose: what is kept, against hand-computed lists; the output read back by tarfile, `data verify` and training's
embedding lookup; byte-identical re-runs and resumes; every refusal in one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from disco_clip_ds.commands.data import filter_main
from disco_clip_ds.data.embeddings import EmbeddingStore, read_sidecar, shard_facts, sidecar_path, write_sidecar
from disco_clip_ds.data.prep.verify import verify
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.images import write_shards

from unit.data.curate.shardsets import TEACHER, embedded_shards

# two shards of five: sample 4 (a sample data embed skipped) has no embedding
COSINES = [0.3, 0.1, 0.29, 0.5, -0.2, 0.27, 0.9, 0.31, 0.0, 0.35]


def _filter(*argv) -> int:
    return run_main(filter_main, [str(a) for a in argv], "disco-clip data filter")


def _keys(tar_path) -> list[str]:
    with tarfile.open(tar_path) as tar:
        return list(dict.fromkeys(m.name.split(".")[0] for m in tar.getmembers()))


def _hashes(folder) -> dict[str, str]:
    """sha256 of every file of an output folder but the resume state."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".filter" not in p.parts
    }


@pytest.fixture
def shards(tmp_path):
    embedded_shards(tmp_path / "in", 2, 5, cosines=COSINES, skip=(4,))
    return tmp_path / "in"


def test_the_score_threshold_keeps_the_hand_computed_samples(shards, tmp_path, capsys):
    out = tmp_path / "out"
    assert _filter("--shards", shards, "--output", out, "--clip_score_min", 0.28, "--samples_per_shard", 4) == 0
    keys = [f"{s:05d}{i:04d}" for s in range(2) for i in range(s * 5, s * 5 + 5)]
    kept = [keys[i] for i in (0, 2, 3, 6, 7, 9)]  # cosine >= 0.28, sample 4 never embedded
    assert [_keys(out / "00000.tar"), _keys(out / "00001.tar")] == [kept[:4], kept[4:]]
    assert json.loads((out / "sizes.json").read_text()) == {"00000.tar": 4, "00001.tar": 2}
    report = verify(out)  # `data verify` reads the output as any shard set
    assert report["broken"] == {} and report["samples"] == 6
    dropped = {"no_embedding": 1, "clip_score_min": 3}
    alone = {"no_embedding": 9, "clip_score_min": 7}  # the score rule leaves sample 4 (no score) to no_embedding
    summary = {"samples": 10, "kept": 6, "dropped": dropped, "kept_by_rule": alone, "output_shards": 2}
    assert json.loads((out / "summary.json").read_text()) == {**summary, "samples_per_shard": 4}
    printed = capsys.readouterr()
    assert (
        "6 of 10 samples (60.0 %) kept in 2 shards of up to 4; dropped: 1 (10.0 %) by no_embedding, 3 (30.0 %) by "
        "clip_score_min" in printed.out
    )
    # 2 shards hold 6 samples: a warning names the flag that writes more (training needs a shard per reader)
    assert "warning: 2 output shard(s) of up to 4 samples" in printed.err and "--samples_per_shard" in printed.err
    table = pq.read_table(out / "filter.parquet").to_pydict()
    assert table["key"] == keys and table["shard"] == [str(shards / f"{s:05d}.tar") for s in range(2) for _ in range(5)]
    expected = [c if i != 4 else None for i, c in enumerate(COSINES)]
    assert [s if s is None else round(s, 5) for s in table["clip_score"]] == expected
    dropped = [None, "clip_score_min", None, None, "no_embedding", "clip_score_min", None, None, "clip_score_min", None]
    assert table["dropped_by"] == dropped and table["cluster"] == [None] * 10
    store = EmbeddingStore(out, TEACHER)  # training distils from the output without embedding again
    rows, image, _, _ = read_sidecar(sidecar_path(shards, str(shards / "00001.tar")))
    assert torch.equal(store.pair(str(out / "00001.tar"), kept[4])[0], image[rows[kept[4]]])


def test_the_fraction_is_over_all_shards_with_ties_to_the_earliest(tmp_path):
    cosines = [0.1, 0.5, 0.3, 0.5, 0.9, 0.5, 0.2, 0.5, 0.5, 0.0, 0.5, 0.4]
    embedded_shards(tmp_path / "in", 3, 4, cosines=cosines, ties=True)  # the 0.5s are exactly equal scores
    out = tmp_path / "out"
    assert _filter("--shards", tmp_path / "in", "--output", out, "--keep_fraction", 0.5) == 0
    keys = [f"{s:05d}{i:04d}" for s in range(3) for i in range(s * 4, s * 4 + 4)]
    # k = 6: the 0.9, then the first five of the six 0.5s in input order (sample 10's is the one left out)
    assert [k for shard in sorted(out.glob("*.tar")) for k in _keys(shard)] == [keys[i] for i in (1, 3, 4, 5, 7, 8)]


def test_two_rules_keep_what_both_keep_and_name_the_first_that_drops(shards, tmp_path):
    out = tmp_path / "out"
    assert _filter("--shards", shards, "--output", out, "--clip_score_min", 0.28, "--keep_fraction", 0.34) == 0
    # 9 embedded samples, k = floor(0.34 x 9) = 3: cosines 0.9, 0.5, 0.35 (samples 6, 3, 9); all three are >= 0.28
    table = pq.read_table(out / "filter.parquet").to_pydict()
    assert [i for i, d in enumerate(table["dropped_by"]) if d is None] == [3, 6, 9]
    assert table["dropped_by"][1] == "clip_score_min" and table["dropped_by"][0] == "keep_fraction"
    assert json.loads((out / "summary.json").read_text())["dropped"] == {
        "no_embedding": 1,
        "clip_score_min": 3,
        "keep_fraction": 3,
    }


def test_the_same_inputs_give_byte_identical_output_and_a_resume_redoes_only_what_is_missing(shards, tmp_path):
    out = tmp_path / "out"
    argv = ["--shards", shards, "--output", out, "--clip_score_min", 0.0, "--samples_per_shard", 3]
    assert _filter(*argv) == 0
    first = _hashes(out)
    assert len([name for name in first if name.endswith(".tar")]) == 3
    shutil.rmtree(out)
    assert _filter(*argv) == 0
    assert _hashes(out) == first
    # a run killed while writing the second shard: its sidecar not yet written, a torn temporary file (removed by
    # the next writer, which holds the folder's lock), no report
    untouched = (out / "00000.tar").stat().st_mtime_ns
    sidecar_path(out, str(out / "00001.tar")).unlink()
    (out / ".00002.tar.x1b2c3d4.tmp").write_bytes(b"torn")
    (out / "00002.tar").unlink()
    (out / "filter.parquet").unlink()
    assert _filter(*argv) == 0
    assert (out / "00000.tar").stat().st_mtime_ns == untouched  # complete and verified: not written again
    assert _hashes(out) == first


def _teacher(tmp_path, name="teacher"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "clip", "name": name}))
    return tmp_path / name


def _refusal_setup(tmp_path, case) -> list:
    """The arguments of a refusal case, with the files it needs written."""
    from disco_clip_ds.data.teacher_id import teacher_fingerprint

    shards = tmp_path / "in"
    urls = embedded_shards(shards, 2, 3)
    base = ["--shards", shards, "--output", tmp_path / "out"]
    if case == "missing_sidecar":
        sidecar_path(shards, urls[1]).unlink()
    elif case == "mixed_teachers":
        embedded_shards(tmp_path / "other", 1, 3, teacher="0123456789abcdef")
        base[1] = f"{shards}::{tmp_path / 'other'}"
    elif case == "named_teacher":
        base += ["--teacher", _teacher(tmp_path)]
    elif case == "shard_twice":  # `a::a`: every sample kept twice
        base[1] = f"{shards}::{shards}"
    elif case == "shard_changed":
        write_shards(shards, 2, 40, seed=1)  # the shards written again: other sizes than their sidecars record
    elif case == "stale_sidecar":  # the shards written again, of one size (tar pads to 10 KiB records), other keys
        write_shards(shards, 2, 4, seed=1)
        assert [len(read_sidecar(sidecar_path(shards, u))[0]) for u in urls] == [3, 3]
    elif case == "copied_sidecar":
        shutil.copy(sidecar_path(shards, urls[0]), sidecar_path(shards, urls[1]))
    elif case == "foreign_key":
        rows, image, text, meta = read_sidecar(sidecar_path(shards, urls[1]))
        keys = sorted(rows, key=rows.get)
        keys[0] = "not-in-the-shard"
        write_sidecar(sidecar_path(shards, urls[1]), keys, image, text, {**meta, **shard_facts(urls[1])})
    elif case == "target_teacher":
        embedded_shards(tmp_path / "target", 1, 3, teacher="0123456789abcdef")
        base += ["--target", tmp_path / "target", "--clusters", 2]
    elif case == "class_names_without_teacher":
        (tmp_path / "classes.txt").write_text("zero\none\n")
        base += ["--target", tmp_path / "classes.txt", "--clusters", 2]
    elif case == "other_arguments":
        assert _filter(*base, "--clip_score_min", 0.1) == 0
    elif case == "foreign_output":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
    if case in ("named_teacher",):
        assert teacher_fingerprint(str(tmp_path / "teacher")) != TEACHER
    return base


REFUSALS = {
    "no_rule": ([], "no rule given: pass --clip_score_min, --keep_fraction"),
    "score_range": (["--clip_score_min", 1.5], "--clip_score_min 1.5: give a cosine between -1 and 1"),
    "fraction_zero": (["--keep_fraction", 0], "--keep_fraction 0: give a fraction above 0 and at most 1"),
    "fraction_above_one": (["--keep_fraction", 1.2], "--keep_fraction 1.2: give a fraction above 0"),
    "target_without_clusters": (["--target", "x"], "--target and --clusters go together"),
    "clusters_without_target": (["--clusters", 4], "--target and --clusters go together"),
    "kmeans_sample": (["--target", "x", "--clusters", 4, "--kmeans_sample", 2], "--kmeans_sample 2: k-means needs"),
    "threshold_without_dedup": (
        ["--clip_score_min", 0, "--dedup_threshold", 4],
        "--dedup_threshold: give --dedup or --dedup_against",
    ),
    "dedup_threshold_range": (
        ["--dedup", "--dedup_threshold", 40],
        "--dedup_threshold 40: give a whole number of bits",
    ),
    "samples_per_shard": (["--clip_score_min", 0, "--samples_per_shard", 0], "--samples_per_shard and --processes"),
    "remote_shards": (["--clip_score_min", 0, "--shards", "https://example.invalid/{0..1}.tar"], "local shards only"),
    "missing_sidecar": (
        ["--clip_score_min", 0],
        "1 shard(s) without teacher embeddings, e.g. {in}/00001.tar (no 00001.",
    ),
    "shard_twice": (["--clip_score_min", 0], "--shards names the shard in/00000.tar twice: give each shard once"),
    "mixed_teachers": (
        ["--clip_score_min", 0],
        "sidecars of 2 teachers (fingerprints 0123456789abcdef, f00dfeedf00dfeed)",
    ),
    "named_teacher": (
        ["--clip_score_min", 0],
        "the sidecars were made by another teacher (fingerprint f00dfeedf00dfeed",
    ),
    "shard_changed": (["--clip_score_min", 0], "in/00000.tar when it held 30720 bytes; it now holds"),
    "copied_sidecar": (["--clip_score_min", 0], "00000.tar, not in/00001.tar: run `disco-clip data embed` for"),
    "stale_sidecar": (["--clip_score_min", 0], "holds sample 000010003, which shard {in}/00001.tar does not"),
    "foreign_key": (["--clip_score_min", 0], "holds sample not-in-the-shard, which shard {in}/00001.tar does not"),
    "target_teacher": (
        [],
        "was made by another teacher (fingerprint 0123456789abcdef, not the shards' f00dfeedf00dfeed)",
    ),
    "class_names_without_teacher": ([], "classes.txt: its class names must be embedded: give the teacher"),
    "other_arguments": (
        ["--clip_score_min", 0.2],
        "holds the output of a filter with other arguments (--clip_score_min",
    ),
    "foreign_output": (["--clip_score_min", 0], "holds files that are not a filter's output"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_is_one_line_and_exit_2(case, tmp_path, capsys):
    base = _refusal_setup(tmp_path, case)
    extra, message = REFUSALS[case]
    argv = [*base, *extra]
    if "--shards" in extra:  # the case's own shards replace the set's
        argv = argv[2:]
    capsys.readouterr()
    assert _filter(*argv) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("disco-clip data filter: "), said
    assert message.format(**{"in": tmp_path / "in"}) in said[0], said[0]
    if case not in ("other_arguments", "foreign_output", "foreign_key", "stale_sidecar"):  # found when scanning
        assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_shard_without_sidecar_is_named_with_the_embed_command_that_makes_it(tmp_path, capsys):
    urls = embedded_shards(tmp_path / "in", 2, 3)
    sidecar_path(tmp_path / "in", urls[1]).unlink()
    assert _filter("--shards", tmp_path / "in", "--output", tmp_path / "out", "--clip_score_min", 0) == 2
    said = capsys.readouterr().err
    assert f"run `disco-clip data embed --teacher tiny-teacher --shards '{urls[1]}'`" in said
    emb = tmp_path / "emb"  # sidecars in their own folder: the command names it
    shutil.copytree(tmp_path / "in", emb, ignore=shutil.ignore_patterns("*.tar"))
    argv = ["--shards", tmp_path / "in", "--embeddings", emb, "--output", tmp_path / "out", "--clip_score_min", 0]
    assert _filter(*argv) == 2
    assert f"--shards '{urls[1]}' --output {emb}`" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written before the inputs are checked


def _grouped_rows(groups: list[int], dim: int = 8, seed: int = 0) -> np.ndarray:
    """Unit image rows near basis vector e_g for each sample's group g: clusters k-means finds, by construction."""
    rng = np.random.default_rng(seed)
    rows = np.eye(dim)[groups] + 0.05 * rng.standard_normal((len(groups), dim))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_image_rule_keeps_the_clusters_the_target_points_at_and_intersects_with_the_score(tmp_path):
    groups = [0, 1, 2, 1, 0, 2, 1, 1, 0, 2, 2, 1]
    cosines = [0.3, 0.3, 0.3, 0.1, 0.3, 0.3, 0.3, 0.3, 0.1, 0.3, 0.3, 0.3]
    embedded_shards(tmp_path / "in", 2, 6, cosines=cosines, image=_grouped_rows(groups))
    embedded_shards(tmp_path / "target", 1, 2, image=_grouped_rows([1, 1], seed=1), seed=1)  # its images near e1
    out = tmp_path / "out"
    argv = ["--shards", tmp_path / "in", "--target", tmp_path / "target", "--clusters", 3, "--output", out]
    assert _filter(*argv) == 0
    table = pq.read_table(out / "filter.parquet").to_pydict()
    ones = [i for i, g in enumerate(groups) if g == 1]
    assert [i for i, d in enumerate(table["dropped_by"]) if d is None] == ones
    clusters = table["cluster"]  # k-means found the three groups: one cluster id per group
    assert all((clusters[i] == clusters[j]) == (groups[i] == groups[j]) for i in range(12) for j in range(12))
    both = tmp_path / "both"
    assert _filter(*argv[:-1], both, "--clip_score_min", 0.2) == 0
    kept = [d is None for d in pq.read_table(both / "filter.parquet").to_pydict()["dropped_by"]]
    assert [i for i, k in enumerate(kept) if k] == [i for i in ones if cosines[i] >= 0.2]  # 3 dropped by its score


def test_copies_of_eval_images_and_earlier_samples_are_dropped(tmp_path, capsys):
    from unit.data.curate.shardsets import smooth_jpeg

    images = [smooth_jpeg(i) for i in range(8)]
    images[5] = smooth_jpeg(1, flip=True, quality=70)  # a flipped, re-encoded copy of sample 1
    images[6] = images[2]  # an exact duplicate of sample 2
    cosines = [0.3, 0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    embedded_shards(tmp_path / "in", 2, 4, cosines=cosines, images=images)
    from disco_clip_ds.testing.images import write_samples

    evalset = [{"webp": smooth_jpeg(3, scale=0.9), "cls": b"0"}, {"webp": smooth_jpeg(100), "cls": b"1"}]
    write_samples(tmp_path / "eval" / "test", evalset, per_shard=2)  # a CLIP_benchmark wds layout
    out = tmp_path / "out"
    argv = ["--shards", tmp_path / "in", "--output", out, "--dedup", "--dedup_against", tmp_path / "eval"]
    assert _filter(*argv) == 0
    table = pq.read_table(out / "filter.parquet").to_pydict()
    assert table["dropped_by"] == [None, None, None, "dedup_against", None, "dedup", "dedup", None]
    # 1 of 8 dropped as a copy of an eval image (12.5 %, above 3 %): the warning names the threshold and its flag;
    # without --samples_per_shard the 5 kept samples are 5 shards, and no shard warning
    printed = capsys.readouterr()
    assert "1 (12.5 %) by dedup_against, 2 (25.0 %) by dedup" in printed.out
    assert (
        "warning: --dedup_against dropped 1 of 8 samples (12.5 %) as copies at --dedup_threshold 8 (the " in printed.err
    )
    assert len(list(out.glob("*.tar"))) == 5 and "output shard" not in printed.err
    # with the score rule dropping sample 1, its flipped copy (5) is the first of its kind and is kept
    assert _filter(*argv[:3], tmp_path / "scored", "--dedup", "--clip_score_min", 0.2) == 0
    table = pq.read_table(tmp_path / "scored" / "filter.parquet").to_pydict()
    assert table["dropped_by"] == [None, "clip_score_min", None, None, None, None, "dedup", None]


def test_sidecars_in_their_own_folder_and_a_named_teacher_give_the_same_filter(tmp_path):
    from disco_clip_ds.data.teacher_id import teacher_fingerprint

    teacher = _teacher(tmp_path)
    urls = embedded_shards(tmp_path / "in", 2, 5, cosines=COSINES, teacher=teacher_fingerprint(str(teacher)))
    emb = tmp_path / "emb"
    emb.mkdir()
    for url in urls:
        sidecar = sidecar_path(tmp_path / "in", url)
        sidecar.rename(emb / sidecar.name)  # the name depends on the shard alone: it serves from any folder
    argv = ["--shards", tmp_path / "in", "--embeddings", emb, "--teacher", teacher, "--clip_score_min", 0.28]
    assert _filter(*argv, "--output", tmp_path / "out") == 0
    table = pq.read_table(tmp_path / "out" / "filter.parquet").to_pydict()
    assert [i for i, d in enumerate(table["dropped_by"]) if d is None] == [0, 2, 3, 6, 7, 9]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_kmeans_sample_and_seed_give_faiss_own_clusters_of_that_sample(tmp_path):
    import faiss

    from disco_clip_ds.data.curate.clusters import NITER

    groups = [g % 4 for g in range(40)]
    image = _grouped_rows(groups, seed=3)
    embedded_shards(tmp_path / "in", 4, 10, image=image)
    embedded_shards(tmp_path / "target", 1, 1, image=_grouped_rows([2], seed=4), seed=4)
    argv = ["--shards", tmp_path / "in", "--target", tmp_path / "target", "--clusters", 4, "--kmeans_sample", 12]
    assert _filter(*argv, "--seed", 5, "--output", tmp_path / "out") == 0
    # the reference: numpy's Generator(5) draws 12 of the 40 rows, faiss.Kmeans trains on them, its index assigns
    rows = np.sort(np.random.default_rng(5).choice(40, size=12, replace=False))
    stored = np.concatenate([read_sidecar(p)[1].numpy() for p in sorted((tmp_path / "in").glob("*.safetensors"))])
    kmeans = faiss.Kmeans(8, 4, niter=NITER, seed=5, verbose=False)
    kmeans.train(stored[rows])
    expected = kmeans.index.search(stored, 1)[1][:, 0]
    table = pq.read_table(tmp_path / "out" / "filter.parquet").to_pydict()
    assert table["cluster"] == expected.tolist()
    target_cluster = kmeans.index.search(read_sidecar(next((tmp_path / "target").glob("*.safetensors")))[1].numpy(), 1)
    kept = [i for i, d in enumerate(table["dropped_by"]) if d is None]
    assert kept == [i for i in range(40) if expected[i] == target_cluster[1][0, 0]]


def test_the_dedup_threshold_sets_how_near_a_copy_is(tmp_path):
    from disco_clip_ds.data.curate.copies import hamming, image_fingerprint

    from unit.data.curate.shardsets import smooth_jpeg

    images = [smooth_jpeg(i) for i in range(4)]
    images[2] = smooth_jpeg(0, scale=0.5, quality=20)  # sample 0 halved and re-encoded hard: some bits away
    images[3] = images[1]  # an exact duplicate: 0 bits away, and the same bytes
    distance = hamming(image_fingerprint(images[2])[1], image_fingerprint(images[0])[1]).min()
    assert 0 < distance <= 10, distance
    embedded_shards(tmp_path / "in", 1, 4, images=images)
    argv = ["--shards", tmp_path / "in", "--dedup"]
    assert _filter(*argv, "--output", tmp_path / "near", "--dedup_threshold", int(distance)) == 0
    assert _filter(*argv, "--output", tmp_path / "exact", "--dedup_threshold", int(distance) - 1) == 0
    near = pq.read_table(tmp_path / "near" / "filter.parquet").to_pydict()["dropped_by"]
    exact = pq.read_table(tmp_path / "exact" / "filter.parquet").to_pydict()["dropped_by"]
    assert near == [None, None, "dedup", "dedup"] and exact == [None, None, None, "dedup"]


@pytest.mark.slow  # builds a tiny teacher, embeds 18 samples and 3 class names
def test_a_real_teacher_embed_then_filter_with_a_class_name_target(tmp_path):
    """End to end as a user runs it: `data embed` with a teacher, then `data filter --teacher` with the best half by
    CLIP score intersected with a class-name target; the scores are the float64 cosines of the stored rows."""
    from disco_clip_ds.commands.data import embed_main
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR

    torch.manual_seed(0)
    teacher = tmp_path / "teacher"
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(teacher)
    urls = write_shards(tmp_path / "in", 3, 6)
    tokenizer = ["--tokenizer_name", str(TOKENIZER_DIR)]  # the teacher's folder has none
    assert run_main(embed_main, ["--teacher", str(teacher), *tokenizer, "--shards", str(tmp_path / "in")], "e") == 0
    (tmp_path / "classes.txt").write_text("zero\none\ntwo\n")
    out = tmp_path / "out"
    argv = ["--shards", tmp_path / "in", "--teacher", teacher, *tokenizer, "--keep_fraction", 0.5, "--output", out]
    assert _filter(*argv, "--target", tmp_path / "classes.txt", "--clusters", 3) == 0
    image, text = (
        np.concatenate([read_sidecar(sidecar_path(tmp_path / "in", u))[i].numpy().astype(np.float64) for u in urls])
        for i in (1, 2)
    )
    cosines = np.sum(image * text, 1) / np.linalg.norm(image, axis=1) / np.linalg.norm(text, axis=1)
    table = pq.read_table(out / "filter.parquet").to_pydict()
    np.testing.assert_allclose(table["clip_score"], cosines, atol=1e-6)
    best = set(np.argsort(-cosines, kind="stable")[:9].tolist())  # floor(0.5 x 18)
    by_target = {i for i, d in enumerate(table["dropped_by"]) if d != "target"}
    kept = [i for i, d in enumerate(table["dropped_by"]) if d is None]
    assert kept == sorted(best & by_target) and set(table["cluster"]) <= {0, 1, 2}
    assert sum(json.loads((out / "sizes.json").read_text()).values()) == len(kept)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_second_filter_into_one_output_is_refused_naming_the_first_which_finishes_untouched(
    shards, tmp_path, monkeypatch
):
    """The second filter is another process started at a named point of the first (output shard 0 complete, the
    others not): refused in one line naming the first's host and pid; the first's output is byte for byte a lone
    run's. (Before: a `FileNotFoundError` traceback, the two renaming each other's temporary files away.)"""
    from disco_clip_ds import faults
    from disco_clip_ds.testing.writers import in_another_process

    out = tmp_path / "out"
    argv = ["--shards", shards, "--output", out, "--clip_score_min", 0.0, "--samples_per_shard", 3]
    assert _filter(*argv) == 0
    alone = _hashes(out)
    shutil.rmtree(out)
    said = []
    after_output_shard = faults.after_output_shard

    def second_filter_at(shard: int) -> None:
        if shard == 0:
            said.append(in_another_process(lambda: filter_main([str(a) for a in argv])))
        after_output_shard(shard)

    monkeypatch.setattr(faults, "after_output_shard", second_filter_at)
    assert _filter(*argv) == 0
    holder = f"(disco-clip data filter: host {socket.gethostname()}, pid {os.getpid()}, since "
    assert len(said) == 1 and said[0].startswith(
        f"UsageError: --output {out}: being written by another process {holder}"
    )
    assert said[0].endswith("wait for it to end, or give another --output") and "\n" not in said[0]
    assert _hashes(out) == alone


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("per_shard", [2000, 3])
def test_a_key_kept_from_two_sources_is_refused_before_any_shard_whatever_the_shard_size(per_shard, tmp_path, capsys):
    """`a::a_copy`: the same keys in two sources. Refused before writing, naming the first repeated key and both
    shards, whether the copies would meet in one output shard (2000; before: refused mid-write, a temporary file
    left) or not (3; before: exit 0, keys repeated across output shards). A source whose copies a rule drops passes."""
    a, copy, other = (str(tmp_path / name) for name in ("a", "a_copy", "other"))
    embedded_shards(tmp_path / "a", 2, 5, cosines=COSINES)
    embedded_shards(tmp_path / "a_copy", 2, 5, cosines=COSINES)  # the same keys (and samples)
    out = tmp_path / "out"
    argv = ["--output", out, "--clip_score_min", 0.28, "--samples_per_shard", per_shard]
    capsys.readouterr()
    assert _filter("--shards", f"{a}::{copy}", *argv) == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [
        f"disco-clip data filter: --shards: sample key 000000000 is kept from both {a}/00000.tar and {copy}/00000.tar: "
        "an output's keys must be unique (a shard's sidecar finds a sample by its key); filter those sources into "
        "separate --output folders (training reads them together, '::'-joined)"
    ]
    assert not list(out.glob("*.tar")) and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    embedded_shards(tmp_path / "other", 2, 5, cosines=[0.0] * 10)  # the same keys, every sample below 0.28
    assert _filter("--shards", f"{a}::{other}", *[a if a != out else tmp_path / "out2" for a in argv]) == 0
    assert sum(len(_keys(p)) for p in (tmp_path / "out2").glob("*.tar")) == 6


@pytest.mark.parametrize("damage", ["garbage", "no_stamp", "torn", "npy"])
def test_an_unreadable_resume_scan_is_scanned_again(damage, tmp_path):
    """A saved scan overwritten (garbage bytes, an npz without its stamp, a torn copy, a bare .npy) is treated as
    absent: the re-run scans the shard again instead of failing in np.load."""
    from disco_clip_ds.data.curate.pipeline import scan_shard

    url = embedded_shards(tmp_path / "in", 1, 3)[0]
    sidecar = sidecar_path(tmp_path / "in", url)
    fresh, scan = tmp_path / "fresh.npz", tmp_path / "scan.npz"
    scan_shard((url, sidecar, fresh, False, (False, False), None))
    if damage == "garbage":
        scan.write_bytes(b"\x00garbage\n" * 64)
    elif damage == "no_stamp":
        np.savez(scan, keys=np.zeros(3, np.uint8))
    elif damage == "torn":
        scan.write_bytes(fresh.read_bytes()[: fresh.stat().st_size // 2])
    else:
        np.save(scan.with_suffix(".npy"), np.zeros(3))
        scan.with_suffix(".npy").rename(scan)
    scan_shard((url, sidecar, scan, False, (False, False), None))
    with np.load(scan) as again, np.load(fresh) as expected:
        assert sorted(again.files) == sorted(expected.files)
        assert all(np.array_equal(again[name], expected[name]) for name in expected.files)
