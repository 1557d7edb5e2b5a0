"""Training stream from a 🤗 `datasets` dataset, named as transformers' run_clip.py names it: --dataset_name (a hub id,
a folder saved with `save_to_disk`, a parquet folder, an imagefolder with metadata.jsonl) or --train_file, with
--image_column and --caption_column.

The dataset is found and checked by data/hf_io.py (`load_training_dataset`). `HFStream` is a `ReaderStream`
(streams/base.py) as `ShardStream` is: the same skip counters, per-sample augmentation RNG rule, DataError for a reader
with nothing readable and stream_state.json schema, so that the trainer and the collator treat both sources alike.
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
import random

import numpy as np

from disco_clip_ds.data.hf_io import HFData, resolve_path
from disco_clip_ds.data.streams.base import PASS_END, ReaderStream, shuffled
from disco_clip_ds.errors import DataError

# The streaming state_dict rides with each sample in the int64 position row (the batch carries tensors only, so that
# accelerate can dispatch it): its compact JSON, 8 bytes per int, zero-padded. A datasets state_dict is a nested
# dict whose shape changes during iteration (e.g. RebatchedArrowExamplesIterable's previous_state goes from None to a
# dict), so its integer leaves do not flatten into fixed fields; its JSON does, whatever datasets puts in it.
STATE_INTS = 128
MAP_FIELDS = ("reader", "count", "skipped", "epoch", "offset")
STREAM_FIELDS = ("reader", "count", "skipped", "epoch", "block", "offset")


class HFStream(ReaderStream):
    """Endless stream of (pixel_values, caption, position) from a `datasets` dataset (`HFData`), as ShardStream
    yields from shards (see the module docstring for how readers split it and how it shuffles).

    A caption column of lists gives one caption per pass, drawn from (seed, pass, sample). Rows whose image is
    missing, unreadable or above `max_image_pixels`, or whose caption is empty, are skipped and counted in
    `skipped`; `decoded` counts the samples produced (both shared by all workers)."""

    def __init__(self, data: HFData, image_size: int, **options):
        """`options`: ReaderStream's (rank, world_size, seed, shuffle_buffer, train, num_workers, max_image_pixels)."""
        super().__init__(image_size, **options)
        self.data = data

    @property
    def position_fields(self) -> tuple[str, ...]:
        """The names of a position row's fields (the state_dict JSON's ints follow the streaming ones)."""
        if self.data.streaming:
            return STREAM_FIELDS + tuple(f"state{i}" for i in range(STATE_INTS))
        return MAP_FIELDS

    @property
    def state_fields(self) -> tuple[str, ...]:
        """The fields stream_state.json names one by one (the state_dict's ints go there as its JSON)."""
        return STREAM_FIELDS if self.data.streaming else MAP_FIELDS

    def state_facts(self) -> dict:
        """The data, readers, seed and block size: a row position means nothing under another of them."""
        return {
            "source": "datasets",
            "data": self.data.description,
            "streaming": self.data.streaming,
            "num_readers": self.num_readers,
            "seed": self.seed,
            "shuffle_buffer": self.block if self.data.streaming else self.shuffle_buffer,
        }

    def _extra_to_json(self, ints: list[int]) -> dict:
        return {"state_dict": unpack_state(ints)} if self.data.streaming else {}

    def _extra_ints(self, entry: dict) -> list[int]:
        return pack_state(entry["state_dict"]) if self.data.streaming else []

    def _empty_pass(self):
        return self._nothing_readable(
            f"its part of {self.data.description}",
            "check its images and captions, or use fewer ranks x --dataloader_num_workers",
        )

    def _passes(self, reader: int, num_readers: int, start: list[int]):
        if self.data.streaming:
            return self._streamed(reader, num_readers, start)
        return self._indexed(reader, num_readers, start)

    # --- map-style: a permutation of the reader's rows per pass ---

    def _indexed(self, reader: int, num_readers: int, start):
        """((pass, permutation entries done), item), pass after pass, each followed by PASS_END."""
        rows = range(reader, len(self.data.dataset), num_readers)
        epoch, offset = start or (0, 0)
        for epoch in itertools.count(epoch):
            key = f"{self.seed}/rows/{reader}/{epoch}"
            order = shuffled(list(rows), key, offset) if self.shuffle_buffer > 0 else _in_order(list(rows), offset)
            for done, index in order:
                item = self._row(self.data.dataset[index], epoch, str(index))
                if item is not None:
                    yield (epoch, done), item
            yield PASS_END
            offset = 0

    # --- streaming: blocks of raw rows, the state_dict at each block start ---

    def _streamed(self, reader: int, num_readers: int, start):
        from datasets.distributed import split_dataset_by_node

        epoch, block, offset, *packed = start or (0, 0, 0)
        state = unpack_state(packed) if packed else None
        for epoch in itertools.count(epoch):
            part = split_dataset_by_node(self.data.dataset, rank=reader, world_size=num_readers)
            part.set_epoch(epoch)  # a fresh shard order each pass
            if state is not None:
                part.load_state_dict(state)
            # .iter() rather than iter(): datasets splits an IterableDataset again over the DataLoader's workers when
            # iterated in one, and each reader here is already one worker's own part
            rows = part.iter(batch_size=1)
            while raw := list(itertools.islice(rows, self.block)):
                here = pack_state(state)
                blocks = enumerate(raw)
                for done, (k, values) in shuffled(list(blocks), f"{self.seed}/block/{reader}/{epoch}/{block}", offset):
                    item = self._row({name: value[0] for name, value in values.items()}, epoch, f"{reader}/{block}/{k}")
                    if item is not None:
                        yield (epoch, block, done, *here), item
                offset, block = 0, block + 1
                state = part.state_dict()  # where the next block starts: exact, no buffer holds rows back
            yield PASS_END
            block, state = 0, None

    # --- one row -> (pixels, caption), or None when skipped ---

    def _row(self, row: dict, epoch: int, key: str):
        return self._decode_sample(
            f"row {key} of {self.data.description}",
            epoch,
            key,
            lambda: self._caption(row[self.data.caption_column], epoch, key),
            lambda: self._image_bytes(row[self.data.image_column]),
        )

    def _caption(self, value, epoch: int, key: str) -> str:
        if isinstance(value, (list, tuple)):  # one of several captions, drawn anew each pass
            choices = [c.strip() for c in value if isinstance(c, str) and c.strip()]
            value = random.Random(f"{self.seed}/caption/{epoch}/{key}").choice(choices) if choices else ""
        return value or ""

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
        return resolve_path(value, self.data.base_dir).read_bytes()


def _in_order(rows: list, offset: int):
    return ((done, rows[done - 1]) for done in range(offset + 1, len(rows) + 1))


def pack_state(state: dict | None) -> list[int]:
    """A datasets state_dict as STATE_INTS int64s (its compact JSON, zero-padded); None (a pass's start) as zeros."""
    if state is None:
        return [0] * STATE_INTS
    raw = json.dumps(state, separators=(",", ":")).encode()
    if len(raw) > STATE_INTS * 8:
        raise DataError(
            f"the dataset's state_dict takes {len(raw)} bytes of JSON, more than the {STATE_INTS * 8} that a stream "
            "position holds (STATE_INTS in disco_clip_ds/data/streams/hf.py)"
        )
    return np.frombuffer(raw.ljust(STATE_INTS * 8, b"\0"), dtype=np.int64).tolist()


def unpack_state(ints) -> dict | None:
    """The state_dict `pack_state` packed (None for zeros)."""
    raw = np.asarray(list(ints), dtype=np.int64).tobytes().rstrip(b"\0")
    return json.loads(raw) if raw else None
