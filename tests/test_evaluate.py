"""Zero-shot classification / retrieval: metrics against hand-computed values, the model path against an
independent float64 per-sample reference, the CLI, the shipped resources and the training callback."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from disco_clip_ds.errors import run_main
from disco_clip_ds.eval import zeroshot as ev
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

IMAGE_SIZE = 32


def eval_main(argv: list[str]) -> int:
    """`disco-clip eval` in this process: its exit code, its messages on stderr."""
    return run_main(ev.main, argv, "disco-clip eval")


# ------------------------------------------------------------------------------------ shared tiny pieces


def tiny_tokenizer():
    """A real CLIPTokenizer over the 256 byte-level symbols (no merges), built offline."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    symbols = sorted(ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    return CLIPTokenizer(vocab=vocab, merges=[])


def tiny_clip_config(tokenizer, image_size: int = IMAGE_SIZE):
    from transformers import CLIPConfig

    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


def tiny_image_processor(image_size: int = IMAGE_SIZE):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


def tiny_clip(seed: int = 0):
    from transformers import CLIPModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    return CLIPModel(tiny_clip_config(tokenizer)).eval(), tokenizer, tiny_image_processor()


CLASSNAMES = ["zero", "one", "two", "three", "four", "five"]
TEMPLATES = ["a photo of the digit {c}.", "{c}", "a drawing of a {c}."]


@pytest.fixture(scope="module")
def cls_set(tmp_path_factory):
    """11 images over 6 classes in 3 shards (uneven), with classnames and templates beside them."""
    rng = np.random.default_rng(0)
    labels = [0, 1, 2, 3, 4, 5, 0, 2, 2, 5, 1]
    images = [noise_image_bytes(rng, "PNG" if i % 2 else "JPEG") for i in range(len(labels))]
    folder = tmp_path_factory.mktemp("cls")
    samples = [{("png" if i % 2 else "jpg"): img, "cls": str(y)} for i, (img, y) in enumerate(zip(images, labels))]
    write_samples(folder, samples, per_shard=4)
    (folder / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
    (folder / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return folder, images, labels


# ---------------------------------------------------------------------------- metrics, computed by hand


def test_classification_metrics_hand_computed():
    logits = torch.tensor(
        [
            [5, 1, 0, 0, 0, 0],  # target 0: rank 0
            [3, 2, 1, 0, 0, 0],  # target 1: rank 1 (top-5 only)
            [0, 1, 9, 0, 0, 0],  # target 2: rank 0
            [6, 5, 4, 3, 2, 1],  # target 5: rank 5 (missed by top-5)
            [1, 7, 0, 0, 0, 0],  # target 0: rank 1, predicted 1
        ],
        dtype=torch.float,
    )
    metrics = ev.classification_metrics(logits, torch.tensor([0, 1, 2, 5, 0]))
    assert metrics["acc1"] == pytest.approx(2 / 5)
    assert metrics["acc5"] == pytest.approx(4 / 5)
    # per-class recall over classes present: 0 -> 1/2, 1 -> 0/1, 2 -> 1/1, 5 -> 0/1
    assert metrics["mean_per_class_recall"] == pytest.approx((0.5 + 0 + 1 + 0) / 4)


def test_classification_acc5_is_nan_below_five_classes():
    metrics = ev.classification_metrics(torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 1.0]]), torch.tensor([2, 2]))
    assert metrics["acc1"] == pytest.approx(0.5) and math.isnan(metrics["acc5"])


def test_retrieval_metrics_hand_computed():
    # captions 0, 1 -> image 0; caption 2 -> image 1; caption 3 -> image 2
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3], [0.7, 0.6, 0.1], [0.4, 0.0, 0.35]])
    metrics = ev.retrieval_metrics(scores, torch.tensor([0, 0, 1, 2]), ks=(1, 2, 5))
    # caption -> image ranks: 0, 2, 1, 1
    assert metrics["image_retrieval_recall@1"] == pytest.approx(1 / 4)
    assert metrics["image_retrieval_recall@2"] == pytest.approx(3 / 4)
    assert metrics["image_retrieval_recall@5"] == pytest.approx(1.0)
    # image -> best-caption ranks: image 0 -> 0 (caption 0), image 1 -> 1, image 2 -> 1
    assert metrics["text_retrieval_recall@1"] == pytest.approx(1 / 3)
    assert metrics["text_retrieval_recall@2"] == pytest.approx(1.0)


