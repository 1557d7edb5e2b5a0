"""Zero-shot classification and retrieval of a CLIPModel or SiglipModel, with CLIP_benchmark's metrics, and what
they need besides the images: class names and templates.

Class names and templates are read from `classnames.txt` and `zeroshot_classification_templates.txt` (`{c}` = class
name) beside the shards, as CLIP_benchmark lays them out; ImageNet-1k class names and OpenAI's 80 templates ship in
`resources/` for users who bring their own ImageNet val shards. `open_eval_data` opens what `disco-clip eval --data`
and the in-training callback name: shards or a 🤗 datasets source, its class names with it.

Under ZeRO-3 every rank holds a slice of the weights and a forward is a collective, so the functions here
must run on every rank over the same data (they do: the data are read whole on each rank, never split).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from disco_clip_ds.data.hf_io import is_datasets_source
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.eval.encode import EvalMode, encode_images, encode_texts, unwrap, zeroshot_classifier
from disco_clip_ds.eval.metrics import RECALL_KS, classification_metrics, retrieval_metrics
from disco_clip_ds.eval.sources import (
    DatasetSource,
    as_batches,
    check_eval_shards,
    refuse_dataset_options,
    resolve_shards,
)

RESOURCES = Path(__file__).resolve().parents[1] / "resources"
NAMED_CLASSNAMES = {"imagenet1k": RESOURCES / "imagenet1k_classnames.txt"}
NAMED_TEMPLATES = {"openai_imagenet": RESOURCES / "openai_imagenet_templates.txt"}
CLASSNAMES_FILE = "classnames.txt"  # CLIP_benchmark's names for the files beside the shards
TEMPLATES_FILE = "zeroshot_classification_templates.txt"


def _progress(batches, desc: str, enabled: bool):
    rank = int(os.environ.get("RANK", "0"))
    return tqdm(batches, desc=desc, unit="batch", disable=not enabled or rank != 0, file=sys.stderr)


def zeroshot_classification(
    model,
    tokenizer,
    data,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    image_processor=None,
    batch_size: int = 64,
    progress: bool = True,
) -> dict[str, float]:
    """Zero-shot classification: acc1, acc5, mean_per_class_recall (fractions in [0, 1]).

    `data` is a shard spec (folder, brace pattern, '::'-joined, list; then `image_processor` is needed) or any
    iterable of `(pixel_values, class_indices)` batches, such as a DataLoader.
    """
    if not classnames or not templates:
        raise UsageError("zero-shot classification needs at least one class name and one template")
    with EvalMode(unwrap(model)):
        classifier = zeroshot_classifier(model, tokenizer, classnames, templates, batch_size=max(batch_size, 64))
        logits, targets = [], []
        for pixel_values, labels in _progress(
            as_batches(data, image_processor, "cls", batch_size), "zero-shot", progress
        ):
            logits.append(100.0 * encode_images(model, pixel_values) @ classifier.T)
            targets.append(torch.as_tensor(labels, dtype=torch.long))
    if not logits:
        raise DataError("the evaluation data holds no samples")
    targets = torch.cat(targets)
    if targets.min() < 0 or targets.max() >= len(classnames):
        raise UsageError(
            f"class indices run {targets.min().item()}..{targets.max().item()} but there are {len(classnames)} "
            "class names"
        )
    return classification_metrics(torch.cat(logits), targets)


def zeroshot_retrieval(
    model,
    tokenizer,
    data,
    *,
    image_processor=None,
    batch_size: int = 64,
    ks: Sequence[int] = RECALL_KS,
    progress: bool = True,
) -> dict[str, float]:
    """Image-text retrieval: image_retrieval_recall@k and text_retrieval_recall@k for k in `ks`.

    `data` is a shard spec (then `image_processor` is needed) or an iterable of `(pixel_values, captions)`
    batches where `captions[i]` is the list of captions of image i.
    """
    image_embeddings, text_embeddings, text_to_image = [], [], []
    with EvalMode(unwrap(model)):
        for pixel_values, captions in _progress(
            as_batches(data, image_processor, "txt", batch_size), "retrieval", progress
        ):
            first = sum(len(e) for e in image_embeddings)
            image_embeddings.append(encode_images(model, pixel_values))
            texts = [text for caps in captions for text in caps]
            text_to_image += [first + i for i, caps in enumerate(captions) for _ in caps]
            text_embeddings.append(
                encode_texts(model, tokenizer, texts, batch_size)
                if texts
                else torch.empty(0, image_embeddings[-1].shape[1])
            )
    if not image_embeddings or not text_to_image:
        raise DataError("the evaluation data holds no image with a caption")
    scores = torch.cat(text_embeddings) @ torch.cat(image_embeddings).T
    return retrieval_metrics(scores, torch.tensor(text_to_image), ks)


def read_lines(path: str | os.PathLike) -> list[str]:
    """Non-empty lines of a text file (class names, templates)."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _shard_folder(data: str) -> Path | None:
    if os.path.isdir(data):
        return Path(data)
    try:
        return Path(resolve_shards(data)[0]).parent
    except UsageError:
        return None


