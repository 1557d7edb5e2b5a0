"""Training stream: webdataset shards -> decode -> augment -> tokenize -> collated CLIP batches.

Runs inside DataLoader workers. Each (rank, worker) reads a disjoint set of shards and passes over it again
and again, in a fresh order each time, so multi-epoch runs never run dry (the Trainer stops at max_steps).
Shuffling permutes blocks of raw samples before decoding, so that a reader's place is a few integers that each
sample carries along: a resumed run seeks there instead of reading and decoding the stream from its start.
Unreadable shards and corrupt or incomplete samples are skipped and counted in a counter shared by all workers.
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import random

import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from disco_clip_ds.data.shards import IMAGE_EXTS, epoch_order, shards_for_reader
from disco_clip_ds.data.streams.state import POSITION_FIELDS, positions_to_restore, write_stream_state
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.transforms import MAX_IMAGE_PIXELS, ImageTransform, Normalize
from disco_clip_ds.errors import DataError

logger = logging.getLogger(__name__)

TEXT_KEYS = ("txt", "text", "caption")


# The batch key under which each sample's position row (`stream_state.POSITION_FIELDS`) rides to the trainer.
POSITION_KEY = "stream_position"


class ReaderStream(torch.utils.data.IterableDataset):
    """What every training stream shares: its place among the readers (reader = rank * DataLoader workers +
    worker), the skip and decode counters shared by all workers, and the positions a resume restores.

    `rank`/`world_size` are this process's place among the readers (pass 0/1 when one process reads for all,
    e.g. accelerate's dispatch_batches); `num_workers` is the DataLoader workers per rank. Subclasses yield
    (uint8 pixels, caption, position row) with `_counted`."""

    def __init__(
        self,
        image_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle_buffer: int,
        train: bool,
        num_workers: int,
        max_image_pixels: int,
    ):
        super().__init__()
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle_buffer, self.block = shuffle_buffer, max(1, shuffle_buffer)
        self.max_image_pixels = max_image_pixels
        self.transform = ImageTransform(image_size, train=train)
        # Shared with the DataLoader's workers, made in the context they start with (the default one, as the
        # DataLoader's): under fork the semaphore's name is unlinked at once, so a run killed with SIGKILL leaves no
        # sem.mp-* in /dev/shm (a spawn-context one waits for the resource tracker, killed with the run).
        context = multiprocessing.get_context()
        self.skipped, self.decoded = context.Value("q", 0), context.Value("q", 0)
        self.workers = max(1, num_workers)
        self.start: dict[int, tuple[int, ...]] = {}  # reader -> its position past the reader field, to resume at
        self.worker_shift = 0

    @property
    def num_readers(self) -> int:
        """Readers over all ranks and workers, as constructed (ranks x `num_workers`)."""
        return self.world_size * self.workers

    def restore(self, positions: dict[int, tuple[int, ...]], consumed_batches: int) -> None:
        """Resume where the readers stood: `positions` maps a (global) reader to its newest position past the
        reader field; readers without one start afresh. `consumed_batches`: the batches this rank's DataLoader had
        handed out; it serves batches from its workers in turn, so the next batch is from worker
        consumed_batches mod workers: a fresh worker w takes that old worker's place."""
        self.start = {int(reader): tuple(int(v) for v in pos) for reader, pos in positions.items()}
        self.worker_shift = consumed_batches

    position_fields = POSITION_FIELDS  # the names of a position row's fields

    def write_state(self, folder, rows: torch.Tensor) -> None:
        """Write each reader's newest position among the gathered position `rows` to FOLDER/stream_state.json."""
        raise NotImplementedError

    def positions_from(self, state: dict, checkpoint) -> dict[int, tuple[int, ...]]:
        """{reader: position row past the reader field} from a read stream_state.json, once it fits this stream;
        else a UsageError saying what differs."""
        raise NotImplementedError

    def _count_skip(self, what: str, error: BaseException | str) -> None:
        with self.skipped.get_lock():
            self.skipped.value += 1
        logger.warning("skipping %s: %s", what, error)

    def _reader(self) -> tuple[int, int, int]:
        """(reader, readers in all, workers per rank) of this DataLoader worker (or of the main process)."""
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return self.rank * workers + (worker + self.worker_shift) % workers, self.world_size * workers, workers

    def _counted(self, reader: int, count: int, produced):
        """The (place, item) pairs of `produced` as yielded items: the item, then its position row (reader, count
        of samples this reader has produced, place)."""
        for place, item in produced:
            count += 1
            with self.decoded.get_lock():
                self.decoded.value += 1
            yield (*item, torch.tensor([reader, count, *place], dtype=torch.int64))


