"""eval/sources.py: shards checked before the model loads, and 🤗 datasets sources (parquet, save_to_disk, imagefolder,
bytes columns) that give the shards' metrics; each wrong dataset or option is one line."""

from __future__ import annotations

import numpy as np
import pytest

from disco_clip_ds.testing.images import noise_image_bytes, write_samples

from unit.eval.sets import CLASSNAMES, cls_dataset, eval_main, record, rows_dataset, string_feature


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_shard_is_named_before_the_model_loads(cls_set, model_dir, tmp_path, capsys, damage):
    import shutil

    folder = tmp_path / "cls"
    shutil.copytree(cls_set[0], folder)
    shard = folder / "00001.tar"
    data = shard.read_bytes()
    # 612 bytes: the first member's header and the start of its image, cut inside the image
    shard.write_bytes(data[:612] if damage == "truncate" else b"not a tar at all" * 64)
    assert eval_main(["--model", str(model_dir), "--data", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "shard 'cls/00001.tar' is truncated or not a tar" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow  # beyond the fast tier's time budget
def test_shards_without_labels_point_to_retrieval(model_dir, tmp_path, capsys):
    rng = np.random.default_rng(1)
    write_samples(
        tmp_path, [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": f"caption {i}"} for i in range(3)], per_shard=3
    )
    assert eval_main(["--model", str(model_dir), "--data", str(tmp_path), "--classnames", "imagenet1k"]) == 2
    err = capsys.readouterr().err
    assert "no .cls members" in err and "use --task zeroshot_retrieval" in err
    assert eval_main(["--model", str(model_dir), "--data", str(tmp_path), "--task", "zeroshot_retrieval"]) == 0


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("form", ["disk", "parquet", "file"])
def test_datasets_classification_equals_shards(cls_set, hf_cls, model_dir, form, capsys):
    """The same 11 images and labels as shards and as a datasets dataset: the same metrics, to the last bit.
    Class names come from the ClassLabel (the shards have them in classnames.txt), templates from the file."""
    shards = record(["--model", str(model_dir), "--data", str(cls_set[0]), "--batch_size", "4"], capsys)
    hf = record(["--model", str(model_dir), "--data", str(hf_cls[form]), "--batch_size", "4"], capsys)
    assert hf["metrics"] == shards["metrics"] and 0 < shards["metrics"]["acc5"] < 1
    named = ["--image_column", "image", "--label_column", "label", "--split", "test" if form == "parquet" else "train"]
    again = record(["--model", str(model_dir), "--data", str(hf_cls[form]), "--batch_size", "4", *named], capsys)
    assert again["metrics"] == shards["metrics"]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_imagefolder_classification_equals_shards(cls_set, model_dir, tmp_path, capsys):
    """An `imagefolder` (one subfolder per class, labels a ClassLabel of the folder names): with the class names
    given (they win over the folder names), the shards' metrics."""
    folder, images, labels = cls_set
    for i, (data, label) in enumerate(zip(images, labels)):
        (tmp_path / "set" / f"class{label}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "set" / f"class{label}" / f"{i:02d}.{'png' if i % 2 else 'jpg'}").write_bytes(data)
    args = ["--model", str(model_dir), "--classnames", str(folder / "classnames.txt")]
    args += ["--templates", str(folder / "zeroshot_classification_templates.txt")]
    shards = record([*args, "--data", str(folder)], capsys)["metrics"]
    assert record([*args, "--data", str(tmp_path / "set")], capsys)["metrics"] == pytest.approx(shards, abs=1e-12)


@pytest.fixture(scope="module")
def retrieval_sets(tmp_path_factory):
    """Six images with 1 to 3 captions each, as shards (captions one per line) and as a parquet dataset whose
    image column is plain bytes (cast to images) and caption column a list of strings; plus the first captions
    alone, both ways, the dataset's column a string."""
    from datasets import List, Value

    rng = np.random.default_rng(3)
    captions = [["a red square", "red"], ["two cats"], ["the sea", "blue water", "waves"], ["night"], ["a dog"], ["x"]]
    images = [noise_image_bytes(rng) for _ in captions]
    root = tmp_path_factory.mktemp("retrieval")
    sets = {}
    for name, caps in (("lists", captions), ("strings", [c[0] for c in captions])):
        shards, hf = root / name / "shards", root / name / "hf"
        texts = ["\n".join(c) if isinstance(c, list) else c for c in caps]
        write_samples(shards, [{"png": img, "txt": t} for img, t in zip(images, texts)], per_shard=4)
        feature = List(Value("string")) if name == "lists" else string_feature()
        dataset = rows_dataset({"jpg": images, "captions": caps}, {"jpg": Value("binary"), "captions": feature})
        hf.mkdir(parents=True)
        dataset.to_parquet(str(hf / "test-00000-of-00001.parquet"))
        sets[name] = shards, hf
    return sets


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("kind", ["lists", "strings"])
def test_datasets_retrieval_equals_shards(retrieval_sets, model_dir, kind, capsys):
    shards, hf = retrieval_sets[kind]
    task = ["--task", "zeroshot_retrieval", "--batch_size", "4"]
    from_shards = record(["--model", str(model_dir), "--data", str(shards), *task], capsys)
    named = ["--image_column", "jpg", "--caption_column", "captions"]  # bytes: no Image column to detect
    from_hf = record(["--model", str(model_dir), "--data", str(hf), *task, *named], capsys)
    assert from_hf["metrics"] == from_shards["metrics"]
    assert any(0 < value < 1 for value in from_shards["metrics"].values())  # neither all right nor all wrong


@pytest.fixture(scope="module")
def bad_hf(cls_set, tmp_path_factory):
    """Datasets that are wrong in one way each (parquet folders, split "test" unless named)."""
    from datasets import ClassLabel, DatasetDict, Value

    _, images, labels = cls_set
    root = tmp_path_factory.mktemp("bad_hf")
    good = cls_dataset(images, labels)

    def parquet(name, dataset):
        (root / name).mkdir()
        dataset.to_parquet(str(root / name / "test-00000-of-00001.parquet"))

    parquet("int_labels", cls_dataset(images, labels, Value("int64")))
    parquet("str_labels", cls_dataset(images, [CLASSNAMES[y] for y in labels], string_feature()))
    ints = {"image": Value("int64"), "label": ClassLabel(names=CLASSNAMES)}
    parquet("int_images", rows_dataset({"image": list(range(len(labels))), "label": labels}, ints))
    parquet("numbers", good.map(lambda r, i: {"note": i}, with_indices=True).cast_column("note", Value("int64")))
    DatasetDict({"train": good, "validation": good}).save_to_disk(str(root / "two_splits"))
    (root / "two_configs" / "a").mkdir(parents=True)
    (root / "two_configs" / "b").mkdir()
    good.to_parquet(str(root / "two_configs" / "a" / "test-00000-of-00001.parquet"))
    good.select(range(5)).to_parquet(str(root / "two_configs" / "b" / "test-00000-of-00001.parquet"))
    (root / "two_configs" / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {name}\n  data_files:\n  - split: test\n    path: {name}/*.parquet\n" for name in "ab"
        )
        + "---\n"
    )
    return root


@pytest.mark.parametrize(
    "data, extra, message",
    [
        ("parquet", ["--image_column", "img"], "--image_column img: no such column in 'DATA' (its columns: image, "),
        ("parquet", ["--label_column", "lbl"], "--label_column lbl: no such column in 'DATA' (its columns: image, "),
        ("parquet", ["--split", "validation"], "--split validation: 'DATA' has no such split (its splits: test)"),
        ("two_splits", [], "'DATA' has splits train, validation: pass --split NAME"),
        ("int_labels", [], "'DATA' has no ClassLabel column: pass --label_column NAME (its columns: image, label, "),
        ("int_labels", ["--label_column", "label"], "--label_column label is Value('int64'), not a ClassLabel"),
        ("str_labels", ["--label_column", "label"], "it must hold class indices (a ClassLabel)"),
        ("int_images", [], "'DATA' has no Image column: pass --image_column NAME"),
        ("int_images", ["--image_column", "image"], "neither images nor image bytes or paths"),
        ("numbers", ["--task", "zeroshot_retrieval", "--caption_column", "note"], "a string or a list of strings"),
        ("numbers", ["--task", "zeroshot_retrieval"], "'DATA' has no caption (string or list of strings) column: "),
        ("str_labels", ["--task", "zeroshot_retrieval"], "has several caption (string or list of strings) columns ("),
        ("two_configs", [], "Config name is missing"),
        ("nobody/no-such-set", [], "no such local folder or file, and as a hub dataset: "),
        ("shards", ["--split", "test", "--image_column", "jpg"], "--split, --image_column: for a datasets dataset"),
    ],
)
@pytest.mark.slow  # beyond the fast tier's time budget
def test_datasets_bad_input_is_one_line(cls_set, hf_cls, bad_hf, model_dir, capsys, data, extra, message):
    """Each wrong dataset or option: exit 2 and one line naming it (the columns or splits that are there)."""
    where = {"parquet": hf_cls["parquet"], "shards": cls_set[0]}.get(data, bad_hf / data)
    data = str(where) if where.exists() else data
    assert eval_main(["--model", str(model_dir), "--data", data, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message.replace("DATA", data) in err and "\n" not in err, err


@pytest.mark.slow  # beyond the fast tier's time budget
def test_datasets_int_labels_with_classnames_and_a_config(cls_set, bad_hf, model_dir, tmp_path, capsys):
    """Plain integer labels read with --classnames; of a dataset with two configs, --dataset_config_name picks
    one: both give the shards' metrics (config b holds only the first 5 rows: other metrics)."""
    shards = record(["--model", str(model_dir), "--data", str(cls_set[0])], capsys)["metrics"]
    names = tmp_path / "names.txt"
    names.write_text("\n".join(CLASSNAMES) + "\n")
    templates = ["--templates", str(cls_set[0] / "zeroshot_classification_templates.txt")]
    ints = ["--label_column", "label", "--classnames", str(names), *templates]
    assert record(["--model", str(model_dir), "--data", str(bad_hf / "int_labels"), *ints], capsys)["metrics"] == shards
    configs = ["--model", str(model_dir), "--data", str(bad_hf / "two_configs"), *templates]
    assert record([*configs, "--dataset_config_name", "a"], capsys)["metrics"] == shards
    assert record([*configs, "--dataset_config_name", "b"], capsys)["metrics"] != shards


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cls", b"three", "sample s00001 of shard '{name}/00000.tar': its .cls is not a class index (b'three')"),
        (
            "txt",
            b"ok\ncaf\xe9",
            "sample s00001 of shard '{name}/00000.tar', its .txt: line 2 is not UTF-8 text (byte 0xe9",
        ),
    ],
)
def test_a_label_or_caption_that_cannot_be_read_is_a_data_error_naming_the_sample(tmp_path, field, value, message):
    """Before: a ValueError or UnicodeDecodeError traceback from the batch reader, which ended a whole suite."""
    from disco_clip_ds.errors import DataError
    from disco_clip_ds.eval.sources import raw_shard_batches

    good = b"0" if field == "cls" else b"a caption"
    samples = [{"jpg": b"not read here", field: data} for data in (good, value)]
    write_samples(tmp_path, samples, per_shard=2)
    with pytest.raises(DataError) as caught:
        list(raw_shard_batches(str(tmp_path), field, batch_size=4))
    assert str(caught.value).startswith(message.format(name=tmp_path.name)) and "\n" not in str(caught.value)


@pytest.mark.slow  # three `disco-clip eval` runs, each loading the model; the fast test below calls the task
def test_a_hostile_image_is_skipped_and_counted_not_fatal(cls_set, model_dir, tmp_path, capsys, caplog):
    """`disco-clip eval --data` on a set holding a truncated JPEG and a decompression bomb died with a traceback,
    from shards and from a datasets source alike: both are skipped, each with its reason in the log, and counted in
    the record; the metrics are those of the set without them."""
    from disco_clip_ds.testing.images import hostile_images

    folder, images, labels = cls_set
    hostile = hostile_images()
    bad = [hostile["truncated jpeg"], hostile["png bomb header"]]
    shards = tmp_path / "with_bad"
    samples = [{"jpg": data, "cls": str(y)} for data, y in zip(images + bad, labels + [0, 1])]
    write_samples(shards, samples, per_shard=4)
    cls_dataset(images + bad, labels + [0, 1]).save_to_disk(str(tmp_path / "disk"))
    args = ["--model", str(model_dir), "--batch_size", "4", "--classnames", str(folder / "classnames.txt")]
    args += ["--templates", str(folder / "zeroshot_classification_templates.txt")]
    clean = record([*args, "--data", str(folder)], capsys)["metrics"]
    for data in (shards, tmp_path / "disk"):
        caplog.clear()
        got = record([*args, "--data", str(data)], capsys)["metrics"]
        assert got.pop("skipped_images") == 2 and got == clean, data
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping an eval image: ")]
        assert len(said) == 2 and "truncated" in said[0].lower(), said
        assert said[1] == "skipping an eval image: 900000000 pixels, above the cap of 50000000 (a decompression bomb?)"


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_set_whose_every_image_is_skipped_says_so(model_dir, tmp_path, capsys):
    from disco_clip_ds.testing.images import hostile_images

    bad = hostile_images()["png bomb header"]
    write_samples(tmp_path, [{"png": bad, "cls": "0"}, {"png": bad, "cls": "1"}], per_shard=2)
    (tmp_path / "classnames.txt").write_text("zero\none\n")
    (tmp_path / "zeroshot_classification_templates.txt").write_text("{c}\n")
    assert eval_main(["--model", str(model_dir), "--data", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].endswith("holds no samples that decode (2 image(s) skipped: see the warnings above)"), err


@pytest.mark.slow  # trains 3 steps with two in-training evals
def test_training_zeroshot_data_skips_and_counts_a_hostile_image(cls_set, tmp_path):
    """Training's `--zeroshot_data` died at its eval step with a truncated JPEG or a bomb in the set (no checkpoint
    of that step): it reads through the same decode, so training goes on, and the step logs the count."""
    import shutil

    from disco_clip_ds.eval.callback import ZeroShotCallback
    from disco_clip_ds.testing.images import hostile_images

    from unit.eval.sets import tiny_clip, tiny_trainer

    folder, images, labels = cls_set
    hostile = hostile_images()
    bad = [hostile["truncated jpeg"], hostile["png bomb header"]]
    data = tmp_path / "zeroshot"
    write_samples(data, [{"jpg": d, "cls": str(y)} for d, y in zip(images + bad, labels + [0, 1])], per_shard=4)
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        shutil.copy(folder / name, data / name)
    model, tokenizer, processor = tiny_clip()
    trainer = tiny_trainer(model, tokenizer, processor, images, tmp_path / "run")
    ZeroShotCallback(data, tokenizer, processor, every_n_steps=2, batch_size=4).attach(trainer)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "zeroshot_acc1" in e]
    assert [e["step"] for e in logged] == [2, 3] and all(e["zeroshot_skipped_images"] == 2 for e in logged), logged


@pytest.mark.slow  # beyond the fast tier's time budget
def test_zeroshot_classification_skips_and_counts_hostile_images(cls_set, tmp_path):
    """The task itself, in this process: a truncated JPEG and a bomb among the shards or the rows of a datasets
    dataset are skipped and counted (`skipped_images`), and the metrics equal those of the set without them."""
    from disco_clip_ds.eval.tasks import zeroshot_classification
    from disco_clip_ds.testing.images import hostile_images

    from unit.eval.sets import TEMPLATES, tiny_clip

    folder, images, labels = cls_set
    hostile = hostile_images()
    bad = [hostile["truncated jpeg"], hostile["png bomb header"]]
    write_samples(tmp_path / "shards", [{"jpg": d, "cls": str(y)} for d, y in zip(images + bad, labels + [0, 1])], 4)
    cls_dataset(images + bad, labels + [0, 1]).save_to_disk(str(tmp_path / "disk"))
    model, tokenizer, processor = tiny_clip()

    def metrics(data):
        return zeroshot_classification(
            model, tokenizer, str(data), CLASSNAMES, TEMPLATES, image_processor=processor, batch_size=4, progress=False
        )

    clean = metrics(folder)
    for data in (tmp_path / "shards", tmp_path / "disk"):
        got = metrics(data)
        assert got.pop("skipped_images") == 2 and got == clean, data


def test_dealt_checks_keep_each_shard_within_its_share_of_the_bound(cls_set, monkeypatch):
    """check_eval_shards(dealt=True) sends a shard's samples to every rank only within KEPT_SAMPLES / shards, so what
    a rank receives stays within the bound; a shard past its share is read again by the evaluation, which sees the
    same samples either way. cls_set: 3 shards of 4, 4 and 3 samples."""
    from disco_clip_ds.eval import sources

    folder, _, labels = cls_set
    shards = sources.resolve_shards(str(folder))
    reads = []
    read = sources._read
    monkeypatch.setattr(sources, "_read", lambda url, read_=None, **kw: reads.append(url) or read(url, **kw))
    monkeypatch.setattr(sources, "_kept", {})
    monkeypatch.setattr(sources, "KEPT_SAMPLES", 11)  # 3 a shard when dealt: the 3-sample shard alone fits
    sources.check_eval_shards(shards, "zeroshot_classification", dealt=True)
    assert [url for url, *_ in sources._kept] == [shards[2]]
    values = [v for _, batch in sources.raw_shard_batches(shards, "cls", 64) for v in batch]
    assert values == labels and reads == [*shards, shards[0], shards[1]]  # the first two read again, the third kept
    sources.check_eval_shards(shards, "zeroshot_classification")  # not dealt: each shard within the whole bound
    assert len(sources._kept) == 3
