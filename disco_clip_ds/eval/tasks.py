"""Zero-shot classification and retrieval of a CLIPModel or SiglipModel, with CLIP_benchmark's metrics, and what
they need besides the images: class names and templates.

Class names and templates are read from `classnames.txt` and `zeroshot_classification_templates.txt` (`{c}` = class
name) beside the shards or their split folder, as CLIP_benchmark lays them out; ImageNet-1k class names and OpenAI's
80 templates ship in `resources/` for users who bring their own ImageNet val shards; CLIP_benchmark's own lists by
dataset name (`cifar10`, `imagenet1k`, ...) are read from an installed clip_benchmark package.
`open_eval_data` opens what `disco-clip eval --data`
and the in-training callback name: shards or a 🤗 datasets source, its class names with it.

Under ZeRO-3 every rank holds a slice of the weights and a forward is a collective, so the functions here must run
on every rank over the same data: each rank reads the set whole, encodes every N-th batch of it (eval/spread.py) and
gets every rank's features back, so the metrics are computed alike on every rank and equal those of one rank.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
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
    as_raw_batches,
    check_eval_shards,
    kept,
    refuse_dataset_options,
    resolve_shards,
    skipped_of,
    split_shards,
)
from disco_clip_ds.eval.spread import spread
from disco_clip_ds.texts import read_lines

logger = logging.getLogger(__name__)
RESOURCES = Path(__file__).resolve().parents[1] / "resources"
NAMED_CLASSNAMES = {"imagenet1k": RESOURCES / "imagenet1k_classnames.txt"}
NAMED_TEMPLATES = {"openai_imagenet": RESOURCES / "openai_imagenet_templates.txt"}
CLASSNAMES_FILE = "classnames.txt"  # CLIP_benchmark's names for the files beside the shards
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
# CLIP_benchmark's lists by dataset name, in its package (read from an installed clip_benchmark, never copied here)
CLIP_BENCHMARK_LISTS = {
    "classnames": "datasets/en_classnames.json",
    "templates": "datasets/en_zeroshot_classification_templates.json",
}


def progress_bar(batches, desc: str, enabled: bool):
    """A tqdm bar over `batches` on rank 0 (stderr), when `enabled`."""
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
    classifier: torch.Tensor | None = None,
    desc: str = "zero-shot",
) -> dict[str, float]:
    """Zero-shot classification: acc1, acc5, mean_per_class_recall (fractions in [0, 1]).

    `data` is a shard spec (folder, brace pattern, '::'-joined, list; then `image_processor` is needed) or any
    iterable of `(pixel_values, class_indices)` batches, such as a DataLoader. `classifier`: the text tower's
    (n_classes, d) classifier of these class names and templates when already computed (a suite shares it between
    tasks of the same classes), else computed here.
    """
    if not classnames or not templates:
        raise UsageError("zero-shot classification needs at least one class name and one template")
    with EvalMode(unwrap(model)):
        if classifier is None:
            classifier = zeroshot_classifier(model, tokenizer, classnames, templates, batch_size=max(batch_size, 64))

        def forward(batch):
            logits = 100.0 * kept(encode_images(model, batch[0]), batch) @ classifier.T
            return logits, torch.as_tensor(batch[1], dtype=torch.long), len(skipped_of(batch))

        raw, decode = as_raw_batches(data, image_processor, "cls", batch_size)
        outputs = spread(progress_bar(raw, desc, progress), decode, forward)
    logits, targets, skipped = zip(*outputs) if outputs else ((), (), ())
    if not outputs or sum(len(t) for t in targets) == 0:
        raise DataError("the evaluation data holds no samples" + skipped_note(sum(skipped)))
    targets = torch.cat(targets)
    check_class_indices(targets, classnames)
    return with_skipped(classification_metrics(torch.cat(logits), targets), sum(skipped))


def skipped_note(skipped: int) -> str:
    """What a set that yields nothing says of its skipped images."""
    return f" that decode ({skipped} image(s) skipped: see the warnings above)" if skipped else ""


def with_skipped(metrics: dict, skipped: int) -> dict:
    """`metrics` with `skipped_images`, the count of images that did not decode (each logged with its reason), when
    there were any: training's `skipped_samples`, for an evaluation."""
    if skipped:
        metrics["skipped_images"] = skipped
    return metrics


