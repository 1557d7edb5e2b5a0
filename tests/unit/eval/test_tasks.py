"""eval/tasks.py (and the encoding it runs): zero-shot classification and retrieval against float64 references; the
shipped class names and templates."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from disco_clip_ds.errors import UsageError
from disco_clip_ds.eval.encode import zeroshot_classifier
from disco_clip_ds.eval.tasks import find_classnames, find_templates, zeroshot_classification, zeroshot_retrieval
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

from unit.eval.sets import CLASSNAMES, TEMPLATES, tiny_clip


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


@pytest.mark.slow  # beyond the fast tier's time budget
def test_zeroshot_classification_matches_float64_reference(cls_set):
    folder, images, labels = cls_set
    model, tokenizer, processor = tiny_clip()
    model.train()  # the function must evaluate in eval mode and restore the flag
    classifier, image_rows = _reference_embeddings(model, tokenizer, processor, images, CLASSNAMES, TEMPLATES)
    assert torch.allclose(
        zeroshot_classifier(model, tokenizer, CLASSNAMES, TEMPLATES, batch_size=4).double(), classifier, atol=1e-5
    )
    reference = _reference_metrics((image_rows @ classifier.T).numpy(), labels)
    assert 0 < reference["acc5"] < 1  # the fixed set is informative: neither all right nor all wrong
    for batch_size in (1, 4, 64):
        metrics = zeroshot_classification(
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


@pytest.mark.slow  # beyond the fast tier's time budget
def test_zeroshot_classification_accepts_a_dataloader(cls_set):
    folder, images, labels = cls_set
    model, tokenizer, processor = tiny_clip()
    pixels = processor(images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")[
        "pixel_values"
    ]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pixels, torch.tensor(labels)), batch_size=5)
    from_loader = zeroshot_classification(model, tokenizer, loader, CLASSNAMES, TEMPLATES, progress=False)
    from_shards = zeroshot_classification(
        model, tokenizer, str(folder), CLASSNAMES, TEMPLATES, image_processor=processor, progress=False
    )
    assert from_loader == pytest.approx(from_shards)


@pytest.mark.slow  # beyond the fast tier's time budget
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

    metrics = zeroshot_retrieval(
        model, tokenizer, str(tmp_path), image_processor=processor, batch_size=4, progress=False
    )
    assert set(metrics) == {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5, 10)}
    for k in (1, 5, 10):
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(np.mean(image_rank < k))
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(np.mean(text_rank < k))
    assert 0 < metrics["image_retrieval_recall@1"] < 1


def test_shipped_resources():
    names = find_classnames("/unused", "imagenet1k")
    templates = find_templates("/nonexistent", None)  # no templates beside the shards -> OpenAI's 80
    assert len(names) == 1000 and names[0] == "tench" and names[-1] == "toilet paper"
    assert len(templates) == 80 and templates[0] == "a bad photo of a {c}." and all("{c}" in t for t in templates)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_images_without_a_caption_are_counted_kept_as_misses_and_warned(tmp_path, caplog):
    """Issue 54: an image whose captions are blank stayed in text retrieval's denominator without a word. It still
    counts as a miss (CLIP_benchmark's rule), so text recall@k = (the captioned images' recall@k) x captioned / all,
    and the record and a warning give the count."""
    rng = np.random.default_rng(5)
    captions = ["a red square", "  \n ", "two cats\nthe sea", "night", "\n", "tree"]
    samples = [{"png": noise_image_bytes(rng), "txt": text} for text in captions]
    write_samples(tmp_path / "all", samples, per_shard=4)
    write_samples(tmp_path / "captioned", [s for s in samples if s["txt"].strip()], per_shard=4)
    model, tokenizer, processor = tiny_clip(seed=1)
    run = {"image_processor": processor, "batch_size": 4, "progress": False}
    with caplog.at_level("WARNING", logger="disco_clip_ds.eval.tasks"):
        every = zeroshot_retrieval(model, tokenizer, str(tmp_path / "all"), **run)
    captioned = zeroshot_retrieval(model, tokenizer, str(tmp_path / "captioned"), **run)
    assert every["images_without_caption"] == 2 and "images_without_caption" not in captioned
    for k in (1, 5, 10):
        assert every[f"text_retrieval_recall@{k}"] == pytest.approx(captioned[f"text_retrieval_recall@{k}"] * 4 / 6)
    assert "2 of 6 images have no caption" in caplog.text


def test_a_class_name_or_template_file_without_a_line_is_refused_where_both_paths_read_it(tmp_path):
    """--data and a suite's task both take their lists from find_classnames / find_templates: one check there."""
    (tmp_path / "blank.txt").write_text("\n \t\n")
    with pytest.raises(UsageError, match=r"^class names file .*blank.txt holds no lines: give a class name, one per"):
        find_classnames(str(tmp_path), str(tmp_path / "blank.txt"))
    with pytest.raises(UsageError, match=r"^templates .*blank.txt holds no lines: give a template such as"):
        find_templates(str(tmp_path), str(tmp_path / "blank.txt"))
