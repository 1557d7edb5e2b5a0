"""The digits demo dataset: layout contract, content checked against sklearn's digits, determinism."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def samples_of(folder: Path) -> list[dict[str, bytes]]:
    """Every sample in folder's NNNNN.tar files, read with tarfile, in shard then member order."""
    out = []
    for path in sorted(folder.glob("[0-9][0-9][0-9][0-9][0-9].tar")):
        by_key: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as tar:
            for m in tar:
                key, _, ext = m.name.rpartition(".")
                by_key.setdefault(key, {"__key__": key})[ext] = tar.extractfile(m).read()
        out += by_key.values()
    return out


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    return load_digits()


@pytest.mark.slow
def test_layout_contract(demo_data):
    train, evl = demo_data / "train", demo_data / "eval"
    assert sorted(p.name for p in train.glob("*.tar")) == [f"{i:05d}.tar" for i in range(8)]
    train_sizes = json.loads((train / "sizes.json").read_text())
    summary = json.loads((train / "summary.json").read_text())
    assert sum(train_sizes.values()) == summary["successes"] == summary["count"] == 1437
    assert summary["shards_failed"] == [] and summary["failed_to_download"] == summary["failed_to_resize"] == 0
    eval_sizes = json.loads((evl / "sizes.json").read_text())
    assert sorted(eval_sizes) == sorted(p.name for p in evl.glob("*.tar")) == ["00000.tar", "00001.tar"]
    assert sum(eval_sizes.values()) == 1797 - 1437
    assert (evl / "classnames.txt").read_text().split("\n")[:10] == WORDS
    templates = (evl / "zeroshot_classification_templates.txt").read_text().strip().split("\n")
    assert len(templates) >= 3 and all("{c}" in t for t in templates)
    for folder, sizes in ((train, train_sizes), (evl, eval_sizes)):
        samples = samples_of(folder)
        assert len(samples) == sum(sizes.values())
        want = {"__key__", "jpg", "txt", "json"} | ({"cls"} if folder == evl else set())
        assert all(set(s) == want for s in samples)


def _check_against_sklearn(sample: dict, digits) -> tuple[int, int]:
    meta = json.loads(sample["json"])
    index, label = meta["source_index"], meta["label"]
    assert label == digits.target[index]
    caption = sample["txt"].decode()
    assert re.search(rf"\b({WORDS[label]}|{label})\b", caption), caption
    # the image is the sklearn digit, upscaled as the demo documents (bilinear to 64 px), through JPEG
    with Image.open(io.BytesIO(sample["jpg"])) as img:
        assert img.size == (64, 64) and img.mode == "RGB"
        got = np.asarray(img.convert("L"), dtype=float)
    grey = np.rint(digits.images[index] * (255 / 16)).astype(np.uint8)
    want = np.asarray(Image.fromarray(grey).resize((64, 64), Image.Resampling.BILINEAR), dtype=float)
    assert np.abs(got - want).mean() < 2, index  # JPEG noise ~0.3; a different digit is ~10 or more
    return index, label


@pytest.mark.slow
def test_images_captions_and_labels_match_sklearn(demo_data, digits):
    train = [_check_against_sklearn(s, digits) for s in samples_of(demo_data / "train")]
    evl = samples_of(demo_data / "eval")
    held = [_check_against_sklearn(s, digits) for s in evl]
    assert all(int(s["cls"]) == json.loads(s["json"])["label"] for s in evl)
    train_idx, held_idx = {i for i, _ in train}, {i for i, _ in held}
    assert not train_idx & held_idx and len(train_idx | held_idx) == 1797
    # stratified hold-out: every class is ~20 % held out
    counts = np.bincount([y for _, y in held], minlength=10)
    assert all(abs(c - 0.2 * n) <= 1 for c, n in zip(counts, np.bincount(digits.target)))
    assert len({s["txt"].decode().replace(w, "") for s in evl for w in WORDS}) > 10  # several templates


@pytest.mark.slow
def test_demo_reads_back_with_hf_datasets_and_webdataset(demo_data):
    import webdataset as wds
    from datasets import load_dataset

    tars = [str(p) for p in sorted((demo_data / "train").glob("*.tar"))]
    hf = load_dataset("webdataset", data_files={"train": tars}, split="train", streaming=True)
    n = 0
    for row in hf:
        assert row["jpg"].size == (64, 64) and row["txt"]
        n += 1
    assert n == 1437
    evl = [str(p) for p in sorted((demo_data / "eval").glob("*.tar"))]
    labels = [s["cls"] for s in wds.WebDataset(evl, shardshuffle=False).decode("pil")]
    assert len(labels) == 360 and set(labels) == set(range(10))


@pytest.mark.slow
def test_module_entry_point_rebuilds_the_same_bytes(demo_data, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "disco_clip_ds.data.demo", "--output", str(tmp_path / "again")],
        env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    contract = [
        p.relative_to(demo_data)
        for p in sorted(demo_data.rglob("*"))
        if p.parent.name in ("train", "eval")
        and (p.suffix == ".tar" or p.suffix in (".json", ".txt"))
        and not p.name.endswith("_stats.json")
    ]
    assert len(contract) == 15  # 8 + 2 tars, 2 sizes.json, summary.json, classnames, templates
    for rel in contract:
        assert (tmp_path / "again" / rel).read_bytes() == (demo_data / rel).read_bytes(), rel


def test_output_that_is_a_file_or_a_foreign_folder_is_refused_before_any_work(tmp_path, capsys):
    from disco_clip_ds import cli

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    foreign = tmp_path / "photos"
    (foreign / "holiday").mkdir(parents=True)
    for output, message in ((a_file, "is a file"), (foreign, "holds holiday, which is not a demo build")):
        assert cli.main(["data", "demo", "--output", str(output)]) == 2
        assert message in capsys.readouterr().err
    assert a_file.read_text() == "mine" and [p.name for p in foreign.iterdir()] == ["holiday"]
