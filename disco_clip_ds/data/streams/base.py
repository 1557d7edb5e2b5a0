"""What every training stream shares (`ReaderStream`): its place among the readers, the block shuffle, decoding
with skips counted, the error for a reader with nothing readable, and its stream_state.json (state.py's schema).

A reader is rank * DataLoader workers + worker. A stream yields (uint8 pixels, caption, position row); the position
row is (reader, samples it has produced, samples it has skipped, the stream's own place fields), so that a resumed
run seeks to where each reader stood instead of reading and decoding the stream from its start, and goes on counting
its skips from there.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
from collections.abc import Callable, Iterator

import torch

from disco_clip_ds.data.decode import reason
from disco_clip_ds.data.naflex import NaflexTransform
from disco_clip_ds.data.streams.state import positions_to_restore, write_stream_state
from disco_clip_ds.data.transforms import MAX_IMAGE_PIXELS, ImageTransform
from disco_clip_ds.errors import DataError
from disco_clip_ds.models.patch_dropout import draw_sample_patches

logger = logging.getLogger(__name__)

PASS_END = object()  # what a stream's passes yield at the end of each pass over the reader's data


def error_message(error: BaseException) -> str:
    """The one-line message of an error raised in the stream, also when a DataLoader worker raised it: torch
    re-raises a worker's error as the same type with the worker's whole traceback as its message, whose last line
    is `module.Type: message`."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    last = text.splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def shuffled(block: list, key: str, offset: int = 0) -> Iterator[tuple[int, object]]:
    """(entries done, element) of `block` in the order of a permutation drawn from `key`, from entry `offset` + 1
    on: a block's place is then how many of its entries are done."""
    order = list(range(len(block)))
    random.Random(key).shuffle(order)
    for done in range(offset + 1, len(block) + 1):
        yield done, block[order[done - 1]]


