"""The one 🤗 `datasets` loader, used by training (data/streams/hf.py) and evaluation (eval/sources.py) alike.

Source detection (`is_datasets_source`, `open_split`): a folder written by `save_to_disk`, a folder of parquet or
arrow files or of images (imagefolder), a .parquet / .arrow / .csv / .json / .jsonl file, or a hub id. Split
selection: the one named, else the only one. Column checks, each a UsageError in one line: an image column (an
Image feature, image bytes, a path, or a {bytes, path} struct), a caption column (a string, or a List / LargeList /
Sequence of strings, per row), a label column (a ClassLabel, or class indices with class names given).
`Flags` names the command-line options a message speaks of (training's and eval's differ).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from disco_clip_ds.data.shards import IMAGE_EXTS, is_url
from disco_clip_ds.errors import UsageError

TEXT_DTYPES = ("string", "large_string")
BYTES_DTYPES = ("binary", "large_binary")
DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
# what makes a folder without .tar shards at its top a datasets folder: data files, or images (imagefolder)
FOLDER_DATA_SUFFIXES = {".parquet", ".arrow", *(f".{ext}" for ext in IMAGE_EXTS)}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "owner/name", as the hub spells them


@dataclass(frozen=True)
class Flags:
    """The options that name a source, its split and its config, as the command calling the loader spells them."""

    data: str = "--data"
    split: str = "--split"
    config: str = "--dataset_config_name"


def one_line(error: BaseException) -> str:
    """An exception's message on one line (datasets' messages span several)."""
    return " ".join(str(error).split()) or type(error).__name__


def is_saved_folder(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


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
        return is_saved_folder(path) or any(p.suffix.lower() in FOLDER_DATA_SUFFIXES for p in path.rglob("*"))
    return not data.startswith(("/", ".", "~")) and bool(_HUB_ID.match(data))


def open_split(
    data: str,
    split: str | None = None,
    config: str | None = None,
    *,
    streaming: bool = True,
    num_shards: int = 1,
    flags: Flags = Flags(),
):
    """(dataset, its number of rows or None, folder for relative image paths) of split `split` (default: the only
    one) of `data`. A save_to_disk folder is memory-mapped (streamed as `num_shards` contiguous shards when
    `streaming`); files, folders of data files and hub ids are read by `datasets.load_dataset`, only the split
    asked for. Anything datasets cannot open is a UsageError in one line."""
    import datasets

    path = Path(data)
    base = str(path.resolve()) if path.is_dir() else str(Path.cwd())
    refuse_empty(path, flags)
    if path.is_file() or (path.suffix in DATA_FILE_BUILDERS and not path.is_dir()):
        return open_file(path, split or "train", streaming, flags)
    if is_saved_folder(path):
        if config:
            raise UsageError(f"{flags.config} {config}: '{data}' is a save_to_disk folder, without configs")
        found = _load(datasets.load_from_disk, flags, data, str(path))
        if isinstance(found, datasets.DatasetDict):
            found = found[pick_split(list(found), split, data, flags)]
        rows = len(found)
        if streaming:  # one shard per reader: each reads a contiguous part, no row read twice
            found = found.to_iterable_dataset(num_shards=max(1, min(rows, num_shards)))
        return found, rows, base
    splits = _load(datasets.get_dataset_split_names, flags, data, data, config)
    split = pick_split(splits, split, data, flags)
    found = _load(datasets.load_dataset, flags, data, data, config, split=split, streaming=streaming)
    if not streaming:
        return found, len(found), base
    info = (found.info.splits or {}).get(split)
    rows = getattr(info, "num_examples", None) or None
    if rows is None and path.is_dir():  # a local folder's split: its parquet files' footers say how many rows
        builder = _load(datasets.load_dataset_builder, flags, data, data, config)
        rows = parquet_rows(builder.config.data_files.get(split) or [])
    return found, rows, base


def open_file(path: Path, split: str, streaming: bool, flags: Flags):
    """(dataset, rows or None, its folder) of one data file, read as split `split`."""
    import datasets

    builder = DATA_FILE_BUILDERS.get(path.suffix)
    if builder is None:
        *others, last = DATA_FILE_BUILDERS
        raise UsageError(f"{flags.data} {path}: give a {', '.join(others)} or {last} file")
    if not path.is_file():
        raise UsageError(f"{flags.data} {path}: no such file")
    refuse_empty(path, flags)
    found = _load(datasets.load_dataset, flags, str(path), builder, data_files={split: str(path)}, split=split,
                  streaming=streaming)  # fmt: skip
    return found, parquet_rows([path]) if streaming else len(found), str(path.parent.resolve())


def refuse_empty(path: Path, flags: Flags) -> None:
    """A UsageError saying that local data `path` has 0 rows, told before `datasets` reads it: on an empty file or
    folder it fails with messages that name no cause ("list index out of range", "StopIteration", "An error
    occurred while generating the dataset")."""
    if path.exists() and has_no_rows(path):
        raise UsageError(f"{flags.data} {path}: it has 0 rows: give a dataset that holds samples")


def has_no_rows(path: Path) -> bool:
    """Whether local data `path` (a data file, a save_to_disk folder, a folder of data files) certainly holds no row,
    from file footers, save_to_disk's state.json and text sizes, reading no row. False when unsure."""
    import json

    if is_saved_folder(path):
        states = list(path.rglob("state.json"))
        return bool(states) and all(not json.loads(s.read_text()).get("_data_files") for s in states)
    if path.is_dir():
        files = [f for f in path.rglob("*") if f.suffix in DATA_FILE_BUILDERS and f.is_file()]
        return bool(files) and all(_file_has_no_rows(f) for f in files)
    return path.is_file() and _file_has_no_rows(path)


def _file_has_no_rows(path: Path) -> bool:
    if path.suffix == ".parquet":
        return parquet_rows([path]) == 0
    if path.suffix in (".json", ".jsonl", ".csv") and path.stat().st_size < (1 << 20):  # larger: it holds rows
        lines = [line for line in path.read_bytes().splitlines() if line.strip()]
        return len(lines) <= (1 if path.suffix == ".csv" else 0) or b"".join(lines).strip() in (b"[]", b"{}")
    return False


def parquet_rows(files) -> int | None:
    """The rows of local parquet files, from their footers (no row is read), or None when any of `files` is
    something else (a stream of csv or json has no count until it is read)."""
    import pyarrow.parquet as pq

    files = [Path(f) for f in files]
    if not files or not all(f.suffix == ".parquet" and f.is_file() for f in files):
        return None
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _load(call, flags: Flags, data: str, *args, **kwargs):
    """`call(*args, **kwargs)`, its failure (not found, offline, a bad config, damaged or malformed files: datasets
    raises many types for them) a one-line UsageError."""
    try:
        return call(*args, **kwargs)
    except Exception as error:
        where = "" if Path(data).exists() else "no such local folder or file, and as a hub dataset: "
        hint = f"; pass {flags.config} NAME" if "Config name is missing" in str(error) else ""
        raise UsageError(f"{flags.data} {data}: {where}{one_line(error)}{hint}") from error


def pick_split(splits: list[str], split: str | None, data: str, flags: Flags) -> str:
    """`split` once `splits` has it; by default the only one."""
    if split is None:
        if len(splits) != 1:
            raise UsageError(f"'{data}' has splits {', '.join(splits)}: pass {flags.split} NAME")
        return splits[0]
    if split not in splits:
        raise UsageError(f"{flags.split} {split}: '{data}' has no such split (its splits: {', '.join(splits)})")
    return split


def resolved_features(dataset):
    """(dataset, its features): a stream whose types are known only once read (json, csv) gets them from its
    first rows."""
    if dataset.features is None:
        dataset = dataset._resolve_features()  # datasets has no public call for it
    return dataset, dataset.features


# ------------------------------------------------------------------------------------------- column checks


def describe(feature) -> str:
    """A feature in a few words: `int64`, `lists of string`, `Image`."""
    inner = getattr(feature, "feature", None)
    if inner is not None:
        return f"lists of {describe(inner)}"
    if isinstance(feature, list) and len(feature) == 1:
        return f"lists of {describe(feature[0])}"
    return getattr(feature, "dtype", None) or type(feature).__name__


def is_text(feature) -> bool:
    """A string feature."""
    from datasets import Value

    return isinstance(feature, Value) and feature.dtype in TEXT_DTYPES


def is_captions(feature) -> bool:
    """A string, or a list (List, LargeList, Sequence, or the old `[Value("string")]` spelling) of strings."""
    from datasets import LargeList, List, Sequence

    if isinstance(feature, list) and len(feature) == 1:
        return is_text(feature[0])
    return is_text(feature) or (isinstance(feature, (List, LargeList, Sequence)) and is_text(feature.feature))


def image_kind(feature) -> str | None:
    """How a column holds images: "image" (an Image feature, or the {bytes, path} struct it is stored as, which
    files written without datasets' metadata, by pyarrow or pandas, hold as a plain struct), "bytes", "path" (a
    string), or None when it holds none of these."""
    from datasets import Image

    if isinstance(feature, Image) or is_image_struct(feature):
        return "image"
    dtype = getattr(feature, "dtype", None)
    return "bytes" if dtype in BYTES_DTYPES else "path" if dtype in TEXT_DTYPES else None


def is_image_struct(feature) -> bool:
    """A plain struct of `bytes` (binary) and `path` (a string, or nulls only: pyarrow types a column of None as
    null): how an Image column is stored, here without the metadata that would make it one."""
    if not (isinstance(feature, dict) and set(feature) == {"bytes", "path"}):
        return False
    data, path = (getattr(feature[key], "dtype", None) for key in ("bytes", "path"))
    return data in BYTES_DTYPES and path in (*TEXT_DTYPES, "null")


def named_column(features, name: str, flag: str, data: str):
    """The feature of column `name`; a UsageError listing the columns there are when it has none."""
    if name not in features:
        raise UsageError(f"{flag} {name}: no such column in '{data}' (its columns: {', '.join(features)})")
    return features[name]


def only_column(features, found: list[str], kind: str, flag: str, data: str) -> str:
    """The only column of `found` (those of one kind); a UsageError when there are none or several."""
    if len(found) != 1:
        which = f"several {kind} columns ({', '.join(found)})" if found else f"no {kind} column"
        raise UsageError(f"'{data}' has {which}: pass {flag} NAME (its columns: {', '.join(features)})")
    return found[0]


def image_column(features, name: str | None, data: str) -> str:
    """The image column: `name` once it holds images, else the only Image column (or {bytes, path} struct)."""
    if name is None:
        found = [column for column, feature in features.items() if image_kind(feature) == "image"]
        return only_column(features, found, "Image", "--image_column", data)
    feature = named_column(features, name, "--image_column", data)
    if image_kind(feature) is None:
        raise UsageError(f"--image_column {name} holds {describe(feature)}, neither images nor image bytes or paths")
    return name


def caption_column(features, name: str | None, data: str, image: str) -> str:
    """The caption column: `name` once it holds captions, else the only caption column besides `image`."""
    if name is None:
        found = [column for column, feature in features.items() if column != image and is_captions(feature)]
        return only_column(features, found, "caption (string or list of strings)", "--caption_column", data)
    feature = named_column(features, name, "--caption_column", data)
    if not is_captions(feature):
        raise UsageError(
            f"--caption_column {name} holds {describe(feature)}: it must hold a string or a list of strings"
        )
    return name


def label_column(features, name: str | None, data: str, classnames) -> tuple[str, list[str]]:
    """(the class column, the class names): a ClassLabel (its names unless `classnames` are given), or class
    indices with `classnames`; by default the only ClassLabel."""
    from datasets import ClassLabel, Value

    if name is None:
        found = [column for column, feature in features.items() if isinstance(feature, ClassLabel)]
        name = only_column(features, found, "ClassLabel", "--label_column", data)
    feature = named_column(features, name, "--label_column", data)
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


def resolve_path(path: str, base: str) -> Path:
    """An image path of a dataset: absolute, or relative to the dataset's folder `base`."""
    return Path(path) if Path(path).is_absolute() else Path(base) / path


# ------------------------------------------------------------------------------------------------ training


@dataclass
class HFData:
    """A training dataset found and checked by `load_training_dataset`."""

    dataset: object  # datasets.Dataset or datasets.IterableDataset, image column cast to Image(decode=False)
    description: str  # what the arguments named, for messages and run.json
    num_rows: int | None  # None: a stream of unknown length
    image_column: str
    caption_column: str
    image_kind: str  # "image" (an Image feature), "bytes" or "path"
    base_dir: str  # where relative image paths are found
    streaming: bool


def describe_source(data_args) -> str:
    """The training dataset the arguments name, in one line (its run.json `data`)."""
    if data_args.train_file:
        where = f"file {data_args.train_file}"
    else:
        config = f" ({data_args.dataset_config_name})" if data_args.dataset_config_name else ""
        where = f"{data_args.dataset_name}{config} split {data_args.train_split}"
    mode = ", streaming" if data_args.streaming else ""
    return f"datasets {where}, columns {data_args.image_column}/{data_args.caption_column}{mode}"


def load_training_dataset(data_args, num_readers: int) -> HFData:
    """Load the dataset the arguments name (--dataset_name or --train_file, --train_split) and check its columns
    before any training: a UsageError names the split or column that is missing (with those there are) or holds
    the wrong kind of values, and a dataset of known length with fewer rows than readers (ranks x DataLoader
    workers)."""
    import datasets

    split, streaming = data_args.train_split, data_args.streaming
    if data_args.train_file:
        data = data_args.train_file
        found, rows, base = open_file(Path(data), split, streaming, Flags(data="--train_file"))
    else:
        data = data_args.dataset_name
        flags = Flags(data="--dataset_name", split="--train_split")
        found, rows, base = open_split(
            data, split, data_args.dataset_config_name, streaming=streaming, num_shards=num_readers, flags=flags
        )
    found, features = resolved_features(found)
    image, captions = data_args.image_column, data_args.caption_column
    kind = image_kind(named_column(features, image, "--image_column", data))
    caption_column(features, captions, data, image)
    image_column(features, image, data)
    if kind == "path":
        first = _first_value(found, image)
        if first is None or not resolve_path(first, base).is_file():
            raise UsageError(
                f"--image_column {image} holds neither images nor paths: its first value {str(first)[:60]!r} is no "
                "file (paths are read relative to the dataset's folder)"
            )
    found = found.select_columns([image, captions])
    if kind == "image":  # bytes and path as stored: decoded by us, in the DataLoader workers
        found = found.cast_column(image, datasets.Image(decode=False))
    description = describe_source(data_args)
    if rows is not None and rows < num_readers:
        raise UsageError(
            f"{description} has {rows} rows, fewer than the {num_readers} readers (ranks x --dataloader_num_workers): "
            "use fewer ranks x workers, or more data"
        )
    return HFData(found, description, rows, image, captions, kind, base, streaming)


def _first_value(found, column: str):
    import datasets

    if isinstance(found, datasets.Dataset):
        return found[0][column] if len(found) else None
    return next(iter(found.select_columns([column]).take(1)), {}).get(column)
