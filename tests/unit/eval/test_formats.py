"""CLIP_benchmark's formats read as they are: the `wds_*` layout (split folders with nshards.txt and 0.tar ..,
classnames and templates beside them, retrieval sets with several captions per image), its class names and templates
by dataset name from an installed clip_benchmark package, and the demo's three suite tasks written in that layout."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.encode import encode_images, encode_texts
from disco_clip_ds.eval.sources import as_batches
from disco_clip_ds.eval.tasks import (
    find_classnames,
    find_templates,
    open_eval_data,
    zeroshot_classification,
    zeroshot_retrieval,
)
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

from unit.eval.sets import CLASSNAMES, TEMPLATES, tiny_clip


def wds_split(folder: Path, samples: list[dict], per_shard: int) -> None:
    """CLIP_benchmark's split folder: 0.tar, 1.tar, ... and nshards.txt."""
    folder.mkdir(parents=True)
    write_samples(folder, samples, per_shard=per_shard)
    tars = sorted(folder.glob("*.tar"))
    for i, tar in enumerate(tars):
        tar.rename(folder / f"{i}.tar")
    (folder / "nshards.txt").write_text(f"{len(tars)}\n")


@pytest.fixture(scope="module")
def wds_cls(tmp_path_factory, cls_set):
    """cls_set's samples (webp this time) in CLIP_benchmark's layout: DIR/test/{0,1,2}.tar, names and templates
    beside test/."""
    _, images, labels = cls_set
    import io

    from PIL import Image

    def webp(data):
        out = io.BytesIO()
        Image.open(io.BytesIO(data)).convert("RGB").save(out, format="WEBP", lossless=True)
        return out.getvalue()

    root = tmp_path_factory.mktemp("wds_cls")
    webps = [webp(image) for image in images]
    wds_split(root / "test", [{"webp": w, "cls": str(y)} for w, y in zip(webps, labels)], per_shard=4)
    (root / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    flat = tmp_path_factory.mktemp("flat_webp")  # the same samples as plain shards: the reference reading
    write_samples(flat, [{"webp": w, "cls": str(y)} for w, y in zip(webps, labels)], per_shard=4)
    return root, flat, labels


@pytest.mark.slow  # beyond the fast tier's time budget
def test_wds_layout_reads_the_test_split_with_names_beside_it(wds_cls):
    root, flat, labels = wds_cls
    shards, names = open_eval_data(str(root), "zeroshot_classification")
    assert [Path(s).name for s in shards] == ["0.tar", "1.tar", "2.tar"] and names == CLASSNAMES
    assert find_templates(str(root), None) == TEMPLATES
    model, tokenizer, processor = tiny_clip()
    got, want = (
        zeroshot_classification(model, tokenizer, str(data), names, TEMPLATES, image_processor=processor)
        for data in (root, flat)
    )
    assert got == want
    read = [y for _, ys in as_batches(shards, processor, "cls", 5) for y in ys]
    assert read == labels  # every sample, in shard order


def test_wds_layout_refuses_a_shard_that_nshards_names_but_is_missing(wds_cls, tmp_path):
    root = tmp_path / "set"
    os.makedirs(root / "test")
    for name in ("0.tar", "1.tar"):
        (root / "test" / name).write_bytes((wds_cls[0] / "test" / name).read_bytes())
    (root / "test" / "nshards.txt").write_text("3\n")
    with pytest.raises(UsageError, match="1 of 3 shards not found"):
        open_eval_data(str(root), "zeroshot_classification", classnames=str(wds_cls[0] / "classnames.txt"))


@pytest.mark.parametrize(
    "count, message",
    [
        (b"0\n", "nshards.txt' says the split has 0 shards"),  # before: '{0..-1}.tar', an empty brace pattern
        (b"two\n", "nshards.txt' must hold the number of shards of the split"),
        (b"\xff2\n", "nshards.txt: line 1 is not UTF-8 text (byte 0xff at column 1)"),
    ],
)
def test_an_unreadable_nshards_is_one_line(tmp_path, count, message):
    os.makedirs(tmp_path / "test")
    (tmp_path / "test" / "nshards.txt").write_bytes(count)
    with pytest.raises(UsageError, match=re.escape(message)):
        open_eval_data(str(tmp_path), "zeroshot_retrieval")


@pytest.mark.slow  # beyond the fast tier's time budget
def test_retrieval_with_several_captions_per_image_equals_a_float64_recount(tmp_path):
    """Each image's .txt holds 2 or 3 captions, one per line (CLIP_benchmark's `str.splitlines`): every caption is a
    query of its own image, and the recalls equal a float64 recount by loops over the same embeddings."""
    rng = np.random.default_rng(1)
    captions = [["a red square", "red box"], ["a blue circle", "blue round", "a disc"], ["green", "a green thing"]]
    captions += [["two cats", "cats, two"], ["a dog", "one dog running", "dog"], ["the sea", "waves at sea"]]  # no ties
    images = [noise_image_bytes(rng, "JPEG") for _ in captions]
    wds_split(tmp_path / "test", [{"jpg": im, "txt": "\n".join(c)} for im, c in zip(images, captions)], per_shard=4)
    (tmp_path / "dataset_type.txt").write_text("retrieval\n")
    model, tokenizer, processor = tiny_clip()
    shards, _ = open_eval_data(str(tmp_path), "zeroshot_retrieval")
    batches = list(as_batches(shards, processor, "txt", 4))
    assert [caps for _, batch in batches for caps in batch] == captions
    metrics = zeroshot_retrieval(model, tokenizer, str(tmp_path), image_processor=processor, progress=False)

    image_emb = torch.cat([encode_images(model, pixels) for pixels, _ in batches]).double()
    texts = [c for caps in captions for c in caps]
    owner = [i for i, caps in enumerate(captions) for _ in caps]
    scores = encode_texts(model, tokenizer, texts).double() @ image_emb.T
    for k in (1, 5):
        by_text = [sum(scores[t, j] > scores[t, owner[t]] for j in range(len(images))) < k for t in range(len(texts))]
        above = [
            [sum(scores[u, i] > scores[t, i] for u in range(len(texts))) for i in range(len(images))]
            for t in range(len(texts))
        ]
        by_image = [any(above[t][i] < k for t in range(len(texts)) if owner[t] == i) for i in range(len(images))]
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(np.mean(by_text))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(np.mean(by_image))


def test_names_without_clip_benchmark_installed_refuse_in_one_line():
    pytest.importorskip("yaml")  # any dependency: the point is that clip_benchmark is absent here
    if any(Path(p, "clip_benchmark").is_dir() for p in sys.path if p):
        pytest.skip("clip_benchmark is installed in this environment")
    for find, flag in ((find_classnames, "--classnames"), (find_templates, "--templates")):
        with pytest.raises(UsageError, match=rf"^{flag} cifar10: .*`pip install clip-benchmark` \(or pass a file"):
            find(".", "cifar10")
    assert len(find_classnames(".", "imagenet1k")) == 1000  # the shipped list needs no package


@pytest.fixture(scope="module")
def clip_benchmark_wheel(tmp_path_factory):
    """clip-benchmark 1.6.2's wheel, unpacked into a folder of its own (never into the shared environment)."""
    folder = tmp_path_factory.mktemp("clip_benchmark_wheel")
    download = [sys.executable, "-m", "pip", "download", "clip-benchmark==1.6.2", "--no-deps", "-q", "-d", str(folder)]
    if subprocess.run(download, capture_output=True, timeout=120).returncode != 0:
        pytest.skip("clip-benchmark 1.6.2's wheel cannot be downloaded here")
    wheel = next(folder.glob("clip_benchmark-*.whl"))
    target = folder / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    return wheel, target


LOOKUP = """
import json, sys
from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.tasks import find_classnames, find_templates
out = {"classnames": find_classnames(".", "mnist"), "templates": find_templates(".", "cifar10")}
try:
    find_classnames(".", "no_such_set")
except UsageError as e:
    out["unknown"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_names_read_from_an_installed_clip_benchmark(clip_benchmark_wheel):
    """With the wheel on the path of a subprocess only, `--classnames mnist` and `--templates cifar10` are its lists,
    as the wheel's own JSON files (read here with zipfile) hold them."""
    wheel, target = clip_benchmark_wheel
    repo = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, str(target)])}
    done = subprocess.run([sys.executable, "-c", LOOKUP], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    with zipfile.ZipFile(wheel) as z:
        names = json.loads(z.read("clip_benchmark/datasets/en_classnames.json"))
        templates = json.loads(z.read("clip_benchmark/datasets/en_zeroshot_classification_templates.json"))
    assert got["classnames"] == names["mnist"] and got["templates"] == templates["cifar10"]
    assert got["unknown"].startswith("--classnames no_such_set: CLIP_benchmark has no classnames for 'no_such_set'")


@pytest.mark.slow  # beyond the fast tier's time budget
def test_demo_suite_tasks_in_clip_benchmark_layout(tmp_path):
    """`write_suite_tasks` (disco-clip data demo): three sets in the wds layout and a task list that loads them."""
    from disco_clip_ds.data.prep.demo import CAPTIONS_PER_IMAGE, DIGITS, digit_images, write_suite_tasks
    from disco_clip_ds.eval.suite import load_tasks

    pngs, labels = digit_images(16)
    pngs, labels = pngs[:30], labels[:30]
    train, test = np.arange(0, 20), np.arange(20, 30)
    write_suite_tasks(tmp_path, pngs, labels, train, test, image_size=16, per_shard=8, seed=0)
    tasks = {task.key: task for task in load_tasks(tmp_path / "tasks.yml")}
    assert {k: t.type for k, t in tasks.items()} == {
        "digits_zeroshot": "zeroshot_classification",
        "digits_retrieval": "zeroshot_retrieval",
        "digits_probe": "linear_probe",
    }
    assert (tmp_path / "digits_retrieval" / "dataset_type.txt").read_text() == "retrieval\n"
    assert (tmp_path / "digits_probe" / "train" / "nshards.txt").read_text() == "3\n"
    _, processor = None, tiny_clip()[2]
    shards, names = open_eval_data(tasks["digits_zeroshot"].source, "zeroshot_classification")
    assert names == DIGITS and [y for _, ys in as_batches(shards, processor, "cls", 4) for y in ys] == list(labels[20:])
    train_shards, _ = open_eval_data(tasks["digits_probe"].source, "linear_probe", split="train")
    assert [y for _, ys in as_batches(train_shards, processor, "cls", 8) for y in ys] == list(labels[:20])
    shards, _ = open_eval_data(tasks["digits_retrieval"].source, "zeroshot_retrieval")
    captions = [caps for _, batch in as_batches(shards, processor, "txt", 4) for caps in batch]
    assert all(len(set(caps)) == CAPTIONS_PER_IMAGE for caps in captions)
    words = [DIGITS[y] for y in labels[20:]]
    assert all(any(w in c or str(d) in c for c in caps) for caps, w, d in zip(captions, words, labels[20:]))
    assert list(itertools.chain(*captions))  # retrieval reads every caption
