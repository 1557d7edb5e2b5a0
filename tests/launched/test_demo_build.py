"""Launched: the digits demo dataset built (img2dataset from a loopback server, and --format hf): layout contract,
content checked against sklearn's digits, determinism, eval of both formats alike, the quickstart's DATA_FORMAT knob."""

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
                key, _, ext = m.name.partition(".")  # webdataset's rule: KEY.syn0.txt is KEY's "syn0.txt"
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
        want = {"__key__", "jpg", "txt", "json"} | ({"cls"} if folder == evl else {"syn0.txt", "syn1.txt"})
        assert all(set(s) == want for s in samples)


def _check_against_sklearn(sample: dict, digits) -> tuple[int, int]:
    meta = json.loads(sample["json"])
    index, label = meta["source_index"], meta["label"]
    assert label == digits.target[index]
    caption = sample["txt"].decode()
    assert re.search(rf"\b({WORDS[label]}|{label})\b", caption), caption
    for syn in ("syn0.txt", "syn1.txt"):  # the training split's synthetic captions name the digit, and only it
        if syn in sample:
            named = {d for d in range(10) if re.search(rf"\b({WORDS[d]}|{d})\b", sample[syn].decode())}
            assert named == {label}, sample[syn]
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
        [sys.executable, "-m", "disco_clip_ds.commands.data", "demo", "--output", str(tmp_path / "again")],
        env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    contract = [
        p.relative_to(demo_data)
        for p in sorted(demo_data.rglob("*"))
        if p.parent in (demo_data / "train", demo_data / "eval")
        and (p.suffix == ".tar" or p.suffix in (".json", ".txt"))
        and not p.name.endswith("_stats.json")
    ]
    assert len(contract) == 15  # 8 + 2 tars, 2 sizes.json, summary.json, classnames, templates
    suite = [p.relative_to(demo_data) for p in sorted((demo_data / "suite").rglob("*")) if p.is_file()]
    assert len(suite) == 24  # the suite: 2 + 2 + 8 + 2 tars, 4 nshards.txt, 2 x 2 names and templates, type, tasks.yml
    for rel in contract + suite:
        assert (tmp_path / "again" / rel).read_bytes() == (demo_data / rel).read_bytes(), rel


@pytest.fixture(scope="module")
def hf_demo(tmp_path_factory):
    """`disco-clip data demo --format hf`, built once for this module (no download: a few seconds)."""
    from disco_clip_ds import cli

    folder = tmp_path_factory.mktemp("demo_hf")
    assert cli.main(["data", "demo", "--format", "hf", "--output", str(folder)]) == 0
    return folder


def _rows(data_file: Path) -> list[dict]:
    """The rows of one parquet file as datasets reads them, images left as their stored bytes."""
    from datasets import Image as ImageFeature
    from datasets import load_dataset

    dataset = load_dataset("parquet", data_files=str(data_file), split="train")
    return list(dataset.cast_column("image", ImageFeature(decode=False)))


@pytest.mark.slow  # the build encodes 1,797 JPEGs: seconds
def test_hf_demo_loads_with_datasets_and_holds_the_digits(hf_demo, digits):
    """Both ways of loading work, with an Image and a ClassLabel column; every digit is in one split, with its
    label, a caption naming it and its image; the eval split is the stratified 20 %."""
    from datasets import ClassLabel, load_dataset
    from datasets import Image as ImageFeature

    train = load_dataset(str(hf_demo / "train"), split="train")
    evl = load_dataset("parquet", data_dir=str(hf_demo / "eval"), split="test")
    for dataset in (train, evl):
        assert dataset.column_names == ["image", "caption", "label", "source_index"]
        assert isinstance(dataset.features["image"], ImageFeature)
        assert dataset.features["label"] == ClassLabel(names=WORDS)
    assert len(list((hf_demo / "train").glob("train-*-of-00008.parquet"))) == 8 and train.num_rows == 1437
    assert len(list((hf_demo / "eval").glob("test-*-of-00002.parquet"))) == 2 and evl.num_rows == 360
    for dataset in (train, evl):
        rows = list(dataset.cast_column("image", ImageFeature(decode=False)))
        for row in rows:
            sample = {
                "json": json.dumps({"source_index": row["source_index"], "label": row["label"]}),
                "txt": row["caption"].encode(),
                "jpg": row["image"]["bytes"],
            }
            _check_against_sklearn(sample, digits)
    held = set(evl["source_index"])
    assert not held & set(train["source_index"]) and len(held | set(train["source_index"])) == 1797
    counts = np.bincount(evl["label"], minlength=10)
    assert all(abs(c - 0.2 * n) <= 1 for c, n in zip(counts, np.bincount(digits.target)))
    assert (hf_demo / "eval" / "zeroshot_classification_templates.txt").is_file()


