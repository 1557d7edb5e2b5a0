"""Where evaluation reads its images: webdataset shards in CLIP_benchmark's layout, or a 🤗 `datasets` dataset.

Shards: `key.{webp,png,jpg,jpeg}` with `key.cls` (class index) for classification or `key.txt` (captions, one per
line: several per image) for retrieval. CLIP_benchmark's `wds_*` sets keep them in split folders, `DIR/test/` (and
`DIR/train/` for a linear probe), each with `nshards.txt` and `0.tar`, `1.tar`, ...; `split_shards` finds them.
A 🤗 datasets dataset (`DatasetSource`, loaded and checked by data/hf_io.py as training's is): an
image column and a `ClassLabel` column (class names from the feature) for classification, or an image column and a
caption column (a string or a list of strings per image) for retrieval.

Every rank learns a set's order and values (a local shard's member headers and labels or captions, each shard read by
one rank in a suite, `check_eval_shards`; a dataset's rows) and reads and decodes only the images of the batches it
encodes (`as_raw_batches`, then `decode_batch`;
eval/spread.py deals them out). Images are decoded as training decodes them (data/decode.py: the pixel cap, the
aspect bound, the conversions to RGB); an image that cannot be (truncated, a decompression bomb, not an image) is
skipped with its reason, logged, and counted: a decoded batch (`DecodedBatch`) is (pixel_values, values) of the
images that decoded, with the reasons of those skipped beside, and the tasks report the count as `skipped_images`."""

from __future__ import annotations

import functools
import logging
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from disco_clip_ds.data import hf_io
from disco_clip_ds.data.decode import BadImage, reason, whole_image
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import IMAGE_EXTS, expand_shards, is_url, missing_shards
from disco_clip_ds.data.streams.tar_samples import Member, raw_samples
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.eval.spread import across_ranks
from disco_clip_ds.texts import decode_text, read_text

TASK_FIELD = {"zeroshot_classification": "cls", "zeroshot_retrieval": "txt", "linear_probe": "cls"}
NSHARDS_FILE = "nshards.txt"  # CLIP_benchmark's count of a split's shards, named 0.tar .. N-1.tar
logger = logging.getLogger(__name__)


def split_shards(data: str, split: str = "test") -> str | None:
    """The shard spec of `split` in CLIP_benchmark's wds layout: `data/split/{0..N-1}.tar` when that folder has
    nshards.txt (every one of them is then read, a missing one refused), its `*.tar` files otherwise; None when
    `data` is not a local folder with that split folder."""
    folder = Path(data) / split
    if is_url(str(data)) or not folder.is_dir():
        return None
    count = folder / NSHARDS_FILE
    if count.is_file():
        text = read_text(count)
        try:
            n = int(text.strip())
        except ValueError as e:
            raise UsageError(f"'{count}' must hold the number of shards of the split, e.g. 4") from e
        if n < 1:
            raise UsageError(f"'{count}' says the split has {n} shards: give the number of its shards, e.g. 4")
        return str(folder / (f"{{0..{n - 1}}}.tar" if n > 1 else "0.tar"))
    return str(folder)


