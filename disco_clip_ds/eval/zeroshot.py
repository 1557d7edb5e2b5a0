"""Zero-shot classification and retrieval of a CLIPModel, with CLIP_benchmark's metrics and JSON layout.

Data are webdataset shards in CLIP_benchmark's layout: `key.{webp,png,jpg,jpeg}` with `key.cls` (class index)
for classification or `key.txt` (captions, one per line) for retrieval; `classnames.txt` and
`zeroshot_classification_templates.txt` (`{c}` = class name) next to the shards. ImageNet-1k class names and
OpenAI's 80 templates ship in `resources/` for users who bring their own ImageNet val shards.

Or a 🤗 `datasets` dataset (`DatasetSource`): a folder saved with `save_to_disk`, a parquet folder or data file,
or a hub id, with an image column and a `ClassLabel` column (class names from the feature) for classification,
or an image column and a caption column (a string or a list of strings per image) for retrieval. Templates come
from the same file beside it (in the folder, or beside the file), else OpenAI's.

Recall@k counts equal scores as CLIP_benchmark's code does (its `torch.topk` picks among them, see
`retrieval_metrics`), not in the model's favour: with repeated captions the numbers match CLIP_benchmark's.

Under ZeRO-3 every rank holds a slice of the weights and a forward is a collective, so the functions here
must run on every rank over the same data (they do: the shards are read whole on each rank, never split).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import TrainerCallback

from disco_clip_ds.checkpoint.layout import has_weights
from disco_clip_ds.data.shards import IMAGE_EXTS, is_url, write_json
from disco_clip_ds.errors import DataError, UsageError

RESOURCES = Path(__file__).resolve().parents[1] / "resources"
NAMED_CLASSNAMES = {"imagenet1k": RESOURCES / "imagenet1k_classnames.txt"}
NAMED_TEMPLATES = {"openai_imagenet": RESOURCES / "openai_imagenet_templates.txt"}
CLASSNAMES_FILE = "classnames.txt"  # CLIP_benchmark's names for the files beside the shards
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
RECALL_KS = (1, 5, 10)


# ---------------------------------------------------------------------------------------------- metrics


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """acc1, acc5 and mean_per_class_recall of (n, n_classes) logits, as CLIP_benchmark reports them.

    acc5 is NaN with fewer than 5 classes (CLIP_benchmark's convention); mean_per_class_recall is the mean
    over the classes present in `targets` of the fraction of their images predicted right.
    """
    from sklearn.metrics import balanced_accuracy_score

    targets = targets.long()
    n_classes = logits.shape[1]
    # rank of the true class = number of classes scored strictly higher (ties count in the model's favour)
    true_scores = logits.gather(1, targets[:, None])
    rank = (logits > true_scores).sum(1)
    metrics = {"acc1": (rank < 1).double().mean().item()}
    metrics["acc5"] = (rank < 5).double().mean().item() if n_classes >= 5 else float("nan")
    with warnings.catch_warnings():  # predicting a class absent from the targets is normal here, not a problem
        warnings.filterwarnings("ignore", message="y_pred contains classes not in y_true")
        metrics["mean_per_class_recall"] = float(balanced_accuracy_score(targets.numpy(), logits.argmax(1).numpy()))
    return metrics


def _hits_in_top_k(scores: torch.Tensor, positives: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, whether one of its positive columns is among the `k` that `torch.topk` returns for it (all
    columns when `k` exceeds them): CLIP_benchmark's `recall_at_k` rule, on the same scores."""
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return positives.gather(1, top).any(1)


def retrieval_metrics(
    scores: torch.Tensor, text_to_image: torch.Tensor, ks: Sequence[int] = RECALL_KS
) -> dict[str, float]:
    """CLIP_benchmark's image/text_retrieval_recall@k from (n_texts, n_images) similarity `scores`.

    `text_to_image[t]` is the image that caption t describes (an image may have several captions).
    image_retrieval_recall@k: fraction of captions whose image is among their top-k images;
    text_retrieval_recall@k: fraction of images with at least one of their captions among their top-k texts.

    Equal scores follow CLIP_benchmark's convention (`recall_at_k` in clip_benchmark/metrics/zeroshot_retrieval.py):
    the top-k of a row are the k columns that `torch.topk` returns, so of a positive tied with negatives at the k-th
    place only the ones topk picks count, never all of them in the model's favour. Repeated captions make such ties
    common in text retrieval. Which of equal scores topk picks is torch's choice (on CPU not the lowest index), so
    the numbers match CLIP_benchmark's on the same scores and torch build. A k above the number of candidates counts
    them all (CLIP_benchmark refuses it).
    """
    n_texts, n_images = scores.shape
    positives = torch.zeros_like(scores, dtype=torch.bool)
    positives[torch.arange(n_texts), text_to_image] = True
    metrics = {}
    for k in ks:
        metrics[f"image_retrieval_recall@{k}"] = _hits_in_top_k(scores, positives, k).double().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = _hits_in_top_k(scores.T, positives.T, k).double().mean().item()
    return metrics


# --------------------------------------------------------------------------------------------- encoding


def _unwrap(model):
    """The CLIPModel or SiglipModel inside a DeepSpeed engine or DDP wrapper (both keep it as `.module`)."""
    while hasattr(model, "module") and not hasattr(model, "get_image_features"):
        model = model.module
    return model


def _first_param(model) -> torch.Tensor:
    return next(model.parameters())


@torch.no_grad()
def encode_images(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """L2-normalised float32 image embeddings."""
    model = _unwrap(model)
    param = _first_param(model)
    out = model.get_image_features(pixel_values=pixel_values.to(param.device, param.dtype)).pooler_output
    return F.normalize(out.float(), dim=-1).cpu()


@torch.no_grad()
def encode_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    """L2-normalised float32 text embeddings of `texts`, in batches. SigLIP's text is padded to its fixed length,
    as it was trained (its text tower pools the last position); CLIP's to the longest in the batch."""
    model = _unwrap(model)
    device = _first_param(model).device
    max_length = model.config.text_config.max_position_embeddings
    padding = "max_length" if model.config.model_type == "siglip" else True
    chunks = []
    for start in range(0, len(texts), batch_size):
        tokens = tokenizer(
            list(texts[start : start + batch_size]),
            padding=padding,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        ).to(device)
        out = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        out = out.pooler_output  # transformers 5: a model output whose pooler_output is the projected embedding
        chunks.append(F.normalize(out.float(), dim=-1).cpu())
    return torch.cat(chunks)


def zeroshot_classifier(
    model, tokenizer, classnames: Sequence[str], templates: Sequence[str], batch_size: int = 256
) -> torch.Tensor:
    """(n_classes, d) classifier: per class, the renormalised mean of its normalised prompt embeddings."""
    prompts = [template.format(c=name) for name in classnames for template in templates]
    embeddings = encode_texts(model, tokenizer, prompts, batch_size).view(len(classnames), len(templates), -1)
    return F.normalize(embeddings.mean(1), dim=-1)


# ------------------------------------------------------------------------------------------------- data


def resolve_shards(spec: str | Sequence[str]) -> list[str]:
    """Shards from the project's shard syntax (a folder, `dir/{00000..00009}.tar`, sources joined by '::'; see
    `data.shards.expand_shards`) or a list of such specs; local shards must exist (else UsageError)."""
    from disco_clip_ds.data.shards import expand_shards

    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    try:
        urls = [url for item in specs for url in expand_shards(str(item))]
    except (ValueError, FileNotFoundError) as e:  # an empty spec, a folder without shards
        raise UsageError(str(e)) from e
    missing = [url for url in urls if not is_url(url) and not os.path.isfile(url)]
    if missing:
        raise UsageError(
            f"{len(missing)} of {len(urls)} shards not found, e.g. '{missing[0]}': give a folder of .tar shards "
            "or a brace pattern"
        )
    return urls


_TASK_FIELD = {"zeroshot_classification": "cls", "zeroshot_retrieval": "txt"}


def check_eval_shards(urls: Sequence[str], task: str) -> None:
    """Read each local shard's member list before any model is loaded. webdataset would otherwise stop mid-way
    with a traceback on a truncated tar (its reader cannot tell a cut file from the end of a shard), or find no
    sample with the field the task needs only after encoding every image."""
    need = _TASK_FIELD[task]
    for url in urls:
        if is_url(url):
            continue
        try:
            with tarfile.open(url, "r:") as tar:
                members = tar.getmembers()
        except (tarfile.TarError, OSError) as e:
            raise DataError(f"shard '{url}' is truncated or not a tar ({e}): re-create or remove it") from e
        size = os.path.getsize(url)
        if any(m.offset_data + m.size > size for m in members):  # tarfile lists a cut-off member without error
            raise DataError(f"shard '{url}' is truncated ({size} bytes): re-create or remove it")
        fields = {name.rsplit(".", 1)[-1] for name in (m.name for m in members) if "." in name}
        if fields and need not in fields:
            other = "zeroshot_retrieval" if task == "zeroshot_classification" else "zeroshot_classification"
            layout = (
                "KEY.jpg + KEY.cls (class index)" if need == "cls" else "KEY.jpg + KEY.txt (captions, one per line)"
            )
            hint = f"; it has .{_TASK_FIELD[other]}: use --task {other}" if _TASK_FIELD[other] in fields else ""
            raise UsageError(
                f"shard '{url}' has no .{need} members, which --task {task} reads (expected {layout}){hint}"
            )


def _every_node(urls):
    # Evaluation reads every shard on every rank: under ZeRO-3 all ranks must run the same forwards.
    yield from urls


def shard_batches(shards, image_processor, fields: str, batch_size: int) -> Iterator[tuple[torch.Tensor, list]]:
    """(pixel_values, [class index or caption list]) batches read in order from the shards.

    `fields` is "cls" or "txt"."""
    import webdataset as wds

    dataset = (
        wds.WebDataset(
            resolve_shards(shards), shardshuffle=False, nodesplitter=_every_node, workersplitter=None, empty_check=False
        )
        .decode("pil")
        .to_tuple(";".join(IMAGE_EXTS), fields)
        .batched(batch_size, collation_fn=None, partial=True)
    )
    for batch in dataset:
        images, values = zip(*batch)
        if fields == "txt":
            values = [[line.strip() for line in text.splitlines() if line.strip()] for text in values]
        yield _pixels(image_processor, images), list(values)


def _pixels(image_processor, images) -> torch.Tensor:
    return image_processor(images=[image.convert("RGB") for image in images], return_tensors="pt")["pixel_values"]


def _progress(batches, desc: str, enabled: bool):
    rank = int(os.environ.get("RANK", "0"))
    return tqdm(batches, desc=desc, unit="batch", disable=not enabled or rank != 0, file=sys.stderr)


def _as_batches(data, image_processor, fields: str, batch_size: int):
    """Batches from a shard spec, a 🤗 datasets source (a DatasetSource, or a string naming one, opened with
    its columns detected) or, as given, an iterable of batches."""
    is_spec = isinstance(data, (str, os.PathLike)) or (
        isinstance(data, (list, tuple)) and data and isinstance(data[0], (str, os.PathLike))
    )
    if (is_spec or isinstance(data, DatasetSource)) and image_processor is None:
        raise ValueError(
            "reading images needs the model's image_processor (e.g. AutoImageProcessor.from_pretrained(model_dir))"
        )
    if isinstance(data, (str, os.PathLike)) and is_datasets_source(str(data)):
        task = "zeroshot_classification" if fields == "cls" else "zeroshot_retrieval"
        data = DatasetSource.open(str(data), task)
    if isinstance(data, DatasetSource):
        return data.batches(image_processor, batch_size)
    if is_spec:
        return shard_batches(data, image_processor, fields, batch_size)
    return data


# ---------------------------------------------------------------------------------- 🤗 datasets sources

DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "owner/name", as the hub spells them


def _saved_to_disk(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


# what makes a folder without .tar shards at its top a datasets folder: data files, or images (imagefolder)
FOLDER_DATA_SUFFIXES = {".parquet", ".arrow", *(f".{ext}" for ext in IMAGE_EXTS)}


def is_datasets_source(data: str) -> bool:
    """Whether `data` names a 🤗 datasets dataset rather than webdataset shards: a folder saved with
    `save_to_disk`, a folder without .tar shards at its top that holds parquet or arrow files or images
    (`imagefolder`: class subfolders, or a metadata.jsonl), a parquet / arrow / csv / json file, or, where no
    such local path exists, a hub id ("name" or "owner/name")."""
    if "::" in data or "{" in data or data.endswith(".tar") or is_url(data):
        return False
    path = Path(data)
    if path.is_file():
        return path.suffix in DATA_FILE_BUILDERS
    if path.is_dir():
        if any(path.glob("*.tar")):
            return False
        return _saved_to_disk(path) or any(p.suffix.lower() in FOLDER_DATA_SUFFIXES for p in path.rglob("*"))
    return not data.startswith(("/", ".", "~")) and bool(_HUB_ID.match(data))


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _columns(features) -> str:
    return ", ".join(features)


def _is_text(feature) -> bool:
    from datasets import Value

    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def _is_captions(feature) -> bool:
    """A string, or a list of strings, per row."""
    from datasets import LargeList, List

    if isinstance(feature, list) and len(feature) == 1:  # the old `[Value("string")]` spelling
        return _is_text(feature[0])
    return _is_text(feature) or (isinstance(feature, (List, LargeList)) and _is_text(feature.feature))


def _is_image_like(feature) -> bool:
    """An Image feature, or what `datasets.Image` casts from: image bytes, a path, or a {bytes, path} struct."""
    from datasets import Image, Value

    if isinstance(feature, Image):
        return True
    if isinstance(feature, Value):
        return feature.dtype in ("string", "large_string", "binary", "large_binary")
    return isinstance(feature, dict) and set(feature) == {"bytes", "path"}


def _split_of(loaded, data: str, split: str | None):
    """The split named `split` (default: the only one) of what datasets loaded."""
    from datasets import DatasetDict, IterableDatasetDict

    if isinstance(loaded, (DatasetDict, IterableDatasetDict)):
        splits = dict(loaded)
    else:  # one Dataset saved without a DatasetDict around it
        splits = {str(loaded.split) if loaded.split else "train": loaded}
    if split is None:
        if len(splits) != 1:
            raise UsageError(f"'{data}' has splits {', '.join(splits)}: pass --split NAME")
        split = next(iter(splits))
    if split not in splits:
        raise UsageError(f"--split {split}: '{data}' has no such split (its splits: {', '.join(splits)})")
    dataset = splits[split]
    if dataset.features is None:  # a streamed json/csv whose types datasets has not read yet
        dataset = dataset._resolve_features()
    return dataset


def load_eval_dataset(data: str, split: str | None = None, config: str | None = None):
    """One split of a 🤗 datasets source (see `is_datasets_source`). Files and hub ids are streamed, so nothing
    is copied into the datasets cache and no other split is downloaded; a `save_to_disk` folder is memory-mapped.
    Anything datasets cannot open is a UsageError in one line."""
    import datasets

    path = Path(data)
    try:
        if path.is_dir() and _saved_to_disk(path):
            if config:
                raise UsageError(f"--dataset_config_name {config}: '{data}' is a save_to_disk folder, without configs")
            loaded = datasets.load_from_disk(data)
        elif path.is_file():
            loaded = datasets.load_dataset(DATA_FILE_BUILDERS[path.suffix], data_files=data, streaming=True)
        else:  # a folder of data files, or a hub id
            loaded = datasets.load_dataset(data, name=config, streaming=True)
    except (OSError, ValueError) as e:  # not found / offline (ConnectionError, DatasetNotFoundError), a bad config
        where = "" if path.exists() else "no such local folder or file, and as a hub dataset: "
        hint = "; pass --dataset_config_name NAME" if "Config name is missing" in str(e) else ""
        raise UsageError(f"--data {data}: {where}{_one_line(e)}{hint}") from e
    return _split_of(loaded, data, split)


@dataclass
class DatasetSource:
    """A 🤗 datasets eval set, its columns checked: `image_column` and `value_column` (the ClassLabel for
    zero-shot classification, the captions for retrieval). `classnames` are the ClassLabel's names, or the
    ones given. Open one with `DatasetSource.open`; read it in order, whole, on every rank."""

    dataset: object
    name: str
    task: str
    image_column: str
    value_column: str
    classnames: list[str] | None = None

    @classmethod
    def open(
        cls,
        data: str,
        task: str,
        *,
        split: str | None = None,
        config: str | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
        caption_column: str | None = None,
        classnames: Sequence[str] | None = None,
    ) -> "DatasetSource":
        """Load `data` and pick its columns: each named one must exist and hold the right kind of values; one
        not named is the only column of its kind (the only Image column, the only ClassLabel, the only string or
        list-of-strings column besides the image). Every problem is a UsageError in one line."""
        dataset = load_eval_dataset(data, split, config)
        features = dataset.features
        image = _image_column(features, image_column, data)
        if task == "zeroshot_classification":
            value, names = _label_column(features, label_column, data, classnames)
        else:
            value, names = _caption_column(features, caption_column, data, image), None
        return cls(dataset, data, task, image, value, names)

    def batches(self, image_processor, batch_size: int) -> Iterator[tuple[torch.Tensor, list]]:
        """(pixel_values, [class index or caption list]) batches, in the dataset's order."""
        from datasets import Image

        dataset = self.dataset.select_columns([self.image_column, self.value_column])
        if not isinstance(dataset.features[self.image_column], Image):
            dataset = dataset.cast_column(self.image_column, Image())  # decode bytes or paths as an Image column
        row = 0
        for batch in dataset.iter(batch_size=batch_size):
            images, values = batch[self.image_column], batch[self.value_column]
            if any(image is None for image in images):
                missing = row + next(i for i, image in enumerate(images) if image is None)
                raise DataError(f"row {missing} of '{self.name}' has no image in column '{self.image_column}'")
            if self.task == "zeroshot_retrieval":
                values = [_caption_list(caption) for caption in values]
            row += len(images)
            yield _pixels(image_processor, images), list(values)


def _caption_list(value) -> list[str]:
    """A row's captions: one string is one caption (CLIP_benchmark counts several per image as a list)."""
    texts = [value] if isinstance(value, str) else list(value or [])
    return [text.strip() for text in texts if text and text.strip()]


def _named(features, name: str, flag: str, data: str):
    if name not in features:
        raise UsageError(f"{flag} {name}: no such column in '{data}' (its columns: {_columns(features)})")
    return features[name]


def _only(features, found: list[str], kind: str, flag: str, data: str) -> str:
    if len(found) != 1:
        which = f"several {kind} columns ({', '.join(found)})" if found else f"no {kind} column"
        raise UsageError(f"'{data}' has {which}: pass {flag} NAME (its columns: {_columns(features)})")
    return found[0]


def _image_column(features, name: str | None, data: str) -> str:
    from datasets import Image

    if name is None:
        found = [column for column, feature in features.items() if isinstance(feature, Image)]
        return _only(features, found, "Image", "--image_column", data)
    feature = _named(features, name, "--image_column", data)
    if not _is_image_like(feature):
        raise UsageError(f"--image_column {name} holds {feature}, neither images nor image bytes or paths")
    return name


def _label_column(features, name: str | None, data: str, classnames) -> tuple[str, list[str]]:
    from datasets import ClassLabel, Value

    if name is None:
        found = [column for column, feature in features.items() if isinstance(feature, ClassLabel)]
        name = _only(features, found, "ClassLabel", "--label_column", data)
    feature = _named(features, name, "--label_column", data)
    if isinstance(feature, ClassLabel):
        return name, list(classnames) if classnames else list(feature.names)
    if not (isinstance(feature, Value) and feature.dtype.startswith(("int", "uint"))):
        raise UsageError(f"--label_column {name} holds {feature}: it must hold class indices (a ClassLabel)")
    if not classnames:
        raise UsageError(
            f"--label_column {name} is {feature}, not a ClassLabel with class names: pass --classnames FILE "
            "(one name per class index, or imagenet1k)"
        )
    return name, list(classnames)


def _caption_column(features, name: str | None, data: str, image: str) -> str:
    if name is None:
        found = [column for column, feature in features.items() if column != image and _is_captions(feature)]
        return _only(features, found, "caption (string or list of strings)", "--caption_column", data)
    feature = _named(features, name, "--caption_column", data)
    if not _is_captions(feature):
        raise UsageError(f"--caption_column {name} holds {feature}: it must hold a string or a list of strings")
    return name


# ------------------------------------------------------------------------------------------------ tasks


class _EvalMode:
    """Switch a model to eval() for the duration, restoring its training flag after."""

    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


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
    with _EvalMode(_unwrap(model)):
        classifier = zeroshot_classifier(model, tokenizer, classnames, templates, batch_size=max(batch_size, 64))
        logits, targets = [], []
        for pixel_values, labels in _progress(
            _as_batches(data, image_processor, "cls", batch_size), "zero-shot", progress
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
    with _EvalMode(_unwrap(model)):
        for pixel_values, captions in _progress(
            _as_batches(data, image_processor, "txt", batch_size), "retrieval", progress
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


# ---------------------------------------------------------------------------------------------- helpers


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


# -------------------------------------------------------------------------------------------- callback


class ZeroShotCallback(TrainerCallback):
    """Zero-shot classification every `every_n_steps` optimizer steps (and at the last), logged like the loss.

    `data_dir` is what `disco-clip eval --data` takes: shards, or a 🤗 datasets source (then `split`, `config`,
    `image_column` and `label_column` as `DatasetSource.open` takes them; by default the only split and column
    of each kind). Runs on every rank (ZeRO-3 forwards are collectives) and logs through `trainer.log`, so the
    metrics reach the console, TensorBoard and `trainer_state.json` as `zeroshot_acc1` etc. Register it with
    `ZeroShotCallback(...).attach(trainer)`, which also gives it the trainer to log through.
    """

    def __init__(
        self,
        data_dir,
        tokenizer,
        image_size: int,
        every_n_steps: int,
        batch_size: int = 64,
        image_processor=None,
        classnames=None,
        templates=None,
        *,
        split: str | None = None,
        config: str | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
    ):
        from transformers import CLIPImageProcessor

        if every_n_steps <= 0:
            raise UsageError(f"every_n_steps must be positive, got {every_n_steps}")
        self.data = str(data_dir)
        if is_datasets_source(self.data):
            self.source = DatasetSource.open(
                self.data,
                "zeroshot_classification",
                split=split,
                config=config,
                image_column=image_column,
                label_column=label_column,
                classnames=find_classnames(self.data, classnames) if classnames else None,
            )
            self.classnames = self.source.classnames
        else:
            _refuse_dataset_options(
                self.data,
                {"split": split, "config": config, "image_column": image_column, "label_column": label_column},
            )
            self.source = resolve_shards(self.data)
            self.classnames = find_classnames(self.data, classnames)
        self.templates = find_templates(self.data, templates)
        self.tokenizer = tokenizer
        self.image_processor = image_processor or CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
        self.every_n_steps, self.batch_size = every_n_steps, batch_size
        self.trainer = None

    def attach(self, trainer) -> "ZeroShotCallback":
        """Add this callback to `trainer` and log through it."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError(
                "ZeroShotCallback needs the trainer to log through: use ZeroShotCallback(...).attach(trainer)"
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every_n_steps and state.global_step != state.max_steps:
            return
        metrics = zeroshot_classification(
            model,
            self.tokenizer,
            self.source,
            self.classnames,
            self.templates,
            image_processor=self.image_processor,
            batch_size=self.batch_size,
            progress=False,
        )
        self.trainer.log({f"zeroshot_{name}": value for name, value in metrics.items()})


# ------------------------------------------------------------------------------------------------- CLI


@dataclass
class EvalArguments:
    model: str = field(metadata={"help": "exported model folder, Trainer checkpoint folder with weights, or hub id"})
    data: str = field(
        metadata={
            "help": "webdataset shards (a folder, 'dir/{00000..00009}.tar', or sources joined by '::'), or a datasets "
            "dataset: a save_to_disk or parquet folder, a parquet/arrow/csv/json file, or a hub id"
        }
    )
    task: str = field(
        default="zeroshot_classification", metadata={"choices": ["zeroshot_classification", "zeroshot_retrieval"]}
    )
    split: str | None = field(default=None, metadata={"help": "split of a datasets dataset (default: its only one)"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "config of a datasets dataset"})
    image_column: str | None = field(
        default=None, metadata={"help": "datasets: the image column (default: the only Image column)"}
    )
    label_column: str | None = field(
        default=None,
        metadata={"help": "datasets, zeroshot_classification: the class column (default: the only ClassLabel)"},
    )
    caption_column: str | None = field(
        default=None,
        metadata={
            "help": "datasets, zeroshot_retrieval: a string or list of strings per image (default: the only such "
            "column)"
        },
    )
    classnames: str | None = field(
        default=None,
        metadata={
            "help": "class names file or 'imagenet1k' (default: classnames.txt beside the shards, or a datasets "
            "ClassLabel's names)"
        },
    )
    templates: str | None = field(
        default=None, metadata={"help": "templates file or 'openai_imagenet' (default: beside the shards, or OpenAI's)"}
    )
    batch_size: int = field(default=64)
    output: str | None = field(default=None, metadata={"help": "write the CLIP_benchmark-style JSON here too"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})


def _refuse_dataset_options(data: str, given: dict[str, str | None]) -> None:
    """The split and column options ({flag: value}) read a datasets dataset; with shards they would be ignored,
    so refuse them."""
    used = [flag for flag, value in given.items() if value]
    if used:
        raise UsageError(f"{', '.join(used)}: for a datasets dataset, but '{data}' is webdataset shards")


def load_for_eval(model_id: str, device: str = "cpu"):
    """(CLIPModel or SiglipModel, tokenizer, image processor) from a folder or hub id, with transformers alone. A
    folder without full weights, or one transformers cannot read, is a UsageError saying what to pass instead."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    folder = Path(model_id)
    if folder.is_dir() and not has_weights(folder):
        hint = "a DeepSpeed checkpoint without full weights (ZeRO-3): " if (folder / "latest").is_file() else ""
        raise UsageError(
            f"no model weights in '{folder}' ({hint}run `disco-clip export {folder} OUT_DIR` and evaluate OUT_DIR)"
        )
    try:
        model = AutoModel.from_pretrained(model_id).to(device)
        return model, AutoTokenizer.from_pretrained(model_id), AutoImageProcessor.from_pretrained(model_id)
    except OSError as e:  # no such folder or hub id, or one without the config / processor files
        raise UsageError(f"--model {model_id}: {e}") from e


def run_eval(args: EvalArguments) -> dict:
    """Evaluate as the CLI does and return CLIP_benchmark's result record."""
    if args.batch_size <= 0:
        raise UsageError(f"--batch_size must be positive, got {args.batch_size}")
    classify = args.task == "zeroshot_classification"
    if is_datasets_source(args.data):
        data = DatasetSource.open(
            args.data,
            args.task,
            split=args.split,
            config=args.dataset_config_name,
            image_column=args.image_column,
            label_column=args.label_column,
            caption_column=args.caption_column,
            classnames=find_classnames(args.data, args.classnames) if classify and args.classnames else None,
        )
        classnames = data.classnames
    else:
        _refuse_dataset_options(
            args.data,
            {
                "--split": args.split,
                "--dataset_config_name": args.dataset_config_name,
                "--image_column": args.image_column,
                "--label_column": args.label_column,
                "--caption_column": args.caption_column,
            },
        )
        data = resolve_shards(args.data)
        check_eval_shards(data, args.task)
        classnames = find_classnames(args.data, args.classnames) if classify else None
    templates = find_templates(args.data, args.templates) if classify else None
    model, tokenizer, image_processor = load_for_eval(args.model, args.device)
    if classify:
        metrics = zeroshot_classification(
            model, tokenizer, data, classnames, templates, image_processor=image_processor, batch_size=args.batch_size
        )
    else:
        metrics = zeroshot_retrieval(
            model, tokenizer, data, image_processor=image_processor, batch_size=args.batch_size
        )
    return {
        "dataset": args.data,
        "model": args.model,
        "pretrained": args.model,
        "task": args.task,
        "metrics": metrics,
        "language": "en",
    }


def main(argv: list[str] | None = None) -> int:
    """`disco-clip eval`: print (and optionally write) the result record."""
    from transformers import HfArgumentParser

    try:
        (args,) = HfArgumentParser(EvalArguments, prog="disco-clip eval").parse_args_into_dataclasses(args=argv)
    except ValueError as e:  # HfArgumentParser's word for argument names it does not know
        raise UsageError(f"{e} (`disco-clip eval --help` lists the arguments)") from e
    record = run_eval(args)
    print(json.dumps(record, indent=2))
    if args.output:
        write_json(args.output, record)
    return 0