@pytest.mark.slow
def test_hf_demo_holds_the_shards_demo_samples(demo_data, hf_demo):
    """Row for row the shards demo's samples: the same JPEG bytes, caption and label, file K holding the samples of
    shard K; the eval templates file is the same file."""
    for folder, split, count in (("train", "train", 8), ("eval", "test", 2)):
        for shard in range(count):
            tar = demo_data / folder / f"{shard:05d}.tar"
            shards = {}
            with tarfile.open(tar) as archive:
                for member in archive:
                    key, _, ext = member.name.partition(".")
                    shards.setdefault(key, {})[ext] = archive.extractfile(member).read()
            by_index = {json.loads(s["json"])["source_index"]: s for s in shards.values()}
            data_file = hf_demo / folder / f"{split}-{shard:05d}-of-{count:05d}.parquet"
            rows = _rows(data_file)
            assert sorted(by_index) == [row["source_index"] for row in rows], (folder, shard)
            for row in rows:
                sample = by_index[row["source_index"]]
                assert row["image"]["bytes"] == sample["jpg"]
                assert row["caption"] == sample["txt"].decode()
                assert row["label"] == json.loads(sample["json"])["label"]
    templates = "zeroshot_classification_templates.txt"
    assert (hf_demo / "eval" / templates).read_bytes() == (demo_data / "eval" / templates).read_bytes()


@pytest.mark.slow
def test_eval_of_the_hf_demo_equals_the_shards_demo(demo_data, hf_demo, tmp_path):
    """`disco-clip eval`'s run of the quickstart's tiny CLIP on the two eval folders, columns and split detected: the
    same zero-shot and retrieval metrics."""
    from transformers import AutoTokenizer, CLIPImageProcessor

    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.testing.launch import REPO, TINY_CONFIG

    model = tmp_path / "model"
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(model)
    AutoTokenizer.from_pretrained(REPO / "recipes" / "tokenizer").save_pretrained(model)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(model)
    for task in ("zeroshot_classification", "zeroshot_retrieval"):
        metrics = [
            run_eval(EvalArguments(model=str(model), data=str(data), task=task))["metrics"]
            for data in (demo_data / "eval", hf_demo / "eval")
        ]
        assert metrics[0] == metrics[1] and any(0 < value < 1 for value in metrics[0].values()), task


LAUNCHER_STANDIN = """
import json, sys
from pathlib import Path
from transformers import AutoTokenizer, CLIPImageProcessor
from disco_clip_ds.models.build import build_model

argv = sys.argv[1:]
flag = {name: value for name, value in zip(argv, argv[1:]) if name.startswith("--")}
out = Path(flag["--output_dir"])
out.mkdir(parents=True, exist_ok=True)
Path(sys.argv[0]).with_name("train_argv.json").write_text(json.dumps(argv))
model = build_model(model_config=flag["--model_config"])
model.save_pretrained(out)
AutoTokenizer.from_pretrained(flag["--tokenizer_name"]).save_pretrained(out)
size = model.config.vision_config.image_size
CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)
"""