def check_class_indices(targets: torch.Tensor, classnames: Sequence[str], where: str = "") -> None:
    """Every class index names one of `classnames` (zero-shot classification and a linear probe given names)."""
    if len(targets) and (targets.min() < 0 or targets.max() >= len(classnames)):
        raise UsageError(
            f"{where}class indices run {targets.min().item()}..{targets.max().item()} but there are "
            f"{len(classnames)} class names: give one name per class, in the order of the indices"
        )


def zeroshot_retrieval(
    model,
    tokenizer,
    data,
    *,
    image_processor=None,
    batch_size: int = 64,
    ks: Sequence[int] = RECALL_KS,
    progress: bool = True,
    desc: str = "retrieval",
) -> dict[str, float]:
    """Image-text retrieval: image_retrieval_recall@k and text_retrieval_recall@k for k in `ks`.

    `data` is a shard spec (then `image_processor` is needed) or an iterable of `(pixel_values, captions)`
    batches where `captions[i]` is the list of captions of image i. Images without a caption stay in text
    retrieval's denominator as misses (CLIP_benchmark's count); their number is `images_without_caption`, present
    when some are, and a warning says so.
    """
    with EvalMode(unwrap(model)):
        raw, decode = as_raw_batches(data, image_processor, "txt", batch_size)
        outputs = spread(
            progress_bar(raw, desc, progress),
            decode,
            lambda b: (kept(encode_images(model, b[0]), b), b[1], len(skipped_of(b))),
        )
        captions = [caps for _, batch_captions, _ in outputs for caps in batch_captions]
        texts = [text for caps in captions for text in caps]
        skipped = sum(n for _, _, n in outputs)
        if not texts:
            raise DataError("the evaluation data holds no image with a caption" + skipped_note(skipped))
        text_embeddings = encode_texts(model, tokenizer, texts, batch_size)
    text_to_image = [i for i, caps in enumerate(captions) for _ in caps]
    scores = text_embeddings @ torch.cat([images for images, _, _ in outputs]).T
    metrics = retrieval_metrics(scores, torch.tensor(text_to_image), ks)
    blank = sum(not caps for caps in captions)
    if blank and int(os.environ.get("RANK", "0")) == 0:  # kept as misses, as CLIP_benchmark counts them
        logger.warning(
            "%s: %d of %d images have no caption (blank .txt or caption): they count as misses of "
            "text_retrieval_recall@k, as CLIP_benchmark counts them (images_without_caption in the record)",
            desc,
            blank,
            len(captions),
        )
    if blank:
        metrics["images_without_caption"] = blank
    return with_skipped(metrics, skipped)


def _beside(data: str, name: str) -> Path | None:
    """`name` beside the shards: in the folder `data` names, in the shards' folder, or in its parent (CLIP_benchmark
    keeps classnames.txt beside `test/`)."""
    folders = [Path(data)] if os.path.isdir(data) else []
    try:
        shards = Path(resolve_shards(split_shards(data) or data)[0]).parent
        folders += [shards, shards.parent]
    except UsageError:
        pass
    return next((folder / name for folder in folders if (folder / name).is_file()), None)


def clip_benchmark_list(kind: str, name: str) -> list[str]:
    """CLIP_benchmark's English `kind` ("classnames" or "templates") for dataset `name`, read from the installed
    clip_benchmark package (importlib.resources); a one-line UsageError when it is not installed or has no such
    dataset."""
    flag = f"--{kind}"
    try:
        table = json.loads((importlib.resources.files("clip_benchmark") / CLIP_BENCHMARK_LISTS[kind]).read_text())
    except ModuleNotFoundError as e:
        raise UsageError(
            f"{flag} {name}: not a file; CLIP_benchmark's {kind} by dataset name need it installed: "
            f"`pip install clip-benchmark` (or pass a file, one per line)"
        ) from e
    values = table.get(name)
    if not isinstance(values, list) or not values:
        known = ", ".join(sorted(k for k, v in table.items() if isinstance(v, list))[:12])
        raise UsageError(f"{flag} {name}: CLIP_benchmark has no {kind} for '{name}' (it has {known}, ...)")
    return [str(value) for value in values]