def _clip_benchmark_recall(scores, positives, k, batch_size=3):
    """CLIP_benchmark 1.6's rule, written out as its `recall_at_k` and `batchify` do it: per row the k indices of
    `torch.topk`, one-hot, the positives among them counted; a row is a hit when that count is above 0. Rows go
    through in batches, as there."""
    hits = []
    for start in range(0, len(scores), batch_size):
        x, y = scores[start : start + batch_size], positives[start : start + batch_size]
        topk_indices = torch.topk(x, k, dim=1)[1]
        onehot = torch.nn.functional.one_hot(topk_indices, num_classes=x.shape[1])
        true_positives = (onehot * y.view(len(x), 1, x.shape[1])).sum(dim=(1, 2))
        hits.append(true_positives / y.sum(dim=1) > 0)
    return torch.cat(hits).float().mean().item()


def _positives(text_to_image, n_images):
    positives = torch.zeros(len(text_to_image), n_images, dtype=torch.bool)
    positives[torch.arange(len(text_to_image)), text_to_image] = True
    return positives


def test_retrieval_metrics_match_clip_benchmark_formulation_on_random_scores():
    gen = torch.Generator().manual_seed(1)
    text_to_image = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 6, 6])
    scores = torch.rand(len(text_to_image), 7, generator=gen, dtype=torch.float64)
    positives = _positives(text_to_image, 7)
    metrics = ev.retrieval_metrics(scores, text_to_image)
    for k in (1, 5):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores, positives, k))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores.T, positives.T, k))
    assert metrics["image_retrieval_recall@10"] == pytest.approx(_clip_benchmark_recall(scores, positives, 7))


def test_retrieval_ties_hand_computed():
    # every score equal: topk returns the same k columns for every (equal) row, whichever it picks, so with one
    # positive per row, each column the positive of one row, exactly k of the n rows hit. Counting ties in the
    # model's favour would give 1.
    n = 6
    metrics = ev.retrieval_metrics(torch.zeros(n, n), torch.arange(n), ks=(1, 2, 5))
    for k in (1, 2, 5):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(k / n)
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(k / n)


def test_retrieval_ties_match_clip_benchmark_rule_on_repeated_captions():
    # as in the demo eval split: 40 images, 4 captions each drawn from 10 distinct texts, so many captions are
    # the same text (equal embeddings, equal score rows); scores rounded so that images tie too
    gen = torch.Generator().manual_seed(2)
    n_images, per_image, n_distinct = 40, 4, 10
    distinct = F.normalize(torch.randn(n_distinct, 8, generator=gen), dim=1)
    texts = distinct[torch.randint(n_distinct, (n_images * per_image,), generator=gen)]
    images = F.normalize(torch.randn(n_images, 8, generator=gen), dim=1)
    scores = (texts @ images.T * 4).round() / 4
    text_to_image = torch.arange(n_images).repeat_interleave(per_image)
    positives = _positives(text_to_image, n_images)
    metrics = ev.retrieval_metrics(scores, text_to_image)
    for k in (1, 5, 10):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores, positives, k))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(_clip_benchmark_recall(scores.T, positives.T, k))
    # the rule this replaced (a positive tied at the top always hits) gives more here: the test bites
    best = scores.T.masked_fill(~positives.T, -math.inf).amax(1, keepdim=True)
    assert metrics["text_retrieval_recall@1"] < ((scores.T > best).sum(1) < 1).double().mean().item()


# ---------------------------------------------------------- model path against a float64 per-sample loop