def resolve_shards(spec: str | Sequence[str]) -> list[str]:
    """Shards from the project's shard syntax (a folder, `dir/{00000..00009}.tar`, sources joined by '::'; see
    `data.shards.expand_shards`; a folder in CLIP_benchmark's layout stands for its test split) or a list of such
    specs; every local shard must exist (else UsageError).

    Training skips a missing shard of a pattern (img2dataset leaves one where a shard failed to download); an
    evaluation refuses it, because a metric over part of a benchmark is not that benchmark's number."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    specs = [split_shards(str(item)) or str(item) for item in specs]  # a CLIP_benchmark folder: its test split
    try:
        urls = [url for item in specs for url in expand_shards(item)]
    except (ValueError, FileNotFoundError) as e:  # an empty spec, a folder without shards
        raise UsageError(str(e)) from e
    missing = missing_shards(urls)
    if missing:
        raise UsageError(
            f"{len(missing)} of {len(urls)} shards not found, e.g. '{describe_source(missing[0])}': an evaluation "
            "reads every shard of its set (a metric over part of it is not the set's; training skips missing shards, "
            "evaluation does not): restore it, or give only the shards that exist"
        )
    return urls


def check_eval_shards(urls: Sequence[str], task: str, dealt: bool = False) -> None:
    """Read each local shard's member headers and the field the task needs (no image bytes) through the shard reader
    before any model forward: a truncated tar, a sample without an image or without that field would otherwise be
    found only after encoding the images before it. What was read is kept for the evaluation's read of the same shard
    (`raw_shard_batches`), up to KEPT_SAMPLES samples: the headers are read once. With `dealt` (a collective: every
    rank calls it with the same shards, as the suite does once the ranks agreed that the task opened everywhere) the
    shards are dealt out across ranks (eval/spread.py's `across_ranks`), every rank keeps what all of them read and
    raises the first shard's error; a shard's samples then travel to the other ranks only within its share of
    KEPT_SAMPLES (KEPT_SAMPLES / shards), so that what every rank receives stays within the bound."""
    need = TASK_FIELD[task]
    local = [url for url in urls if not is_url(url)]
    limit = KEPT_SAMPLES // max(1, len(local)) if dealt else KEPT_SAMPLES
    check = functools.partial(_checked_shard, need, task, limit)
    for url, (samples, error) in zip(local, across_ranks(check, local) if dealt else map(check, local)):
        if error is not None:
            raise error
        if samples is not None:
            _keep(url, need, samples)


def _checked_shard(need: str, task: str, limit: int, url: str) -> tuple[list[dict] | None, Exception | None]:
    """(the samples of shard `url` with `need` read, or None past `limit` of them; the error that refuses it, or
    None): returned, not raised, so that every rank learns it."""
    fields, incomplete, samples = set(), None, []
    try:
        for sample in _read(url, read=frozenset((need,))):
            samples.append(sample)
            fields |= sample.keys()
            if incomplete is None and not (need in sample and any(ext in sample for ext in IMAGE_EXTS)):
                incomplete = sample["__key__"]
    except DataError as error:
        return None, error
    if fields and need not in fields:
        other = "zeroshot_retrieval" if need == "cls" else "zeroshot_classification"
        layout = "KEY.jpg + KEY.cls (class index)" if need == "cls" else "KEY.jpg + KEY.txt (captions, one per line)"
        hint = f"; it has .{TASK_FIELD[other]}: use --task {other}" if TASK_FIELD[other] in fields else ""
        return None, UsageError(
            f"shard '{describe_source(url)}' has no .{need} members, which --task {task} reads (expected "
            f"{layout}){hint}"
        )
    if incomplete is not None:
        return None, DataError(
            f"sample {incomplete} of shard '{describe_source(url)}' has no image ({'/'.join(IMAGE_EXTS)}) or no "
            f".{need}: an evaluation reads every sample; re-create the shard"
        )
    return (samples if len(samples) <= limit else None), None


KEPT_SAMPLES = 200_000  # the checked samples kept for the evaluation's read, at most (a few hundred bytes each)
_kept: dict[tuple, list[dict]] = {}  # (url, field, size, mtime) -> the samples its check read, oldest first


def _stamp(url: str, field: str) -> tuple:
    stat = os.stat(url)
    return url, field, stat.st_size, stat.st_mtime_ns


def _keep(url: str, field: str, samples: list[dict]) -> None:
    stamp = _stamp(url, field)
    _kept.pop(stamp, None)  # re-inserted as the newest
    _kept[stamp] = samples
    while sum(map(len, _kept.values())) > KEPT_SAMPLES:
        del _kept[next(iter(_kept))]  # the oldest: its set is read again if it is evaluated after all


def _checked_samples(url: str, field: str) -> Iterable[dict]:
    """The samples of a shard with `field` read and its images left in it: those its check kept when the shard is
    as it was then (its size and time), else read now."""
    if not is_url(url):
        kept = _kept.pop(_stamp(url, field), None)
        if kept is not None:
            return kept
    return _read(url, read=frozenset((field,)))


def _read(url: str, read: bool | frozenset = True) -> Iterator[dict]:
    """The samples of one eval shard (`read` as `raw_samples` takes it); a damaged shard is a DataError naming it (its
    public description)."""
    try:
        yield from raw_samples(url, read=read)
    except (tarfile.TarError, OSError, ValueError) as e:
        raise DataError(
            f"shard '{describe_source(url)}' is truncated or not a tar ({e}): re-create or remove it"
        ) from e


def shard_batches(shards, image_processor, fields: str, batch_size: int) -> Iterator[tuple[torch.Tensor, list]]:
    """(pixel_values, [class index or caption list]) batches read in order from the shards, through the one shard
    reader. `fields` is "cls" or "txt"."""
    return map(functools.partial(decode_batch, image_processor), raw_shard_batches(shards, fields, batch_size))


def raw_shard_batches(shards, fields: str, batch_size: int) -> Iterator[tuple[list, list]]:
    """([image], [class index or caption list]) batches read in order from the shards, the images not decoded and,
    in a local shard, not read either (a `Member`, read by `decode_batch`): every rank reads the set's headers and
    values, and reads and decodes only the images of its own batches (eval/spread.py)."""
    images, values = [], []
    for url in resolve_shards(shards):
        shown = describe_source(url)  # once a shard: every rank reads every sample's values
        for sample in _checked_samples(url, fields):
            image = next((sample[ext] for ext in IMAGE_EXTS if ext in sample), None)
            if image is None or fields not in sample:
                raise DataError(f"sample {sample['__key__']} of shard '{shown}' has no image or no .{fields}")
            images.append(image)
            values.append(_value(sample[fields], fields, f"sample {sample['__key__']} of shard '{shown}'"))
            if len(images) == batch_size:
                yield images, values
                images, values = [], []
    if images:
        yield images, values


class DecodedBatch(tuple):
    """(pixel_values, values): a pair, as the batches a caller hands the tasks are; `skipped` beside it: the one-line
    reason of each image of the raw batch that did not decode."""

    skipped: list[str]

    def __new__(cls, pixel_values, values: list, skipped=()):
        batch = super().__new__(cls, (pixel_values, values))
        batch.skipped = list(skipped)
        return batch

    def __getnewargs__(self):
        return (*self, self.skipped)


def skipped_of(batch) -> list[str]:
    """The reasons of the images skipped in `batch`: a `DecodedBatch`'s, none for a batch decoded elsewhere."""
    return getattr(batch, "skipped", [])


def decode_batch(image_processor, batch: tuple[list, list]) -> DecodedBatch:
    """The `DecodedBatch` of a raw batch: its images (bytes, or datasets' {"bytes", "path"}) decoded (data/decode.py)
    and processed by the model's image processor, with the values of those that decoded; the one-line reason of each
    image that did not, each also logged. A batch whose every image is skipped holds one blank image and no values:
    under ZeRO-3 its rank must still forward, and a model takes no empty batch; `kept` drops its row."""
    images, values, skipped = [], [], []
    for image, value in zip(*batch):
        try:
            images.append(whole_image(_image_bytes(image)))
        except BadImage as error:
            skipped.append(str(error))
        except OSError as error:  # a datasets path that cannot be read
            skipped.append(f"unreadable image file ({reason(error)})")
        else:
            values.append(value)
            continue
        logger.warning("skipping an eval image: %s", skipped[-1])
    if not images:
        from PIL import Image

        images = [Image.new("RGB", (1, 1), (255, 255, 255))]
    return DecodedBatch(pixels(image_processor, images), values, skipped)


def kept(rows: torch.Tensor, batch) -> torch.Tensor:
    """The rows of a batch's outputs that belong to its values: all of them, but none for a batch whose every image
    was skipped (`decode_batch`: it forwards a blank image)."""
    return rows[: len(batch[1])]


def _image_bytes(image) -> bytes:
    """The encoded bytes of a shard's image (read here when it is a `Member`) or of datasets' undecoded Image value
    ({"bytes", "path"}: a path is read, through datasets' own opener where it is remote)."""
    if isinstance(image, Member):
        return image.read()
    if not isinstance(image, dict):
        return image
    if image.get("bytes") is not None:
        return image["bytes"]
    path = image.get("path")
    if not path:
        raise BadImage("a datasets image with neither bytes nor a path")
    from datasets.utils.file_utils import xopen

    with xopen(path, "rb") as f:
        return f.read()


def _value(data: bytes, field: str, where: str):
    """A class index (webdataset's decoder reads .cls as int(data)) or the captions of a .txt, one per line (UTF-8,
    by the one reader of text); `where` names the sample in the DataError of either that cannot be read."""
    if field == "cls":
        try:
            return int(data)
        except ValueError:
            raise DataError(f"{where}: its .cls is not a class index ({data[:20]!r}): re-create the shard") from None
    text = decode_text(data, f"{where}, its .txt", DataError)
    return [line.strip() for line in text.splitlines() if line.strip()]


def pixels(image_processor, images) -> torch.Tensor | dict[str, torch.Tensor]:
    """The model's pixel_values of RGB PIL `images` (data/decode.py's), by its own image processor; for SigLIP 2's
    (NaFlex) the whole image input, pixel_attention_mask and spatial_shapes with them, as a dict."""
    inputs = image_processor(images=images, return_tensors="pt")
    return dict(inputs) if "spatial_shapes" in inputs else inputs["pixel_values"]


def as_batches(data, image_processor, fields: str, batch_size: int):
    """Batches from a shard spec, a 🤗 datasets source (a DatasetSource, or a string naming one, opened with
    its columns detected) or, as given, an iterable of batches."""
    raw, decode = as_raw_batches(data, image_processor, fields, batch_size)
    return raw if decode is as_given else map(decode, raw)


def as_given(batch):
    """A batch that is decoded already (`as_raw_batches` of an iterable of batches)."""
    return batch


def as_raw_batches(data, image_processor, fields: str, batch_size: int) -> tuple[Iterable, Callable]:
    """(batches with their images not decoded yet, the function that decodes one) of what `as_batches` reads; an
    iterable of batches is returned as it is, with `as_given`: its batches are decoded already."""
    is_spec = isinstance(data, (str, os.PathLike)) or (
        isinstance(data, (list, tuple)) and data and isinstance(data[0], (str, os.PathLike))
    )
    if (is_spec or isinstance(data, DatasetSource)) and image_processor is None:
        raise ValueError(
            "reading images needs the model's image_processor (e.g. AutoImageProcessor.from_pretrained(model_dir))"
        )
    if isinstance(data, (str, os.PathLike)) and hf_io.is_datasets_source(str(data)):
        task = "zeroshot_classification" if fields == "cls" else "zeroshot_retrieval"
        data = DatasetSource.open(str(data), task)
    decode = functools.partial(decode_batch, image_processor)
    if isinstance(data, DatasetSource):
        return data.raw_batches(batch_size), decode
    if is_spec:
        return raw_shard_batches(data, fields, batch_size), decode
    return data, as_given


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
        dataset, _, _ = hf_io.open_split(data, split, config, streaming=True)
        dataset, features = hf_io.resolved_features(dataset)
        image = hf_io.image_column(features, image_column, data)
        if task in ("zeroshot_classification", "linear_probe"):
            value, names = hf_io.label_column(features, label_column, data, classnames)
        else:
            value, names = hf_io.caption_column(features, caption_column, data, image), None
        return cls(dataset, data, task, image, value, names)

    def batches(self, image_processor, batch_size: int) -> Iterator[tuple[torch.Tensor, list]]:
        """(pixel_values, [class index or caption list]) batches, in the dataset's order."""
        return map(functools.partial(decode_batch, image_processor), self.raw_batches(batch_size))

    def raw_batches(self, batch_size: int) -> Iterator[tuple[list[dict], list]]:
        """([image as datasets' {"bytes", "path"}], [class index or caption list]) batches, in the dataset's
        order, the images not decoded yet (`decode_batch` decodes them)."""
        from datasets import Image

        dataset = self.dataset.select_columns([self.image_column, self.value_column])
        dataset = dataset.cast_column(self.image_column, Image(decode=False))  # bytes or paths, decoded by the owner
        row = 0
        for batch in dataset.iter(batch_size=batch_size):
            images, values = batch[self.image_column], batch[self.value_column]
            if any(image is None for image in images):
                missing = row + next(i for i, image in enumerate(images) if image is None)
                raise DataError(f"row {missing} of '{self.name}' has no image in column '{self.image_column}'")
            if self.task == "zeroshot_retrieval":
                values = [caption_list(caption) for caption in values]
            row += len(images)
            yield list(images), list(values)


def caption_list(value) -> list[str]:
    """A row's captions: one string is one caption (CLIP_benchmark counts several per image as a list)."""
    texts = [value] if isinstance(value, str) else list(value or [])
    return [text.strip() for text in texts if text and text.strip()]


def refuse_dataset_options(data: str, given: dict[str, str | None]) -> None:
    """The split and column options ({flag: value}) read a datasets dataset; with shards they would be ignored,
    so refuse them."""
    used = [flag for flag, value in given.items() if value]
    if used:
        raise UsageError(f"{', '.join(used)}: for a datasets dataset, but '{data}' is webdataset shards")