def find_classnames(data: str, classnames: str | None) -> list[str]:
    """Class names from `classnames` (a file or a shipped name like "imagenet1k"), else `classnames.txt` beside
    the shards."""
    if classnames:
        path = NAMED_CLASSNAMES.get(classnames, Path(classnames))
    else:
        folder = _shard_folder(data)
        path = folder / CLASSNAMES_FILE if folder else None
        if path is None or not path.is_file():
            raise UsageError(f"no {CLASSNAMES_FILE} beside the shards '{data}': pass --classnames FILE (or imagenet1k)")
    if not Path(path).is_file():
        raise UsageError(f"class names file '{path}' not found (shipped lists: {', '.join(NAMED_CLASSNAMES)})")
    return read_lines(path)


def find_templates(data: str, templates: str | None) -> list[str]:
    """Templates from `templates` (a file or "openai_imagenet"), else those beside the shards, else OpenAI's 80."""
    if templates:
        path = NAMED_TEMPLATES.get(templates, Path(templates))
    else:
        folder = _shard_folder(data)
        beside = folder / TEMPLATES_FILE if folder else None
        path = beside if beside is not None and beside.is_file() else NAMED_TEMPLATES["openai_imagenet"]
    if not Path(path).is_file():
        raise UsageError(f"templates file '{path}' not found (shipped: {', '.join(NAMED_TEMPLATES)})")
    lines = read_lines(path)
    if not all("{c}" in line for line in lines):
        raise UsageError(f"every template in '{path}' must contain '{{c}}' where the class name goes")
    return lines


# the options that name a datasets dataset's split and columns, as `disco-clip eval` spells them
DATASET_FLAGS = {
    "split": "--split",
    "config": "--dataset_config_name",
    "image_column": "--image_column",
    "label_column": "--label_column",
    "caption_column": "--caption_column",
}


def open_eval_data(
    data: str, task: str, classnames: str | None = None, **columns: str | None
) -> tuple[list[str] | DatasetSource, list[str] | None]:
    """(the data, its class names: None for retrieval) that `data` names: checked shards, or a 🤗 datasets source
    with its columns picked (`columns`: `DatasetSource.open`'s split, config and columns). Those name a datasets
    dataset's; with shards they are refused. `classnames`: a file or a shipped name, else those beside the shards or
    the dataset's ClassLabel names."""
    classify = task == "zeroshot_classification"
    if is_datasets_source(data):
        names = find_classnames(data, classnames) if classify and classnames else None
        source = DatasetSource.open(data, task, classnames=names, **columns)
        return source, source.classnames
    refuse_dataset_options(data, {DATASET_FLAGS[name]: value for name, value in columns.items()})
    shards = resolve_shards(data)
    check_eval_shards(shards, task)
    return shards, find_classnames(data, classnames) if classify else None