def _reference_embeddings(model, tokenizer, processor, images, classnames, templates):
    """Independent float64 path: one prompt and one image at a time, straight through CLIPModel.

    Returns the (n_classes, d) zero-shot classifier and the (n_images, d) image embeddings."""
    model = model.double()
    with torch.no_grad():
        weights = []
        for name in classnames:
            prompts = []
            for template in templates:
                tokens = tokenizer([template.format(c=name)], return_tensors="pt")
                prompts.append(F.normalize(model.get_text_features(**tokens).pooler_output[0], dim=0))
            weights.append(F.normalize(torch.stack(prompts).mean(0), dim=0))
        rows = []
        for data in images:
            pixels = processor(images=Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")["pixel_values"]
            rows.append(F.normalize(model.get_image_features(pixel_values=pixels.double()).pooler_output[0], dim=0))
    model.float()
    return torch.stack(weights), torch.stack(rows)


def _reference_metrics(logits: np.ndarray, labels) -> dict:
    order = np.argsort(-logits, axis=1)
    labels = np.asarray(labels)
    acc1 = np.mean(order[:, 0] == labels)
    acc5 = np.mean([y in row[:5] for y, row in zip(labels, order)])
    recalls = [np.mean(order[labels == c, 0] == c) for c in np.unique(labels)]
    return {"acc1": acc1, "acc5": acc5, "mean_per_class_recall": np.mean(recalls)}


def test_zeroshot_classification_matches_float64_reference(cls_set):
    folder, images, labels = cls_set
    model, tokenizer, processor = tiny_clip()
    model.train()  # the function must evaluate in eval mode and restore the flag
    classifier, image_rows = _reference_embeddings(model, tokenizer, processor, images, CLASSNAMES, TEMPLATES)
    assert torch.allclose(
        ev.zeroshot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES, batch_size=4).double(), classifier, atol=1e-5
    )
    reference = _reference_metrics((image_rows @ classifier.T).numpy(), labels)
    assert 0 < reference["acc5"] < 1  # the fixed set is informative: neither all right nor all wrong
    for batch_size in (1, 4, 64):
        metrics = ev.zeroshot_classification(
            model,
            tokenizer,
            str(folder),
            CLASSNAMES,
            TEMPLATES,
            image_processor=processor,
            batch_size=batch_size,
            progress=False,
        )
        assert metrics == pytest.approx(reference, abs=1e-9), batch_size
    assert model.training


def test_zeroshot_classification_accepts_a_dataloader(cls_set):
    folder, images, labels = cls_set
    model, tokenizer, processor = tiny_clip()
    pixels = processor(images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")[
        "pixel_values"
    ]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pixels, torch.tensor(labels)), batch_size=5)
    from_loader = ev.zeroshot_classification(model, tokenizer, loader, CLASSNAMES, TEMPLATES, progress=False)
    from_shards = ev.zeroshot_classification(
        model, tokenizer, str(folder), CLASSNAMES, TEMPLATES, image_processor=processor, progress=False
    )
    assert from_loader == pytest.approx(from_shards)


def test_zeroshot_retrieval_matches_float64_reference(tmp_path):
    rng = np.random.default_rng(3)
    captions = [
        ["a red square", "red"],
        ["two cats"],
        ["the sea", "blue water", "waves"],
        ["night"],
        ["a dog"],
        ["tree"],
    ]
    images = [noise_image_bytes(rng) for _ in captions]
    write_samples(tmp_path, [{"png": img, "txt": "\n".join(caps)} for img, caps in zip(images, captions)], per_shard=4)
    model, tokenizer, processor = tiny_clip(seed=1)

    model.double()
    with torch.no_grad():
        texts = [
            F.normalize(model.get_text_features(**tokenizer([t], return_tensors="pt")).pooler_output[0], dim=0)
            for caps in captions
            for t in caps
        ]
        image_rows = [
            F.normalize(
                model.get_image_features(
                    pixel_values=processor(images=Image.open(io.BytesIO(d)).convert("RGB"), return_tensors="pt")[
                        "pixel_values"
                    ].double()
                ).pooler_output[0],
                dim=0,
            )
            for d in images
        ]
    model.float()
    scores = (torch.stack(texts) @ torch.stack(image_rows).T).numpy()
    owner = np.array([i for i, caps in enumerate(captions) for _ in caps])
    image_rank = np.array([np.sum(row > row[o]) for row, o in zip(scores, owner)])
    text_rank = np.array(
        [min(np.sum(scores[:, i] > scores[t, i]) for t in np.flatnonzero(owner == i)) for i in range(len(images))]
    )

    metrics = ev.zeroshot_retrieval(
        model, tokenizer, str(tmp_path), image_processor=processor, batch_size=4, progress=False
    )
    assert set(metrics) == {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5, 10)}
    for k in (1, 5, 10):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(np.mean(image_rank < k))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(np.mean(text_rank < k))
    assert 0 < metrics["image_retrieval_recall@1"] < 1