def _is_name(value: str) -> bool:
    """A dataset name rather than a file: no folder, no extension (`cifar10`, `imagenet1k`, `fgvc_aircraft`)."""
    return not os.path.exists(value) and os.sep not in value and "/" not in value and "." not in value


def find_classnames(data: str, classnames: str | None) -> list[str]:
    """Class names from `classnames` (a file, a shipped name like "imagenet1k", or a CLIP_benchmark dataset name
    like "cifar10"), else `classnames.txt` beside the shards."""
    if classnames:
        if classnames not in NAMED_CLASSNAMES and _is_name(classnames):
            return clip_benchmark_list("classnames", classnames)
        path = NAMED_CLASSNAMES.get(classnames, Path(classnames))
    else:
        path = _beside(data, CLASSNAMES_FILE)
        if path is None:
            raise UsageError(
                f"no {CLASSNAMES_FILE} beside the shards '{data}': pass --classnames FILE, imagenet1k, or a "
                "CLIP_benchmark dataset name"
            )
    if not Path(path).is_file():
        raise UsageError(f"class names file '{path}' not found (shipped lists: {', '.join(NAMED_CLASSNAMES)})")
    return _non_empty(read_lines(path, "class names file"), f"class names file {path}", "a class name")


def find_templates(data: str, templates: str | None) -> list[str]:
    """Templates from `templates` (a file, "openai_imagenet", or a CLIP_benchmark dataset name like "imagenet1k"),
    else those beside the shards, else OpenAI's 80."""
    if templates and templates not in NAMED_TEMPLATES and _is_name(templates):
        lines, path = clip_benchmark_list("templates", templates), f"CLIP_benchmark's {templates}"
    else:
        if templates:
            path = NAMED_TEMPLATES.get(templates, Path(templates))
        else:
            path = _beside(data, TEMPLATES_FILE) or NAMED_TEMPLATES["openai_imagenet"]
        if not Path(path).is_file():
            raise UsageError(f"templates file '{path}' not found (shipped: {', '.join(NAMED_TEMPLATES)})")
        lines = read_lines(path, "templates file")
    _non_empty(lines, f"templates {path}", "a template such as 'a photo of a {c}.'")
    if not all("{c}" in line for line in lines):
        raise UsageError(f"every template in '{path}' must contain '{{c}}' where the class name goes")
    return lines


def _non_empty(lines: list[str], where: str, what: str) -> list[str]:
    """`lines`, refused when there are none: the one check of `--data` and a suite's tasks alike (an empty list
    would otherwise reach the text tower as an empty batch)."""
    if not lines:
        raise UsageError(f"{where} holds no lines: give {what}, one per line")
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
    data: str, task: str, classnames: str | None = None, check: bool = True, **columns: str | None
) -> tuple[list[str] | DatasetSource, list[str] | None]:
    """(the data, its class names: None for retrieval, and for a linear probe without them) that `data` names:
    checked shards, or a 🤗 datasets source with its columns picked (`columns`: `DatasetSource.open`'s split, config
    and columns). A folder in CLIP_benchmark's layout is read from its split folder (`split`, default test); the
    other columns name a datasets dataset's, and with shards they are refused. `classnames`: a file, a shipped or
    CLIP_benchmark name, else those beside the shards or the dataset's ClassLabel names. `check=False` leaves the
    shards' headers to the caller (`check_eval_shards`: the suite checks them across ranks, once they agree)."""
    classify = task == "zeroshot_classification" or (task == "linear_probe" and bool(classnames))
    if is_datasets_source(data):
        names = find_classnames(data, classnames) if task != "zeroshot_retrieval" and classnames else None
        source = DatasetSource.open(data, task, classnames=names, **columns)
        return source, source.classnames
    split = split_shards(data, columns.get("split") or "test")
    if split is not None:  # CLIP_benchmark's wds layout: the split names its folder
        columns = {**columns, "split": None}
    refuse_dataset_options(data, {DATASET_FLAGS[name]: value for name, value in columns.items()})
    shards = resolve_shards(split or data)
    if check:
        check_eval_shards(shards, task)
    if classify:
        return shards, find_classnames(data, classnames)
    return shards, None