@pytest.mark.slow
def test_quickstart_data_format_hf_builds_the_parquet_demo_and_trains_from_it(tmp_path):
    """recipes/quickstart.sh with DATA_FORMAT=hf, its launcher a stand-in: it builds the parquet demo (with
    CAPTION_NOISE, its training captions partly another digit's), hands training run_clip's flags for it (and no
    --train_shards), evaluates the parquet eval set and exports. Training itself from a datasets source is tested
    where that source is built; the shards default runs unchanged."""
    from disco_clip_ds.testing.launch import REPO

    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "standin.py").write_text(LAUNCHER_STANDIN)
    for name, run in (
        ("python", ""),
        ("disco-clip", "-m disco_clip_ds.cli"),
        ("deepspeed", f"{venv / 'standin.py'}"),
    ):
        (venv / name).write_text(f'#!/bin/sh\nexec {sys.executable} {run} "$@"\n')
        (venv / name).chmod(0o755)
    data, out = tmp_path / "demo_hf", tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VENV": str(venv.parent),
        "DATA_FORMAT": "hf",
        "DATA": str(data),
        "OUT": str(out),
        "STEPS": "3",
        "SEED": "5",
        "CAPTION_NOISE": "0.3",
    }
    result = subprocess.run(
        ["bash", str(REPO / "recipes" / "quickstart.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    argv = json.loads((venv / "train_argv.json").read_text())
    i = argv.index("--dataset_name")
    source = ["--dataset_name", f"{data}/train", "--train_split", "train"]
    assert argv[i : i + 8] == [*source, "--image_column", "image", "--caption_column", "caption"]
    assert "--train_shards" not in argv and (data / "train" / "train-00000-of-00008.parquet").is_file()
    assert argv[argv.index("--zeroshot_data") + 1] == f"{data}/eval"
    assert argv[argv.index("--seed") + 1] == "5"  # SEED: the run's seed (data order, augmentation, init)
    for task in ("zeroshot_classification", "zeroshot_retrieval"):
        record = json.loads((out / "eval" / f"{task}.json").read_text())
        assert record["dataset"] == f"{data}/eval" and record["metrics"], task
    assert (out / "export" / "README.md").is_file()
    rows = _rows(data / "train" / "train-00000-of-00008.parquet")
    assert any(not re.search(rf"\b({WORDS[r['label']]}|{r['label']})\b", r["caption"]) for r in rows)


@pytest.mark.slow
def test_caption_noise_recaptions_that_fraction_of_the_training_split_only(hf_demo, tmp_path):
    """`--caption_noise 0.3`: the same images, labels and eval split as the clean build, and 30 % of the training
    rows (rounded) captioned as another digit, one named by no other (a caption names one digit); the rest and every
    eval row as the clean build has them."""
    from disco_clip_ds import cli

    noisy = tmp_path / "noisy"
    assert cli.main(["data", "demo", "--format", "hf", "--caption_noise", "0.3", "--output", str(noisy)]) == 0

    def named(caption: str) -> set[int]:
        return {d for d in range(10) if re.search(rf"\b({WORDS[d]}|{d})\b", caption)}

    mislabelled = 0
    for folder, split, count in (("train", "train", 8), ("eval", "test", 2)):
        for shard in range(count):
            name = f"{split}-{shard:05d}-of-{count:05d}.parquet"
            for clean, row in zip(_rows(hf_demo / folder / name), _rows(noisy / folder / name), strict=True):
                assert {k: v for k, v in row.items() if k != "caption"} == {
                    k: v for k, v in clean.items() if k != "caption"
                }
                if row["caption"] != clean["caption"]:
                    assert folder == "train" and len(named(row["caption"])) == 1
                    assert named(row["caption"]) != {row["label"]}, row
                    mislabelled += 1
    assert mislabelled == round(0.3 * 1437)