# ---------------------------------------------------------------------------------- CLI and resources


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer, processor = tiny_clip()
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_cli_writes_clip_benchmark_record(cls_set, model_dir, tmp_path, capsys):
    folder, images, labels = cls_set
    out = tmp_path / "res" / "zeroshot.json"
    assert eval_main(["--model", str(model_dir), "--data", str(folder), "--batch_size", "3", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert set(record) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert record["task"] == "zeroshot_classification"
    model, tokenizer, processor = tiny_clip()
    expected = ev.zeroshot_classification(
        model, tokenizer, str(folder), CLASSNAMES, TEMPLATES, image_processor=processor, progress=False
    )
    assert record["metrics"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/nonexistent/shards"], "shards not found, e.g. '/nonexistent/shards'"),
        (["--data", "DIR/{00000..00005}.tar"], "3 of 6 shards not found"),
        (["--classnames", "/nonexistent/names.txt"], "not found"),
        (["--classnames", "imagenet1k", "--templates", "TPL"], "must contain '{c}'"),
        (["--batch_size", "0"], "--batch_size must be positive"),
    ],
)
def test_cli_errors_are_clear(cls_set, model_dir, tmp_path, capsys, extra, message):
    folder, _, _ = cls_set
    (tmp_path / "TPL").write_text("no placeholder here\n")
    extra = [str(tmp_path / "TPL") if e == "TPL" else e.replace("DIR", str(folder)) for e in extra]
    argv = ["--model", str(model_dir), "--data", str(folder), *extra]
    assert eval_main(argv) == 2  # bad usage, as from every command
    assert message in capsys.readouterr().err


def test_weightless_checkpoint_points_to_export(cls_set, model_dir, tmp_path, capsys):
    folder, _, _ = cls_set
    checkpoint = tmp_path / "checkpoint-8"  # what ZeRO-3 leaves without gathered weights: config + DeepSpeed state
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text((model_dir / "config.json").read_text())
    (checkpoint / "latest").write_text("global_step8")
    assert eval_main(["--model", str(checkpoint), "--data", str(folder)]) == 2
    assert "run `disco-clip export" in capsys.readouterr().err


def test_class_index_beyond_classnames_is_reported(cls_set, model_dir, tmp_path, capsys):
    folder, _, _ = cls_set
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    assert (
        eval_main(["--model", str(model_dir), "--data", str(folder), "--classnames", str(tmp_path / "three.txt")]) == 2
    )
    assert "there are 3 class names" in capsys.readouterr().err


def test_shipped_resources():
    names = ev.find_classnames("/unused", "imagenet1k")
    templates = ev.find_templates("/nonexistent", None)  # no templates beside the shards -> OpenAI's 80
    assert len(names) == 1000 and names[0] == "tench" and names[-1] == "toilet paper"
    assert len(templates) == 80 and templates[0] == "a bad photo of a {c}." and all("{c}" in t for t in templates)


# ------------------------------------------------------------------------------- the training callback


@pytest.mark.parametrize("source", ["shards", "datasets"])
def test_callback_logs_zeroshot_metrics_through_the_trainer(cls_set, hf_cls, tmp_path, source):
    """Logged every 2 steps and at the last, equal to an eval of the final model on the shards: from the shards
    themselves, or from the same set as a parquet dataset (its split and columns named, class names from its
    ClassLabel)."""
    from transformers import Trainer, TrainingArguments

    folder, images, labels = cls_set
    model, tokenizer, processor = tiny_clip()
    tokens = tokenizer(["a photo", "two cats playing"], padding="max_length", max_length=16, return_tensors="pt")
    pixels = processor(images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images[:2]], return_tensors="pt")[
        "pixel_values"
    ]
    train = [
        {"input_ids": tokens["input_ids"][i], "attention_mask": tokens["attention_mask"][i], "pixel_values": pixels[i]}
        for i in range(2)
    ] * 4

    def collate(rows):
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        return {**batch, "return_loss": True}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
    if source == "shards":
        callback = ev.ZeroShotCallback(folder, tokenizer, IMAGE_SIZE, every_n_steps=2, batch_size=4)
    else:
        columns = dict(split="test", image_column="image", label_column="label")
        callback = ev.ZeroShotCallback(
            hf_cls["parquet"], tokenizer, IMAGE_SIZE, every_n_steps=2, batch_size=4, **columns
        )
    callback.attach(trainer)
    trainer.train()
    logged = {e["step"]: e for e in trainer.state.log_history if "zeroshot_acc1" in e}
    assert sorted(logged) == [2, 3]  # every 2 steps, and the last
    final = ev.zeroshot_classification(
        model, tokenizer, str(folder), CLASSNAMES, TEMPLATES, image_processor=processor, progress=False
    )
    assert {k: logged[3][f"zeroshot_{k}"] for k in final} == pytest.approx(final)