class ReaderStream(torch.utils.data.IterableDataset):
    """What every training stream shares: its place among the readers (reader = rank * DataLoader workers +
    worker), the skip and decode counters shared by all workers, and the positions a resume restores.

    `rank`/`world_size` are this process's place among the readers (pass 0/1 when one process reads for all,
    e.g. accelerate's dispatch_batches); `num_workers` is the DataLoader workers per rank; `split` > 1 when a run
    resumed on `split` x its ranks with 1/`split` of its micro-batch: ranks split*k .. split*k + split - 1 then
    read the readers of the run's rank k, each keeping its share of every batch that rank read (`_my_share`), so that
    each step trains on the same pairs, which the contrastive loss does not order; `shuffle_buffer` the
    block of raw samples permuted at a time (0: no shuffle where the stream allows it); `train` draws random crops;
    images above `max_image_pixels` are skipped; `patches` (patches per image, patches kept): each sample also
    carries the indices of its kept patches (patch dropout), drawn from (seed, pass, sample key), and with
    `stage_patches` (the same for each earlier grid of a --resolution_schedule) those of every grid, in a dict
    (models/patch_dropout.py `draw_sample_patches`); `naflex` (patch
    size, patch budget): each image becomes a NaFlex patch grid (SigLIP 2, data/naflex.py), not a square crop.
    Subclasses implement `_passes` (and `state_facts`, `position_fields`) and pass these options through."""

    position_fields: tuple[str, ...]  # the names of a position row's fields, "reader" and "count" first

    @property
    def state_fields(self) -> tuple[str, ...]:
        """The leading `position_fields` that stream_state.json names one by one (the rest: `_extra_to_json`)."""
        return self.position_fields

    def __init__(
        self,
        image_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        train: bool = True,
        num_workers: int = 0,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        split: int = 1,
        micro_batch: int = 1,
        patches: tuple[int, int] | None = None,
        stage_patches: tuple[tuple[int, int], ...] = (),
        naflex: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.rank, self.world_size, self.seed = rank, world_size, seed
        # the rank whose readers this rank reads, and which share of each of its batches (`micro_batch` samples) it
        # keeps
        self.split, self.micro_batch = split, micro_batch
        self.reader_rank, self.share = rank // split, rank % split
        self.shuffle_buffer, self.block = shuffle_buffer, max(1, shuffle_buffer)
        self.max_image_pixels, self.patches, self.stage_patches = max_image_pixels, patches, tuple(stage_patches)
        self.transform = (
            ImageTransform(image_size, train=train) if naflex is None else NaflexTransform(*naflex, train=train)
        )
        # Shared with the DataLoader's workers, made in the context they start with (the default one, as the
        # DataLoader's): under fork the semaphore's name is unlinked at once, so a run killed with SIGKILL leaves no
        # sem.mp-* in /dev/shm (a spawn-context one waits for the resource tracker, killed with the run).
        context = multiprocessing.get_context()
        self.skipped, self.decoded = context.Value("q", 0), context.Value("q", 0)
        # this reader's skips so far (in its worker's copy of the stream), carried in its position rows: a resume
        # continues the count from the position it seeks to, so that a run's count does not depend on its stops
        self.reader_skips = [0]
        self.workers = max(1, num_workers)
        self.start: dict[int, tuple[int, ...]] = {}  # reader -> its position past the reader field, to resume at
        self.worker_shift = 0

    @property
    def num_readers(self) -> int:
        """Readers over all ranks and workers, as constructed (ranks / split x `num_workers`)."""
        return self.world_size // self.split * self.workers

    def restore(self, positions: dict[int, tuple[int, ...]], consumed_batches: int) -> None:
        """Resume where the readers stood: `positions` maps a (global) reader to its newest position past the
        reader field; readers without one start afresh. `consumed_batches`: the batches this rank's DataLoader had
        handed out; it serves batches from its workers in turn, so the next batch is from worker
        consumed_batches mod workers: a fresh worker w takes that old worker's place."""
        self.start = {int(reader): tuple(int(v) for v in pos) for reader, pos in positions.items()}
        self.worker_shift = consumed_batches

    # --- stream_state.json ---

    def state_facts(self) -> dict:
        """What a saved position means nothing without (readers, seed, block size, the data)."""
        raise NotImplementedError

    def write_state(self, folder, rows: torch.Tensor) -> None:
        """Write each reader's newest position among the gathered position `rows` to FOLDER/stream_state.json."""
        write_stream_state(folder, rows, self.state_facts(), self.state_fields, self._extra_to_json)

    def positions_from(self, state: dict, checkpoint) -> dict[int, tuple[int, ...]]:
        """{reader: position row past the reader field} from a read stream_state.json, once it fits this stream;
        else a UsageError saying what differs."""
        return positions_to_restore(state, self.state_facts(), self.state_fields, checkpoint, self._extra_ints)

    _extra_to_json: Callable[[list[int]], dict] | None = None  # a stream whose rows hold more than named fields
    _extra_ints: Callable[[dict], list[int]] | None = None

    # --- iteration ---

    def __iter__(self):
        reader, num_readers, workers = self._reader()
        count, skipped, *start = self.start.get(reader) or (0, 0)
        self.reader_skips[0] = skipped  # in place: a mixture's sources share the list
        produced = self._counted(reader, count, self._checked(self._passes(reader, num_readers, start), start))
        yield from produced if self.split == 1 else self._my_share(produced)

    def _my_share(self, produced):
        """This rank's share of a split reader's samples: of each batch the run's rank read from it (split x
        micro_batch samples in a row, by the reader's count, which a resume continues), the share-th micro_batch.
        Every rank of the split decodes the whole stream: a sample's place in it is known once the ones before it
        are found readable."""
        batch = self.split * self.micro_batch
        for item in produced:
            if (int(item[-1][1]) - 1) % batch // self.micro_batch == self.share:
                yield item

    def _passes(self, reader: int, num_readers: int, start: list[int]):
        """(place fields, (pixels, caption)) of the reader's samples from `start` (its place fields, or [] for
        the beginning) on, pass after pass, with PASS_END after each pass."""
        raise NotImplementedError

    def _resumed_mid_pass(self, start: list[int]) -> bool:
        """Whether `start` lies part way into a pass (what is left of it may hold no good sample)."""
        return any(start[1:])

    def _nothing_readable(self, where: str, hint: str) -> DataError:
        reader, num_readers, workers = self._reader()
        return DataError(
            f"reader {reader} of {num_readers} (rank {reader // workers}, DataLoader worker {reader % workers}) found "
            f"no readable sample in {where}: {hint}"
        )

    def _empty_pass(self) -> DataError:
        """The error for a whole pass without a readable sample (subclasses name their data)."""
        raise NotImplementedError

    def _checked(self, produced, start: list[int]):
        """The samples of `produced`, without the PASS_END marks; a DataError once a whole pass held none (without
        it an unreadable reader would spin forever)."""
        good, whole = 0, not self._resumed_mid_pass(start)
        for entry in produced:
            if entry is not PASS_END:
                good += 1
                yield entry
                continue
            if good == 0 and whole:
                raise self._empty_pass()
            good, whole = 0, True

    def _decode_sample(
        self,
        what: str,
        epoch: int,
        key: str,
        caption: Callable[[], str],
        image: Callable[[], bytes],
        box: tuple[int, int, int, int] | None = None,
    ):
        """(uint8 pixels, caption[, kept patches]) of one sample, or None when it is skipped (and counted): its
        `caption()` is empty, or its `image()` bytes are missing, unreadable or above `max_image_pixels`. The
        augmentation and the patch mask draw from (seed, pass, sample key): per sample, not per reader; `box`: the
        crop replayed from a stored augmentation instead (data/streams/reinforced.py)."""
        try:
            text = caption().strip()
            if not text:
                raise ValueError("empty caption")
            replay = {} if box is None else {"box": box}  # (NaFlex grids have no box; the checks refuse a pool)
            rng = random.Random(f"{self.seed}/{epoch}/{key}")
            pixels = self.transform.from_bytes(image(), rng, self.max_image_pixels, **replay)
            if self.patches is None:
                return pixels, text
            # an RNG of its own: the crops are those of a run without patch dropout
            rng = random.Random(f"{self.seed}/patches/{epoch}/{key}")
            return pixels, text, draw_sample_patches(self.patches, self.stage_patches, rng)
        except Exception as error:  # PIL raises many types for corrupt data; any of them means skip this one
            self._count_skip(what, error)
            return None

    def _count_skip(self, what: str, error: BaseException | str) -> None:
        self.reader_skips[0] += 1  # every rank of a split reader, so that their position rows agree
        if self.share:  # one rank of a split reader counts its skips
            return
        with self.skipped.get_lock():
            self.skipped.value += 1
        logger.warning("skipping %s: %s", what, reason(error) if isinstance(error, BaseException) else error)

    def _reader(self) -> tuple[int, int, int]:
        """(reader, readers in all, workers per rank) of this DataLoader worker (or of the main process)."""
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        reader = self.reader_rank * workers + (worker + self.worker_shift) % workers
        return reader, self.world_size // self.split * workers, workers

    def _counted(self, reader: int, count: int, produced):
        """The (place, item) pairs of `produced` as yielded items: the item, then its position row (reader, count
        of samples this reader has produced, of samples it has skipped, place)."""
        for place, item in produced:
            count += 1
            with self.decoded.get_lock():
                self.decoded.value += 1
            yield (*item, torch.tensor([reader, count, self.reader_skips[0], *place], dtype=torch.int64))
