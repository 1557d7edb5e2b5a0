"""The decoding half of `disco-clip data embed`, in torch DataLoader workers: each shard's tar read, its images
decoded and cropped to each teacher's views, while the embedding process runs the teachers' forward on the batches
already decoded.

The unit of work is a batch: each shard's samples in order, `batch_size` at a time (the last of a shard shorter; a
shard without samples gives one empty batch), so that the forward sees exactly the batches one process would make and
the stored embeddings do not depend on the number of workers. Batch i of the whole sequence (every shard's, in turn)
is decoded by worker i % W: every worker walks every shard's tar headers to keep count (data/tarcopy.py; a shard
that is not a plain tar is read whole, by tarfile), and reads and decodes only its own batches. The DataLoader asks
its workers in turn and returns their items in that order, so the batches come back in sequence order, whatever W
(0: decoded in the embedding process, the same code). A worker dies with the embedding process (a kill leaves none
running).

A sample missing an image, a caption key or a decodable image is skipped and counted (as training skips it); a
damaged shard (cut short, not a tar) becomes a DataError naming it, raised where its batch comes back in sequence."""

from __future__ import annotations

import functools
import itertools
import os
import signal
import tarfile
from dataclasses import dataclass, field, replace

import torch

from disco_clip_ds.data.decode import reason
from disco_clip_ds.data.prep.teachers import Teacher
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import IMAGE_EXTS
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.tarcopy import Members, SharedBytes, sample_members
from disco_clip_ds.data.transforms import crop_boxes
from disco_clip_ds.errors import DataError

TEXT_KEYS = ("txt", "text", "caption")  # the members the caption key "txt" is read from, first found (as training)


def default_workers() -> int:
    """`--num_workers`'s default: the CPUs this process may use, up to 4 (decoding 4 at once keeps a GPU teacher
    fed at lab scale; more would take cores from the other ranks of a node)."""
    return min(4, len(os.sched_getaffinity(0)))


@dataclass
class Batch:
    """One decoded batch of shard `index` (`url`): `read` samples read, of which `keys` are embedded, with their
    `boxes`, `captions` ({caption key: text} each) and each teacher's uint8 views (n * views, 3, size, size), None when
    none is; `skips` (key, missing caption key or None, why) for the others; `last`: the shard's last batch;
    `error`: the shard is damaged (raised when this batch comes back)."""

    index: int
    url: str
    read: int = 0
    last: bool = False
    keys: list[str] = field(default_factory=list)
    boxes: list[list] = field(default_factory=list)
    captions: list[dict] = field(default_factory=list)
    crops: list[torch.Tensor] | None = None
    skips: list[tuple[str, str | None, str]] = field(default_factory=list)
    error: DataError | None = None


class DecodedBatches(torch.utils.data.IterableDataset):
    """The decoded batches of shards `jobs` ((index, url), in order) for teachers `views` (Teacher objects without
    their model: only their transforms are used here) with `settings` (embed.Settings); see the module docstring."""

    def __init__(self, jobs: list[tuple[int, str]], views: list[Teacher], settings, batch_size: int):
        self.jobs, self.settings, self.batch_size = jobs, settings, batch_size
        self.views = [replace(v, model=None, tokenizer=None) for v in views]  # what a worker needs: light to copy

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        position = itertools.count()  # the batch's place in the whole sequence
        for index, url in self.jobs:
            for read, last, error in _raw_batches(url, self.batch_size):
                if next(position) % workers == worker:
                    samples = read()
                    yield self._decoded(Batch(index, url, len(samples), last, error=error), samples)

    def _decoded(self, batch: Batch, samples: list[dict]) -> Batch:
        crops = [[] for _ in self.views]
        for sample in samples:
            key = sample["__key__"]
            try:
                views, boxes, captions = sample_views(self.views, self.settings, sample)
            except KeyError as error:  # a caption key the sample lacks
                batch.skips.append((key, error.args[0], f"no caption {error}"))
                continue
            except Exception as error:  # as the training stream: skipped, counted, said (a MemoryError says nothing)
                batch.skips.append((key, None, reason(error)))
                continue
            for teacher_crops, view in zip(crops, views):
                teacher_crops.extend(view)
            batch.keys.append(key)
            batch.boxes.append(boxes)
            batch.captions.append(captions)
        if batch.keys:
            batch.crops = [torch.stack(c) for c in crops]
        return batch