@pytest.mark.parametrize("damage, message", [("truncate", "is truncated"), ("garbage", "is truncated or not a tar")])
def test_damaged_shard_is_named_before_the_model_loads(cls_set, model_dir, tmp_path, capsys, damage, message):
    import shutil

    folder = tmp_path / "cls"
    shutil.copytree(cls_set[0], folder)
    shard = folder / "00001.tar"
    data = shard.read_bytes()
    # 612 bytes: the first member's header and the start of its image, cut inside the image
    shard.write_bytes(data[:612] if damage == "truncate" else b"not a tar at all" * 64)
    assert eval_main(["--model", str(model_dir), "--data", str(folder)]) == 1
    assert f"shard '{shard}' {message}" in capsys.readouterr().err


def test_shards_without_labels_point_to_retrieval(model_dir, tmp_path, capsys):
    rng = np.random.default_rng(1)
    write_samples(
        tmp_path, [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": f"caption {i}"} for i in range(3)], per_shard=3
    )
    assert eval_main(["--model", str(model_dir), "--data", str(tmp_path), "--classnames", "imagenet1k"]) == 2
    err = capsys.readouterr().err
    assert "no .cls members" in err and "use --task zeroshot_retrieval" in err
    assert eval_main(["--model", str(model_dir), "--data", str(tmp_path), "--task", "zeroshot_retrieval"]) == 0


# ------------------------------------------------------------------------- 🤗 datasets as the eval source


def _rows_dataset(columns: dict, features: dict):
    from datasets import Dataset, Features

    return Dataset.from_dict(columns, features=Features(features))


def _cls_dataset(images, labels, label_feature=None):
    from datasets import ClassLabel
    from datasets import Image as ImageFeature

    return _rows_dataset(
        {"image": [{"bytes": b, "path": None} for b in images], "label": labels, "note": ["x"] * len(labels)},
        {"image": ImageFeature(), "label": label_feature or ClassLabel(names=CLASSNAMES), "note": _string()},
    )


def _string():
    from datasets import Value

    return Value("string")


@pytest.fixture(scope="module")
def hf_cls(cls_set, tmp_path_factory):
    """cls_set's 11 images and labels as a datasets dataset three ways, each with the same templates file beside
    it: a save_to_disk folder, a parquet folder (2 files, hub naming: split "test"), one parquet file."""
    _, images, labels = cls_set
    root = tmp_path_factory.mktemp("hf_cls")
    dataset = _cls_dataset(images, labels)
    dataset.save_to_disk(str(root / "disk"))
    (root / "parquet").mkdir()
    for i in range(2):
        dataset.shard(2, i, contiguous=True).to_parquet(str(root / "parquet" / f"test-0000{i}-of-00002.parquet"))
    (root / "file").mkdir()
    dataset.to_parquet(str(root / "file" / "eval.parquet"))
    for folder in ("disk", "parquet", "file"):
        (root / folder / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return {"disk": root / "disk", "parquet": root / "parquet", "file": root / "file" / "eval.parquet"}


def _record(argv, capsys) -> dict:
    assert eval_main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("form", ["disk", "parquet", "file"])
def test_datasets_classification_equals_shards(cls_set, hf_cls, model_dir, form, capsys):
    """The same 11 images and labels as shards and as a datasets dataset: the same metrics, to the last bit.
    Class names come from the ClassLabel (the shards have them in classnames.txt), templates from the file."""
    shards = _record(["--model", str(model_dir), "--data", str(cls_set[0]), "--batch_size", "4"], capsys)
    hf = _record(["--model", str(model_dir), "--data", str(hf_cls[form]), "--batch_size", "4"], capsys)
    assert hf["metrics"] == shards["metrics"] and 0 < shards["metrics"]["acc5"] < 1
    named = ["--image_column", "image", "--label_column", "label", "--split", "test" if form == "parquet" else "train"]
    again = _record(["--model", str(model_dir), "--data", str(hf_cls[form]), "--batch_size", "4", *named], capsys)
    assert again["metrics"] == shards["metrics"]


def test_imagefolder_classification_equals_shards(cls_set, model_dir, tmp_path, capsys):
    """An `imagefolder` (one subfolder per class, labels a ClassLabel of the folder names): with the class names
    given (they win over the folder names), the shards' metrics."""
    folder, images, labels = cls_set
    for i, (data, label) in enumerate(zip(images, labels)):
        (tmp_path / "set" / f"class{label}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "set" / f"class{label}" / f"{i:02d}.{'png' if i % 2 else 'jpg'}").write_bytes(data)
    args = ["--model", str(model_dir), "--classnames", str(folder / "classnames.txt")]
    args += ["--templates", str(folder / "zeroshot_classification_templates.txt")]
    shards = _record([*args, "--data", str(folder)], capsys)["metrics"]
    assert _record([*args, "--data", str(tmp_path / "set")], capsys)["metrics"] == pytest.approx(shards, abs=1e-12)


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
        feature = List(Value("string")) if name == "lists" else _string()
        dataset = _rows_dataset({"jpg": images, "captions": caps}, {"jpg": Value("binary"), "captions": feature})
        hf.mkdir(parents=True)
        dataset.to_parquet(str(hf / "test-00000-of-00001.parquet"))
        sets[name] = shards, hf
    return sets


@pytest.mark.parametrize("kind", ["lists", "strings"])
def test_datasets_retrieval_equals_shards(retrieval_sets, model_dir, kind, capsys):
    shards, hf = retrieval_sets[kind]
    task = ["--task", "zeroshot_retrieval", "--batch_size", "4"]
    from_shards = _record(["--model", str(model_dir), "--data", str(shards), *task], capsys)
    named = ["--image_column", "jpg", "--caption_column", "captions"]  # bytes: no Image column to detect
    from_hf = _record(["--model", str(model_dir), "--data", str(hf), *task, *named], capsys)
    assert from_hf["metrics"] == from_shards["metrics"]
    assert any(0 < value < 1 for value in from_shards["metrics"].values())  # neither all right nor all wrong


@pytest.fixture(scope="module")
def bad_hf(cls_set, tmp_path_factory):
    """Datasets that are wrong in one way each (parquet folders, split "test" unless named)."""
    from datasets import ClassLabel, DatasetDict, Value

    _, images, labels = cls_set
    root = tmp_path_factory.mktemp("bad_hf")
    good = _cls_dataset(images, labels)

    def parquet(name, dataset):
        (root / name).mkdir()
        dataset.to_parquet(str(root / name / "test-00000-of-00001.parquet"))

    parquet("int_labels", _cls_dataset(images, labels, Value("int64")))
    parquet("str_labels", _cls_dataset(images, [CLASSNAMES[y] for y in labels], _string()))
    ints = {"image": Value("int64"), "label": ClassLabel(names=CLASSNAMES)}
    parquet("int_images", _rows_dataset({"image": list(range(len(labels))), "label": labels}, ints))
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
def test_datasets_bad_input_is_one_line(cls_set, hf_cls, bad_hf, model_dir, capsys, data, extra, message):
    """Each wrong dataset or option: exit 2 and one line naming it (the columns or splits that are there)."""
    where = {"parquet": hf_cls["parquet"], "shards": cls_set[0]}.get(data, bad_hf / data)
    data = str(where) if where.exists() else data
    assert eval_main(["--model", str(model_dir), "--data", data, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message.replace("DATA", data) in err and "\n" not in err, err


def test_datasets_int_labels_with_classnames_and_a_config(cls_set, bad_hf, model_dir, tmp_path, capsys):
    """Plain integer labels read with --classnames; of a dataset with two configs, --dataset_config_name picks
    one: both give the shards' metrics (config b holds only the first 5 rows: other metrics)."""
    shards = _record(["--model", str(model_dir), "--data", str(cls_set[0])], capsys)["metrics"]
    names = tmp_path / "names.txt"
    names.write_text("\n".join(CLASSNAMES) + "\n")
    templates = ["--templates", str(cls_set[0] / "zeroshot_classification_templates.txt")]
    ints = ["--label_column", "label", "--classnames", str(names), *templates]
    assert (
        _record(["--model", str(model_dir), "--data", str(bad_hf / "int_labels"), *ints], capsys)["metrics"] == shards
    )
    configs = ["--model", str(model_dir), "--data", str(bad_hf / "two_configs"), *templates]
    assert _record([*configs, "--dataset_config_name", "a"], capsys)["metrics"] == shards
    assert _record([*configs, "--dataset_config_name", "b"], capsys)["metrics"] != shards
