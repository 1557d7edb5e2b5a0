"""`disco-clip data filter` with DataComp's rules, end to end on a planted pool: the basic filter's kept samples and
first rules against a hand-computed list, the kept uids written as DataComp writes them, `--keep_uids` keeping
exactly a numpy-built list, the round trip, and the refusals in one line."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest

from disco_clip_ds.commands.data import filter_main
from disco_clip_ds.errors import EXIT_FAILED, EXIT_USAGE, run_main
from disco_clip_ds.testing.images import image_bytes

from unit.data.curate.shardsets import embedded_shards
from unit.data.curate.test_uids import datacomp_file

IMAGE = image_bytes(size=(64, 48))
# (caption, json sizes, image): what each planted sample is, and the first rule that drops it
PLANTED = [
    ("a photo of a dog on a sofa", {"original_width": 400, "original_height": 300}, None),
    ("ein Hund auf dem roten Sofa", {"original_width": 400, "original_height": 300}, "caption_language"),
    ("a dog", {"original_width": 400, "original_height": 300}, "caption_words"),  # 2 words, 5 characters
    (
        "a small picture of a cat",
        {"width": 64, "height": 48, "original_width": 150, "original_height": 400},
        "image_side",
    ),
    ("a long panorama of the sea", {"original_width": 700, "original_height": 200}, "aspect_ratio"),  # 3.5 : 1
    ("a photo of a red bicycle", {"width": 300, "height": 300}, None),  # no original_*: width and height
    ("a photo of a green tree", {}, "image_side"),  # no size in the json: the 64 x 48 header
    ("a photo of a blue house", {"original_width": 600, "original_height": 200}, None),  # 3 : 1 exactly
]
HEXES = [f"{i:016x}{2**64 - 1 - i:016x}" for i in range(len(PLANTED))]
KEYS = [f"s{i:05d}" for i in range(len(PLANTED))]


def _filter(*argv) -> int:
    return run_main(filter_main, [str(a) for a in argv], "disco-clip data filter")


def _kept(folder) -> list[str]:
    keys = []
    for tar in sorted(folder.glob("*.tar")):
        with tarfile.open(tar) as t:
            keys += list(dict.fromkeys(m.name.split(".")[0] for m in t.getmembers()))
    return keys


@pytest.fixture
def pool(tmp_path):
    samples = [
        {"jpg": IMAGE, "txt": caption, "json": json.dumps({"uid": uid, **sizes})}
        for (caption, sizes, _), uid in zip(PLANTED, HEXES)
    ]
    embedded_shards(tmp_path / "in", 2, 4, samples=samples)
    return tmp_path / "in"


def test_the_basic_filter_keeps_the_hand_computed_samples_and_writes_their_uids(pool, tmp_path, capsys):
    out = tmp_path / "out"
    assert _filter("--shards", pool, "--output", out, "--basic_filter") == 0
    assert _kept(out) == [KEYS[0], KEYS[5], KEYS[7]]
    table = pq.read_table(out / "filter.parquet").to_pydict()
    assert table["dropped_by"] == [rule for _, _, rule in PLANTED]
    alone = {"caption_language": 7, "caption_words": 7, "caption_chars": 7, "image_side": 6, "aspect_ratio": 7}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kept_by_rule"] == {"no_embedding": 8, **alone} and summary["kept"] == 3
    assert "each rule alone keeps 8 by no_embedding, 7 by caption_language" in capsys.readouterr().out
    datacomp_file(tmp_path / "theirs.npy", [HEXES[i] for i in (0, 5, 7)])
    assert (out / "kept_uids.npy").read_bytes() == (tmp_path / "theirs.npy").read_bytes()


def test_each_part_alone_and_its_threshold(pool, tmp_path):
    assert _filter("--shards", pool, "--output", tmp_path / "a", "--max_aspect_ratio", 3.6) == 0
    assert _kept(tmp_path / "a") == KEYS  # 3.5 : 1 is within 3.6
    out = tmp_path / "b"
    assert _filter("--shards", pool, "--output", out, "--min_image_side", 100, "--caption_chars_over", 5) == 0
    # sample 3 is 150 x 400 before resizing (kept), 64 x 48 as saved; sample 6's header says 64 x 48
    assert _kept(out) == [KEYS[i] for i in (0, 1, 3, 4, 5, 7)]
    table = pq.read_table(out / "filter.parquet").to_pydict()
    assert table["dropped_by"] == [None, None, "caption_chars", None, None, None, "image_side", None]


def test_keep_uids_keeps_exactly_a_numpy_built_list_and_round_trips(pool, tmp_path):
    datacomp_file(tmp_path / "subset.npy", [HEXES[1], HEXES[4], HEXES[6], "ab" * 16])  # the last is in no shard
    assert _filter("--shards", pool, "--output", tmp_path / "listed", "--keep_uids", tmp_path / "subset.npy") == 0
    assert _kept(tmp_path / "listed") == [KEYS[1], KEYS[4], KEYS[6]]
    assert _filter("--shards", pool, "--output", tmp_path / "basic", "--basic_filter") == 0
    ours = tmp_path / "basic" / "kept_uids.npy"
    assert _filter("--shards", pool, "--output", tmp_path / "again", "--keep_uids", ours) == 0
    for name in ("00000.tar", "kept_uids.npy"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "basic" / name).read_bytes()


def test_shards_without_uids_are_named_and_write_no_uid_file(tmp_path, capsys):
    embedded_shards(tmp_path / "in", 2, 3)  # img2dataset-layout shards whose .json has no uid
    datacomp_file(tmp_path / "subset.npy", HEXES[:1])
    assert _filter(
        "--shards", tmp_path / "in", "--output", tmp_path / "out", "--keep_uids", tmp_path / "subset.npy"
    ) == (EXIT_FAILED)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"shard {tmp_path / 'in' / '00000.tar'} has 3 of 3 samples without a uid" in said[0]
    assert not list((tmp_path / "out").glob("*.tar"))
    assert _filter("--shards", tmp_path / "in", "--output", tmp_path / "plain", "--max_aspect_ratio", 3) == 0
    assert not (tmp_path / "plain" / "kept_uids.npy").exists()


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--keep_uids", "{tmp}/ints.npy"], "holds an array of dtype int64 and shape (3,), not DataComp's uid list"),
        (["--caption_language", "xx"], "--caption_language xx: not a language the language-ID model"),
        (["--basic_filter", "--max_aspect_ratio", "0"], "--max_aspect_ratio 0.0: give a ratio of 1 or more"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(pool, tmp_path, capsys, argv, said):
    np.save(tmp_path / "ints.npy", np.arange(3))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _filter("--shards", pool, "--output", tmp_path / "out", *argv) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_resume_scans_again_a_shard_whose_saved_scan_lacks_the_facts(pool, tmp_path):
    out = tmp_path / "out"
    assert _filter("--shards", pool, "--output", out, "--basic_filter") == 0
    first = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for scan in (out / ".filter" / "scan").glob("*.npz"):  # as a scan made before the basic rules were read
        with np.load(scan) as saved:
            kept = {k: saved[k] for k in saved.files if k not in ("has_uid", "uid", "words", "width")}
        np.savez(scan, **kept)
    (out / "summary.json").unlink()
    assert _filter("--shards", pool, "--output", out, "--basic_filter") == 0
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == first