class ShardStream(ReaderStream):
    """Endless stream of (uint8 pixels, caption, position) from webdataset shards (ClipCollator normalises).

    `rank`/`world_size` are this process's place among the readers (pass 0/1 when one process reads for all,
    e.g. accelerate's dispatch_batches); `num_workers`, the DataLoader workers per rank, is used to check up front
    that every reader gets a shard. Samples whose caption is empty or whitespace, and images of more than
    `max_image_pixels` pixels, are skipped. `skipped` counts skipped samples and shards, `decoded` the samples
    produced, across all workers.

    Shuffling: each pass over a reader's shards (in a fresh shard order per pass) is cut into blocks of
    `shuffle_buffer` consecutive raw (undecoded) samples; each block is read, permuted by a permutation drawn from
    (seed, reader, pass, block start), and decoded in that order. Unlike a reservoir of decoded samples, the state
    is then a handful of integers (`position`), and `restore` resumes a reader exactly there: it re-reads one
    block's raw bytes (seeking to it within the shard) and decodes only the samples not yet produced.
    """

    def __init__(
        self,
        urls: list[str],
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
        self.urls = list(urls)
        shards_for_reader(self.urls, rank * self.workers, self.num_readers)  # fail early, in the main process

    def write_state(self, folder, rows: torch.Tensor) -> None:
        write_stream_state(folder, rows, self.num_readers, self.seed, self.block)

    def positions_from(self, state: dict, checkpoint) -> dict[int, tuple[int, ...]]:
        return positions_to_restore(state, self.num_readers, self.seed, self.block, checkpoint)

    def __iter__(self):
        reader, num_readers, workers = self._reader()
        shards = shards_for_reader(self.urls, reader, num_readers)
        count, *start = self.start.get(reader, (0, 0, 0, 0, 0))  # (count, epoch, shard, member, offset)
        yield from self._counted(reader, count, self._samples(shards, (reader, num_readers, workers), start))

    def _samples(self, shards: list[str], where: tuple[int, int, int], start: list[int]):
        """(position past the reader and count fields, decoded item) from `start` = (epoch, shard, member, offset)
        on, pass after pass; `where` = (reader, readers in all, workers per rank)."""
        (reader, num_readers, workers), (epoch, shard, member, offset) = where, start
        fresh = (shard, member, offset) == (0, 0, 0)
        for epoch in itertools.count(epoch):
            produced = 0
            raw = self._raw_samples(epoch_order(shards, self.seed, epoch, reader), shard, member)
            while block := list(itertools.islice(raw, self.block)):
                first_shard, first_member, _ = block[0]
                order = list(range(len(block)))
                random.Random(f"{self.seed}/block/{reader}/{epoch}/{first_shard}/{first_member}").shuffle(order)
                for done in range(offset + 1, len(block) + 1):
                    item = self._decode(block[order[done - 1]][2], epoch)
                    if item is not None:
                        produced += 1
                        yield (epoch, first_shard, first_member, done), item
                offset = 0
            if produced == 0 and fresh:  # without this an unreadable shard set would spin forever
                shown = ", ".join(shards[:3]) + (f" and {len(shards) - 3} more" if len(shards) > 3 else "")
                raise DataError(
                    f"reader {reader} of {num_readers} (rank {reader // workers}, DataLoader worker "
                    f"{reader % workers}) found no readable sample in its shard(s) {shown}: check that they "
                    "exist and hold samples, or use fewer ranks x --dataloader_num_workers than there are good shards"
                )
            fresh, shard, member = True, 0, 0

    def _raw_samples(self, order: list[str], shard: int, member: int):
        """(shard index in `order`, sample index in the shard, raw sample) from that shard and sample on."""
        for index in range(shard, len(order)):
            first = member if index == shard else 0
            try:
                for k, sample in enumerate(raw_samples(order[index], first), first):
                    yield index, k, sample
            except Exception as error:  # missing, unreadable or truncated: the samples read so far stand
                self._count_skip(f"unreadable shard or tar member in {order[index]}", error)

    def _decode(self, sample: dict, epoch: int):
        key = sample.get("__key__", "?")
        image_key = next((k for k in IMAGE_EXTS if k in sample), None)
        text_key = next((k for k in TEXT_KEYS if k in sample), None)
        if image_key is None or text_key is None:
            self._count_skip(f"sample {key} of {sample.get('__url__')}", "no image or no caption")
            return None
        try:
            caption = sample[text_key].decode("utf-8").strip()
            if not caption:
                raise ValueError("empty caption")
            rng = random.Random(f"{self.seed}/{epoch}/{key}")
            pixels = self.transform.from_bytes(sample[image_key], rng, self.max_image_pixels)
        except Exception as error:  # PIL raises many types for corrupt data; any of them means skip this one
            self._count_skip(f"sample {key} of {sample.get('__url__')}", error)
            return None
        return pixels, caption


class ClipCollator:
    """List of (pixel_values, caption[, position]) -> {"pixel_values", "input_ids", "attention_mask"[,
    POSITION_KEY]}: tensors only, so that accelerate can dispatch (and slice) them, and no `labels` (the model
    computes its own loss). uint8 crops (as ShardStream yields them) are normalised here, straight into the
    batch tensor, with `mean`/`std` (ImageTransform's rule; pass the model's image processor's); with
    `normalize=False` they stay a uint8 batch (a quarter of the bytes to hand over), for the trainer to normalise
    on the device with `self.normalize.batch`, bit-identically. Float pixels are taken as already normalised.
    Captions are tokenized in one call per batch (a fast tokenizer does the batch in Rust) and padded to
    `max_length` so every batch has one shape. The positions (one row per sample) are for the trainer, which takes
    them out before the model sees the batch."""

    def __init__(self, tokenizer, max_length: int, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, normalize=True):
        self.tokenizer, self.max_length, self.normalizes = tokenizer, max_length, normalize
        self.normalize = Normalize(mean, std)

    def __call__(self, batch: list[tuple]) -> dict[str, torch.Tensor]:
        pixels, captions, *positions = zip(*batch)
        tokens = self.tokenizer(
            list(captions), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        shape = (len(pixels), *pixels[0].shape)
        if pixels[0].dtype == torch.uint8 and self.normalizes:
            pixels = self.normalize(pixels, out=batch_tensor(shape, torch.float32))
        elif pixels[0].dtype == torch.uint8:
            pixels = torch.stack(pixels, out=batch_tensor(shape, torch.uint8))
        else:
            pixels = torch.stack(pixels)
        collated = {
            "pixel_values": pixels,
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
        }
        if positions:
            collated[POSITION_KEY] = torch.stack(positions[0])
        return collated


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype, shared: bool | None = None) -> torch.Tensor:
    """An empty batch tensor, in shared memory when `shared` (by default: in a DataLoader worker), as
    default_collate allocates its stacks (with the same torch calls): a batch in ordinary memory is copied into
    shared memory whole (150 MB for 256 crops of 224 px) on its way to the main process."""
    if not (torch.utils.data.get_worker_info() is not None if shared is None else shared):
        return torch.empty(shape, dtype=dtype)
    like = torch.empty(0, dtype=dtype)
    return like.new(like._typed_storage()._new_shared(math.prod(shape), device=like.device)).resize_(shape)


def error_message(error: BaseException) -> str:
    """The one-line message of an error raised in the stream, also when a DataLoader worker raised it: torch
    re-raises a worker's error as the same type with the worker's whole traceback as its message, whose last line
    is `module.Type: message`."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    last = text.splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last
