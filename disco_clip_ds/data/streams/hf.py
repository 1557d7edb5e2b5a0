"""Training stream from a 🤗 `datasets` dataset, named as transformers' run_clip.py names it: --dataset_name (a hub id,
a folder saved with `save_to_disk`, a parquet folder, an imagefolder with metadata.jsonl) or --train_file, with
--image_column and --caption_column.

`HFStream` yields what `ShardStream` yields, (pixel_values, caption, position row), with the same skip counters, the
same per-sample augmentation RNG rule (seeded from seed, pass and sample key) and the same DataError for a reader with
nothing readable, so that the trainer, the collator and the stream-state checkpointing treat both sources alike.
Images stay undecoded (`Image(decode=False)`) until a DataLoader worker decodes them with `ImageTransform`.

Readers (rank * DataLoader workers + worker) read disjoint rows:
- map-style: reader r takes rows r, r + readers, ...; each pass visits them in a permutation drawn from (seed,
  reader, pass). Its place is (pass, entries of the permutation done): exact, and a resume seeks by index.
- streaming: `datasets.distributed.split_dataset_by_node(rank=reader, world_size=readers)`, `set_epoch(pass)` for a
  fresh shard order per pass. datasets' own shuffle buffer is not restored exactly (its `load_state_dict` drops the
  buffer's content), so the stream is shuffled as ShardStream shuffles: blocks of `shuffle_buffer` raw rows, each
  permuted by (seed, reader, pass, block). The IterableDataset's `state_dict()` is taken at each block start, where
  it is exact; a resume loads it and reads on from that block, decoding only what is left of it.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from disco_clip_ds.data.shards import write_json
from disco_clip_ds.data.streams.shards import ReaderStream
from disco_clip_ds.data.streams.state import STATE_FILE, note_positions
from disco_clip_ds.data.transforms import MAX_IMAGE_PIXELS
from disco_clip_ds.errors import DataError, UsageError

logger = logging.getLogger(__name__)

# The streaming state_dict rides with each sample in the int64 position row (the batch carries tensors only, so that
# accelerate can dispatch it): its compact JSON, 8 bytes per int, zero-padded. A datasets state_dict is a nested
# dict whose shape changes during iteration (e.g. RebatchedArrowExamplesIterable's previous_state goes from None to a
# dict), so its integer leaves do not flatten into fixed fields; its JSON does, whatever datasets puts in it.
STATE_INTS = 128
MAP_FIELDS = ("reader", "count", "epoch", "offset")
STREAM_FIELDS = ("reader", "count", "epoch", "block", "offset")
TEXT_DTYPES = ("string", "large_string")
BYTES_DTYPES = ("binary", "large_binary")


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


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _is_saved_folder(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def _load(data_args, num_readers: int):
    """(dataset of the named split, known number of rows or None, folder for relative paths)."""
    import datasets

    split, streaming = data_args.train_split, data_args.streaming
    if data_args.train_file:
        path = Path(data_args.train_file)
        kind = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise UsageError(f"--train_file {path}: give a .csv, .json, .jsonl or .parquet file")
        if not path.is_file():
            raise UsageError(f"--train_file {path}: no such file")
        try:
            found = datasets.load_dataset(kind, data_files={split: str(path)}, split=split, streaming=streaming)
        except Exception as error:  # the reader's own error for a malformed file: one line of it
            raise UsageError(f"--train_file {path}: {_first_line(error)}") from error
        return found, None if streaming else len(found), str(path.parent.resolve())
    name, folder = data_args.dataset_name, Path(data_args.dataset_name)
    base = str(folder.resolve()) if folder.is_dir() else str(Path.cwd())
    if _is_saved_folder(folder):
        try:
            found = datasets.load_from_disk(str(folder))
        except Exception as error:  # a folder whose arrow files are missing or damaged
            raise UsageError(f"--dataset_name {name}: {_first_line(error)}") from error
        if isinstance(found, datasets.DatasetDict):
            _check_split(name, split, list(found))
            found = found[split]
        rows = len(found)
        if streaming:  # one shard per reader: each reads a contiguous part, no row read twice
            found = found.to_iterable_dataset(num_shards=max(1, min(rows, num_readers)))
        return found, rows, base
    try:
        splits = datasets.get_dataset_split_names(name, data_args.dataset_config_name)
    except Exception as error:  # not found, offline, a bad config: the loader's first line says which
        raise UsageError(f"--dataset_name {name}: {_first_line(error)}") from error
    _check_split(name, split, splits)
    try:
        found = datasets.load_dataset(name, data_args.dataset_config_name, split=split, streaming=streaming)
    except Exception as error:
        raise UsageError(f"--dataset_name {name}: {_first_line(error)}") from error
    if not streaming:
        return found, len(found), base
    info = (found.info.splits or {}).get(split)
    return found, getattr(info, "num_examples", None) or None, base


def _check_split(name: str, split: str, splits: list[str]) -> None:
    if split not in splits:
        raise UsageError(f"--train_split {split}: {name} has no such split; its splits are {', '.join(splits)}")


def load_training_dataset(data_args, num_readers: int) -> HFData:
    """Load the dataset the arguments name and check it, before any training: a UsageError names the split or
    column that is missing (with those there are) or holds the wrong kind of values, and a dataset of known length
    with fewer rows than readers (ranks x DataLoader workers)."""
    import datasets

    found, rows, base = _load(data_args, num_readers)
    description = describe_source(data_args)
    features = found.features
    if features is None:  # a stream whose types are known only once read (json, csv): from its first rows
        found = found._resolve_features()  # datasets has no public call for it
        features = found.features
    columns = list(features)
    for flag, column in (("--image_column", data_args.image_column), ("--caption_column", data_args.caption_column)):
        if column not in columns:
            raise UsageError(f"{flag} {column}: no such column in {description}; its columns are {', '.join(columns)}")
    image_kind = _image_kind(data_args.image_column, features[data_args.image_column], found, base)
    _check_captions(data_args.caption_column, features[data_args.caption_column])
    found = found.select_columns([data_args.image_column, data_args.caption_column])
    if image_kind == "image":  # bytes and path as stored: decoded by us, in the DataLoader workers
        found = found.cast_column(data_args.image_column, datasets.Image(decode=False))
    if rows is not None and rows < num_readers:
        raise UsageError(
            f"{description} has {rows} rows, fewer than the {num_readers} readers (ranks x --dataloader_num_workers): "
            "use fewer ranks x workers, or more data"
        )
    return HFData(
        found,
        description,
        rows,
        data_args.image_column,
        data_args.caption_column,
        image_kind,
        base,
        data_args.streaming,
    )


def _image_kind(column: str, feature, found, base: str) -> str:
    import datasets

    if isinstance(feature, datasets.Image):
        return "image"
    dtype = getattr(feature, "dtype", None)
    if dtype in BYTES_DTYPES:
        return "bytes"
    if dtype in TEXT_DTYPES:
        if isinstance(found, datasets.Dataset):
            first = found[0][column] if len(found) else None
        else:
            first = next(iter(found.select_columns([column]).take(1)), {}).get(column)
        if first is None or not _resolve(first, base).is_file():
            raise UsageError(
                f"--image_column {column} holds neither images nor paths: its first value {str(first)[:60]!r} is no "
                "file (paths are read relative to the dataset's folder)"
            )
        return "path"
    raise UsageError(
        f"--image_column {column} holds {_kind(feature)}, neither images (an Image feature or image bytes) nor paths"
    )


def _check_captions(column: str, feature) -> None:
    import datasets

    inner = feature.feature if isinstance(feature, (datasets.List, datasets.Sequence)) else feature
    if getattr(inner, "dtype", None) not in TEXT_DTYPES:
        raise UsageError(
            f"--caption_column {column} holds {_kind(feature)}, not text: name a column of captions (a string, or a "
            "list of strings)"
        )


def _kind(feature) -> str:
    inner = getattr(feature, "feature", None)
    if inner is not None:
        return f"lists of {_kind(inner)}"
    return getattr(feature, "dtype", None) or type(feature).__name__


def _resolve(path: str, base: str) -> Path:
    return Path(path) if Path(path).is_absolute() else Path(base) / path


class HFStream(ReaderStream):
    """Endless stream of (pixel_values, caption, position) from a `datasets` dataset (`HFData`), as ShardStream
    yields from shards (see the module docstring for how readers split it and how it shuffles).

    A caption column of lists gives one caption per pass, drawn from (seed, pass, sample). Rows whose image is
    missing, unreadable or above `max_image_pixels`, or whose caption is empty, are skipped and counted in
    `skipped`; `decoded` counts the samples produced (both shared by all workers)."""

    def __init__(
        self,
        data: HFData,
        image_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        train: bool = True,
        num_workers: int = 0,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ):
        super().__init__(image_size, rank, world_size, seed, shuffle_buffer, train, num_workers, max_image_pixels)
        self.data = data

    @property
    def position_fields(self) -> tuple[str, ...]:
        """The names of a position row's fields (the state_dict JSON's ints follow the streaming ones)."""
        if self.data.streaming:
            return STREAM_FIELDS + tuple(f"state{i}" for i in range(STATE_INTS))
        return MAP_FIELDS

    def __iter__(self):
        reader, num_readers, workers = self._reader()
        start = self.start.get(reader)
        count = start[0] if start else 0
        samples = self._streamed if self.data.streaming else self._indexed
        # a pass resumed part way may hold no good row in what is left of it: only whole passes are checked
        fresh = start is None or not any(start[2 : 4 if self.data.streaming else 3])
        produced = self._checked(samples(reader, num_readers, start[1:] if start else None), fresh)
        yield from self._counted(reader, count, produced)

    def _checked(self, produced, fresh: bool):
        """The (place, item) of `produced` = (pass, place, item or None) that hold an item; a DataError once a
        whole pass held none (without it an unreadable reader would spin forever)."""
        current, good = None, 0
        for epoch, place, item in produced:
            if epoch != current:
                if current is not None and good == 0 and fresh:
                    self._nothing_readable()
                current, good, fresh = epoch, 0, fresh or current is not None
            if item is not None:
                good += 1
                yield place, item

    def _nothing_readable(self):
        reader, num_readers, workers = self._reader()
        raise DataError(
            f"reader {reader} of {num_readers} (rank {reader // workers}, DataLoader worker {reader % workers}) found "
            f"no readable sample in its part of {self.data.description}: check its images and captions, or use "
            "fewer ranks x --dataloader_num_workers"
        )

    # --- map-style: a permutation of the reader's rows per pass ---

    def _indexed(self, reader: int, num_readers: int, start):
        """(pass, (pass, permutation entries done), item or None), pass after pass; an empty pass yields one
        (pass, None, None) so that `_checked` sees it."""
        rows = range(reader, len(self.data.dataset), num_readers)
        epoch, offset = start if start else (0, 0)
        for epoch in itertools.count(epoch):
            order = list(range(len(rows)))
            if self.shuffle_buffer > 0:
                random.Random(f"{self.seed}/rows/{reader}/{epoch}").shuffle(order)
            if not order:
                yield epoch, None, None
            for done in range(offset + 1, len(order) + 1):
                index = rows[order[done - 1]]
                yield epoch, (epoch, done), self._decode(self.data.dataset[index], epoch, str(index))
            offset = 0

    # --- streaming: blocks of raw rows, the state_dict at each block start ---

    def _streamed(self, reader: int, num_readers: int, start):
        from datasets.distributed import split_dataset_by_node

        epoch, block, offset, *packed = start if start else (0, 0, 0)
        state = unpack_state(packed) if packed else None
        for epoch in itertools.count(epoch):
            part = split_dataset_by_node(self.data.dataset, rank=reader, world_size=num_readers)
            part.set_epoch(epoch)  # a fresh shard order each pass
            if state is not None:
                part.load_state_dict(state)
            # .iter() rather than iter(): datasets splits an IterableDataset again over the DataLoader's workers when
            # iterated in one, and each reader here is already one worker's own part
            rows = part.iter(batch_size=1)
            empty = True
            while raw := list(itertools.islice(rows, self.block)):
                empty = False
                here = pack_state(state)
                order = list(range(len(raw)))
                random.Random(f"{self.seed}/block/{reader}/{epoch}/{block}").shuffle(order)
                for done in range(offset + 1, len(raw) + 1):
                    k = order[done - 1]
                    row = {name: values[0] for name, values in raw[k].items()}
                    item = self._decode(row, epoch, f"{reader}/{block}/{k}")
                    yield epoch, (epoch, block, done, *here), item
                offset, block = 0, block + 1
                state = part.state_dict()  # where the next block starts: exact, no buffer holds rows back
            if empty:
                yield epoch, None, None
            block, state = 0, None

    # --- one row -> (pixels, caption), or None when skipped ---

    def _decode(self, row: dict, epoch: int, key: str):
        try:
            caption = self._caption(row[self.data.caption_column], epoch, key)
            rng = random.Random(f"{self.seed}/{epoch}/{key}")  # as ShardStream: per sample, not per reader
            pixels = self.transform.from_bytes(
                self._image_bytes(row[self.data.image_column]), rng, self.max_image_pixels
            )
        except Exception as error:  # PIL raises many types for corrupt data; any of them means skip this one
            self._count_skip(f"row {key} of {self.data.description}", error)
            return None
        return pixels, caption

    def _caption(self, value, epoch: int, key: str) -> str:
        if isinstance(value, (list, tuple)):  # one of several captions, drawn anew each pass
            choices = [c.strip() for c in value if isinstance(c, str) and c.strip()]
            value = random.Random(f"{self.seed}/caption/{epoch}/{key}").choice(choices) if choices else ""
        caption = (value or "").strip()
        if not caption:
            raise ValueError("empty caption")
        return caption

    def _image_bytes(self, value) -> bytes:
        if value is None:
            raise ValueError("no image")
        if self.data.image_kind == "bytes":
            return value
        if self.data.image_kind == "image":
            if value.get("bytes"):
                return value["bytes"]
            value = value.get("path")
            if not value:
                raise ValueError("no image")
        return _resolve(value, self.data.base_dir).read_bytes()

    # --- stream_state.json ---

    def write_state(self, folder, rows: torch.Tensor) -> None:
        """Write the newest position of each reader in the gathered `rows` to FOLDER/stream_state.json, with the
        streaming state_dict as the JSON it is."""
        newest: dict[int, list[int]] = {}
        note_positions(newest, rows[rows[:, 0] >= 0])
        readers = {}
        names = STREAM_FIELDS if self.data.streaming else MAP_FIELDS
        for reader, row in sorted(newest.items()):
            entry = dict(zip(names[1:], row[1 : len(names)]))
            if self.data.streaming:
                entry["state_dict"] = unpack_state(row[len(names) :])
            readers[str(reader)] = entry
        write_json(Path(folder) / STATE_FILE, {**self._state_facts(), "readers": readers})

    def positions_from(self, state: dict, checkpoint) -> dict[int, tuple[int, ...]]:
        """{reader: position row past the reader field} from a saved state, once it fits this stream; a UsageError
        says what differs."""
        saved, mine = {k: state.get(k) for k in self._state_facts()}, self._state_facts()
        if saved != mine:
            differ = ", ".join(f"{k} {saved[k]} -> {mine[k]}" for k in mine if saved[k] != mine[k])
            raise UsageError(
                f"{checkpoint} was saved reading the data differently ({differ}): resume with the same, or pass "
                "--ignore_data_skip to start the data stream afresh"
            )
        positions = {}
        for reader, entry in state["readers"].items():
            names = STREAM_FIELDS if self.data.streaming else MAP_FIELDS
            row = [entry[name] for name in names[1:]]
            if self.data.streaming:
                row += pack_state(entry["state_dict"])
            positions[int(reader)] = tuple(row)
        return positions

    def _state_facts(self) -> dict:
        return {
            "source": "datasets",
            "data": self.data.description,
            "streaming": self.data.streaming,
            "num_readers": self.num_readers,
            "seed": self.seed,
            "shuffle_buffer": self.block if self.data.streaming else self.shuffle_buffer,
        }


def pack_state(state: dict | None) -> list[int]:
    """A datasets state_dict as STATE_INTS int64s (its compact JSON, zero-padded); None (a pass's start) as zeros."""
    if state is None:
        return [0] * STATE_INTS
    raw = json.dumps(state, separators=(",", ":")).encode()
    if len(raw) > STATE_INTS * 8:
        raise DataError(
            f"the dataset's state_dict takes {len(raw)} bytes of JSON, more than the {STATE_INTS * 8} that a stream "
            "position holds (STATE_INTS in disco_clip_ds/data/hf.py)"
        )
    return np.frombuffer(raw.ljust(STATE_INTS * 8, b"\0"), dtype=np.int64).tolist()


def unpack_state(ints) -> dict | None:
    raw = np.asarray(list(ints), dtype=np.int64).tobytes().rstrip(b"\0")
    return json.loads(raw) if raw else None