def _raw_batches(url: str, size: int):
    """(read, last, error) for each batch of shard `url`, `read()` giving its samples: at least one batch (empty for a
    shard without samples); a damaged shard ends with an empty batch holding the DataError. A plain shard's samples
    are located by its headers (data/tarcopy.py), so that a worker reads only its own batches' bytes; another is read
    by `raw_samples`, whole, by every worker."""
    located = sample_members(url)
    if located is None:
        yield from _read_batches(url, size)
        return
    source = SharedBytes(url)
    try:
        for start in range(0, max(len(located), 1), size):
            stop = min(start + size, len(located))
            yield functools.partial(_located_samples, located, source, start, stop), stop == len(located), None
    finally:
        source.close()


def _located_samples(located: Members, source: SharedBytes, start: int, stop: int) -> list[dict]:
    samples = []
    for index in range(start, stop):
        sample = {"__key__": located.keys[index], "__url__": source.url}
        sample.update((ext, source.read(offset, size)) for ext, offset, size in located.members(index))
        samples.append(sample)
    return samples


def _read_batches(url: str, size: int):
    samples = raw_samples(url)
    try:
        batch = list(itertools.islice(samples, size))
        while True:
            following = list(itertools.islice(samples, size)) if len(batch) == size else []
            yield (lambda batch=batch: batch), not following, None
            if not following:
                return
            batch = following
    except (tarfile.TarError, OSError, ValueError) as error:  # tarfile's (TruncatedShard's), a file gone, a repeat
        said = str(error).splitlines()[0] if str(error) else type(error).__name__
        damaged = DataError(
            f"shard {describe_source(url)} is damaged ({said}): check it with `disco-clip data verify`, then fetch it "
            "again or leave it out of --shards"
        )
        yield list, True, damaged


def sample_image(sample: dict) -> bytes | None:
    """The encoded image of a webdataset sample (its first image extension), None when it has none."""
    return next((sample[k] for k in IMAGE_EXTS if k in sample), None)


def sample_captions(sample: dict, caption_keys: list[str]) -> dict[str, str]:
    """{caption key: text} of a webdataset sample: key "txt" is the first of its txt, text, caption members (the
    caption the training stream reads), any other key the member of that extension (`syn0.txt`: KEY.syn0.txt). A
    KeyError naming the first key the sample lacks (or whose text is empty)."""
    captions = {}
    for key in caption_keys:
        names = TEXT_KEYS if key == "txt" else (key,)
        raw = next((sample[n] for n in names if n in sample), None)
        text = raw.decode("utf-8").strip() if raw is not None else ""
        if not text:
            raise KeyError(key)
        captions[key] = text
    return captions


def sample_views(teachers: list[Teacher], settings, sample: dict) -> tuple[list, list, dict]:
    """(each teacher's uint8 crops of the sample's augmentations, the boxes, its captions); KeyError for a missing
    caption key, ValueError (or PIL's) for a missing or undecodable image."""
    captions = sample_captions(sample, settings.caption_keys)
    image = sample_image(sample)
    if image is None:
        raise ValueError("no image")
    boxes = crop_boxes(image, settings.augmentations, settings.seed, sample["__key__"])
    decoded = {}  # the image decoded once per draft scale, for every teacher
    return [teacher.crops(image, boxes, decoded) for teacher in teachers], boxes, captions


def decoded_batches(jobs: list[tuple[int, str]], views: list[Teacher], settings, batch_size: int, workers: int):
    """The `DecodedBatches` of `jobs`, decoded by `workers` DataLoader workers (0: here), in sequence order."""
    dataset = DecodedBatches(jobs, views, settings, batch_size)
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, collate_fn=_as_is, worker_init_fn=_die_with_parent
    )


def _die_with_parent(_worker: int) -> None:
    """A worker killed with the embedding process (Linux's PR_SET_PDEATHSIG): left to notice its parent gone, it
    would run on for seconds holding the process's stdout and stderr, keeping whoever reads them waiting."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: DataLoader's own check of its parent ends the worker
        return


def _as_is(batch: Batch) -> Batch:
    return batch
