"""`disco-clip data embed`: the embeddings of every sample of webdataset shards by one teacher or an ensemble, for K
augmentations of each image and for each of its captions, written once into a sidecar per shard (data/embeddings.py).

Resumable: a shard whose sidecar verifies and was made with the same settings (teachers, augmentations, caption keys,
dtype, seed: `Settings`) is not embedded again, so a re-run after a kill continues where the last one stopped; a
sidecar made with other settings is embedded again (overwritten: the settings asked for now are the ones wanted), and
one made for another shard is refused. The teachers are checked before any model is built (data/prep/teachers.py).

The augmentations are the training pipeline's own random resized crop (no flip, no RandAugment: the pipeline has
neither), drawn per sample from (seed, key, a) (`transforms.crop_boxes`); each teacher sees each box resized to its
own image size, with its own normalisation. A sample missing an image, a caption key or a decodable image is skipped
and counted, as the training stream skips it.

The shards are read and decoded in DataLoader workers while this process runs the teachers (embed_loader.py), in the
batches one process would make, so the sidecars do not depend on the number of workers. On a GPU the forward runs
under bfloat16 autocast by default (`autocast_dtype`); on the CPU in float32."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from disco_clip_ds import faults
from disco_clip_ds.data.embeddings import (
    DTYPES,
    FORMAT,
    Reinforced,
    TeacherFacts,
    read_metadata,
    read_reinforced,
    shard_facts,
    shard_identity,
    sidecar_path,
    sidecar_problem,
    write_reinforced,
)
from disco_clip_ds.data.prep.embed_loader import Batch, decoded_batches, default_workers, sample_captions, sample_image
from disco_clip_ds.data.prep.teachers import Teacher, checked_fingerprint, load_teacher
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import is_url, shard_sizes
from disco_clip_ds.distributed.ranks import all_gathered, decided_on_rank0, launched, process_group
from disco_clip_ds.distributed.runlock import writer_lock
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError

logger = logging.getLogger("disco_clip_ds.data.embed")
DEFAULT_CAPTION_KEYS = ("txt",)

__all__ = [
    "PRECISIONS",
    "Settings",
    "autocast_dtype",
    "embed_launched",
    "embed_shards",
    "load_teacher",
    "sample_captions",
    "sample_image",
]


@dataclass
class Settings:
    """What a sidecar is made with, beyond its shard: the teachers (names as given, each with its tokenizer or None),
    the augmentations K (0: the centre crop), the caption keys, the stored dtype and the augmentations' seed."""

    teachers: list[str]
    tokenizers: list[str | None] = field(default_factory=lambda: [None])
    augmentations: int = 0
    caption_keys: list[str] = field(default_factory=lambda: list(DEFAULT_CAPTION_KEYS))
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        self.teachers = [self.teachers] if isinstance(self.teachers, str) else list(self.teachers)
        if self.tokenizers is None or isinstance(self.tokenizers, str):
            self.tokenizers = [self.tokenizers]
        self.check()

    def check(self) -> None:
        """A UsageError in one line for settings that cannot be embedded."""
        twice = [t for t, n in Counter(os.path.normpath(t) for t in self.teachers).items() if n > 1]
        if twice:
            raise UsageError(f"--teacher names {twice[0]} twice: give each teacher of the ensemble once")
        if len(self.tokenizers) not in (1, len(self.teachers)):
            raise UsageError(
                f"--tokenizer_name: {len(self.tokenizers)} names for {len(self.teachers)} teachers: give one for all, "
                "or one per teacher in --teacher's order"
            )
        if self.dtype not in DTYPES:
            raise UsageError(f"--embedding_dtype {self.dtype}: give one of {', '.join(DTYPES)}")
        if self.augmentations < 0:
            raise UsageError(f"--augmentations {self.augmentations}: give 0 (the centre crop) or more")
        keys = [k.strip() for k in self.caption_keys]
        if not keys or not all(keys):
            given = ",".join(self.caption_keys)
            raise UsageError(f"--caption_keys {given!r}: give one or more keys, e.g. txt,syn0.txt")
        if len(set(keys)) != len(keys):
            raise UsageError(f"--caption_keys {','.join(keys)}: a key named twice")
        self.caption_keys = keys

    def tokenizer_of(self, index: int) -> str | None:
        return self.tokenizers[index if len(self.tokenizers) > 1 else 0]

    def matches(self, stored: dict, fingerprints: list[str]) -> str | None:
        """Why a sidecar's header `stored` was made with other settings than these (teachers of `fingerprints`);
        None when it was made with these."""
        if stored.get("format") != FORMAT:  # an older format is read, but data embed writes the current one
            return f"made by an older version (format {stored.get('format', 1)}, not {FORMAT})"
        got = {
            "teachers": [t["fingerprint"] for t in json.loads(stored["teachers"])],
            "augmentations": int(stored["augmentations"]),
            "caption keys": json.loads(stored["caption_keys"]),
            "dtype": stored["dtype"],
            "seed": int(stored["seed"]) if stored.get("seed") else None,
        }
        want = {
            "teachers": fingerprints,
            "augmentations": self.augmentations,
            "caption keys": self.caption_keys,
            "dtype": self.dtype,
            "seed": self.seed if self.augmentations else None,
        }
        return next((f"made with {k} {got[k]}, not {want[k]}" for k in want if got[k] != want[k]), None)


def checked_fingerprints(teachers: list[str]) -> list[str]:
    """The fingerprints of the ensemble's teachers, each checked (`checked_fingerprint`); a UsageError in one line
    when two are one model (their embeddings would be stored under one name)."""
    return _distinct(teachers, [checked_fingerprint(t) for t in teachers])


def _distinct(teachers: list[str], fingerprints: list[str]) -> list[str]:
    for i, fingerprint in enumerate(fingerprints):
        j = fingerprints.index(fingerprint)
        if j != i:
            raise UsageError(
                f"--teacher {teachers[j]} and {teachers[i]} are one model (fingerprint {fingerprint}): give each "
                "teacher of the ensemble once"
            )
    return fingerprints


def embed_shards(
    teacher: str | list[str],
    urls: list[str],
    out: str | None,
    batch_size: int = 64,
    tokenizer_name: str | list[str] | None = None,
    rank: int = 0,
    world: int = 1,
    device: str | torch.device = "cpu",
    settings: Settings | None = None,
    num_workers: int | None = None,
    precision: str = "auto",
) -> dict:
    """Embed every sample of the local shards `urls` with `teacher` (a CLIPModel or SiglipModel folder or hub id, or
    a list of them: an ensemble) into sidecars in OUT (default: beside each shard), with `settings` (default: the
    centre crop, the caption "txt", float32). Returns {"embedded": [...], "kept": [...], "skipped": n,
    "missing_captions": {key: n}}: shards written, shards whose sidecar already verified with these settings,
    samples skipped (no image, undecodable, or a caption key missing: those counted per key too); "empty": the
    embedded shards that hold no sample (each given a sidecar of no rows).

    The shards are read and decoded by `num_workers` DataLoader workers (None: `default_workers()`; 0: in this
    process) while this process runs the teachers; the sidecars are the same whatever their number (embed_loader.py).
    `precision` is the forward's (`autocast_dtype`); the embeddings are stored at `settings.dtype` either way.

    Rank `rank` of `world` embeds shards rank, rank + world, ... of `urls` (`embed_launched` runs every rank) and
    shows a progress bar when it is rank 0."""
    settings = settings or Settings(teacher, tokenizer_name)
    workers = default_workers() if num_workers is None else check_workers(num_workers)
    autocast = autocast_dtype(precision, torch.device(device))
    remote = [u for u in urls if is_url(u)]
    if remote:
        raise UsageError(f"data embed reads local shards only, not {describe_source(remote[0])}")
    paths = _sidecar_paths(urls, out)[rank::world]  # every shard's, so that one named twice is found on any rank
    urls = urls[rank::world]
    loaded = [load_teacher(t, settings.tokenizer_of(i), device) for i, t in enumerate(settings.teachers)]
    fingerprints = _distinct(settings.teachers, [t.fingerprint for t in loaded])
    summary = {"embedded": [], "kept": [], "skipped": 0, "missing_captions": {}, "empty": 0}
    with _progress(urls, rank, world) as bar:
        jobs = []
        for index, (url, path) in enumerate(zip(urls, paths)):
            if path.is_file() and _verifies(path, url, fingerprints, settings):
                summary["kept"].append(str(path))
                bar.update(_recorded_size(url))
            else:
                jobs.append((index, url))
        shard = None
        for batch in decoded_batches(jobs, loaded, settings, batch_size, workers) if jobs else ():
            shard = shard or _Shard(loaded, settings)
            shard.add(batch, autocast)
            bar.update(batch.read)
            if batch.last:
                path = paths[batch.index]
                shard.write(batch.url, path, summary)
                faults.after_sidecar(rank + batch.index * world)
                shard = None
    return summary


def check_workers(workers: int) -> int:
    """`--num_workers` checked: 0 (decode in this process) or more; a UsageError in one line otherwise."""
    if workers < 0:
        raise UsageError(f"--num_workers {workers}: give 0 (decode in the embedding process) or more")
    return workers


PRECISIONS = ("auto", "float32", "bfloat16", "float16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the teachers' forward autocasts to on `device` (None: float32, no autocast): `auto` is bfloat16 on a
    GPU and float32 on the CPU; bfloat16 and float16 autocast on a GPU only (a UsageError in one line on the CPU,
    where data embed computes in float32: its tested, exact path)."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: give one of {', '.join(PRECISIONS)}")
    if precision == "float32" or (precision == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise UsageError(
            f"--precision {precision}: autocast runs on a GPU only; on the CPU data embed computes in float32 "
            "(give --precision auto or float32)"
        )
    return torch.bfloat16 if precision in ("auto", "bfloat16") else torch.float16


class _Shard:
    """A shard's embeddings as its batches come back: the keys, boxes and each teacher's image and text embeddings;
    then its sidecar."""

    def __init__(self, loaded: list[Teacher], settings: Settings):
        self.loaded, self.settings = loaded, settings
        self.keys, self.boxes, self.skipped, self.missing, self.read = [], [], 0, Counter(), 0
        self.seen: set[str] = set()
        self.images = [[] for _ in loaded]
        self.texts = [{k: [] for k in settings.caption_keys} for _ in loaded]

    def add(self, batch: Batch, autocast: torch.dtype | None) -> None:
        """Count and say the batch's skipped samples, run each teacher on its embedded ones; a damaged shard's
        DataError is raised here, and so is one for a key met twice in the shard: the sidecar maps a key to one row,
        which two samples would share."""
        self.read += batch.read
        for key in [*batch.keys, *(k for k, _, _ in batch.skips)]:
            if key in self.seen:
                raise DataError(
                    f"shard {describe_source(batch.url)} holds two samples of key {key}: a sample's embeddings are "
                    "found by its key; give each sample its own key, or leave the shard out of --shards"
                )
            self.seen.add(key)
        for key, missing, why in batch.skips:
            self.skipped += 1
            if missing is not None:
                self.missing[missing] += 1
            logger.warning("skipping sample %s of %s: %s", key, describe_source(batch.url), why)
        if batch.error is not None:
            raise batch.error
        if not batch.keys:
            return
        self.keys += batch.keys
        self.boxes += batch.boxes
        for t, teacher in enumerate(self.loaded):
            image, text = _forward(teacher, batch.crops[t], batch.captions, self.settings.caption_keys, autocast)
            self.images[t].append(image.view(len(batch.keys), -1, image.shape[-1]))
            for key in self.settings.caption_keys:
                self.texts[t][key].append(text[key])

    def write(self, url: str, path: Path, summary: dict) -> None:
        """Write the sidecar at PATH and add the shard to `summary`. A shard without samples (a valid tar with no
        member, as img2dataset leaves one whose every download failed) gets a sidecar of no rows, counted as empty;
        one whose samples were all skipped is a DataError."""
        if not self.keys and self.read:
            raise DataError(f"{describe_source(url)}: no sample with an image and a caption")
        if not self.keys:
            self._no_rows()
            summary["empty"] += 1
            logger.warning("%s: an empty shard (no sample): its sidecar has no rows", describe_source(url))
        settings = self.settings
        stored = Reinforced(
            self.keys,
            [_facts(t) for t in self.loaded],
            [torch.cat(i) for i in self.images],
            [{k: torch.cat(v) for k, v in by_key.items()} for by_key in self.texts],
            torch.tensor(self.boxes, dtype=torch.int32).view(-1, settings.augmentations, 4)
            if settings.augmentations
            else None,
            settings.caption_keys,
            settings.augmentations,
            settings.dtype,
            settings.seed if settings.augmentations else None,
            {**shard_facts(url), "skipped": self.skipped},  # training says how many samples have no row
        )
        write_reinforced(path, stored)
        logger.info("%s: %d samples embedded", path, len(self.keys))
        summary["embedded"].append(str(path))
        summary["skipped"] += self.skipped
        for key, n in self.missing.items():
            summary["missing_captions"][key] = summary["missing_captions"].get(key, 0) + n

    def _no_rows(self) -> None:
        """Each teacher's tensors with no rows, at the width its embeddings have (one forward of a blank image)."""
        keys, views = self.settings.caption_keys, max(self.settings.augmentations, 1)
        for t, teacher in enumerate(self.loaded):
            size = teacher.transform.image_size
            blank = torch.zeros(1, 3, size, size, dtype=torch.uint8)
            width = _forward(teacher, blank, [dict.fromkeys(keys, "a")], keys, None)[0].shape[-1]
            self.images[t].append(torch.zeros(0, views, width))
            for key in keys:
                self.texts[t][key].append(torch.zeros(0, width))


def _forward(teacher: Teacher, crops: torch.Tensor, captions: list[dict], caption_keys: list[str], autocast) -> tuple:
    """The teacher's L2-normalised image embeddings of `crops` (uint8, n, 3, size, size) and text embeddings
    {key: (n, d)} of `captions`, in float32 on the CPU; the forward autocast to `autocast` (on a GPU) unless None."""
    device = next(teacher.model.parameters()).device
    texts = [caption[key] for key in caption_keys for caption in captions]  # key-major: one slice per key
    tokens = teacher.tokenizer(
        texts, padding="max_length", truncation=True, max_length=teacher.text_length, return_tensors="pt"
    )
    cast = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), cast:
        outputs = teacher.model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device) if "attention_mask" in tokens else None,
            pixel_values=teacher.normalize(crops).to(device),
            return_loss=False,
            return_logits=False,
        )
    text = outputs.text_embeds.float().cpu().split(len(captions))
    return outputs.image_embeds.float().cpu(), dict(zip(caption_keys, text))


def _facts(teacher: Teacher) -> TeacherFacts:
    params = teacher.model.logit_params()
    return TeacherFacts(
        teacher.fingerprint,
        teacher.name,
        teacher.model.config.model_type,
        float(params[0]),
        float(params[1]) if len(params) > 1 else None,
    )


def _recorded_size(url: str) -> int:
    try:
        return shard_sizes([url])[url]
    except ValueError:
        return 0


def _progress(urls: list[str], rank: int, world: int):
    """Rank 0's bar over its own samples (their count from sizes.json, when recorded), with samples/s; the other
    ranks' bars are off (one bar per rank would interleave on one terminal)."""
    from tqdm.auto import tqdm

    try:
        total = sum(shard_sizes(urls).values())
    except ValueError:
        total = None
    what = f"embedding (rank 0 of {world})" if world > 1 else "embedding"
    return tqdm(total=total, desc=what, unit=" samples", disable=rank != 0, dynamic_ncols=True)


def embed_launched(
    teacher: str | list[str],
    urls: list[str],
    out: str | None,
    batch_size: int = 64,
    tokenizer_name: str | list[str] | None = None,
    settings: Settings | None = None,
    num_workers: int | None = None,
    precision: str = "auto",
) -> tuple[dict, int]:
    """`embed_shards` on every rank of a torchrun launch (its RANK, WORLD_SIZE, LOCAL_RANK; one rank per GPU, on the
    GPU of its LOCAL_RANK; gloo ranks on CPU), or in this one process when not launched. Returns (every rank's
    summary merged, this rank). The teachers are checked and fetched on rank 0 first; an error on any rank is raised
    on every rank, after all have finished (a rank that stopped early would leave the others waiting). `num_workers`
    and `precision`: each rank's, as `embed_shards` takes them."""
    settings = settings or Settings(teacher, tokenizer_name)
    rank, world, local = launched()
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if num_workers is not None:  # refused before any teacher is checked or built, on every rank
        check_workers(num_workers)
    autocast_dtype(precision, device)
    with process_group(world, device), _locked_outputs(urls, out):
        decided_on_rank0(lambda: checked_fingerprints(settings.teachers))
        try:
            summary = embed_shards(
                settings.teachers, urls, out, batch_size, None, rank, world, device, settings, num_workers, precision
            )
            outcome = ("ok", summary)
        except DiscoClipError as error:
            outcome = ("error", error)
        outcomes = all_gathered(outcome)  # every rank done: the folders' locks may go
    errors = [value for kind, value in outcomes if kind == "error"]
    if errors:
        raise errors[0]
    merged = {"embedded": [], "kept": [], "skipped": 0, "missing_captions": {}, "empty": 0}
    for _, summary in outcomes:
        for name in ("embedded", "kept", "skipped", "empty"):
            merged[name] += summary[name]
        for key, n in summary["missing_captions"].items():
            merged["missing_captions"][key] = merged["missing_captions"].get(key, 0) + n
    return merged, rank


@contextlib.contextmanager
def _locked_outputs(urls: list[str], out: str | None):
    """Rank 0 holds the lock of each folder the sidecars go to (OUT, else each shard's folder) while every rank embeds:
    a second `data embed` into one of them is refused on all its ranks, naming the holder."""
    folders = [Path(out)] if out else sorted({Path(url).parent for url in urls if not is_url(url)})
    flag, instead = ("--output", None) if out else ("the shards' folder", "give --output")
    with contextlib.ExitStack() as stack:
        for folder in folders:
            stack.enter_context(writer_lock(folder, flag, "disco-clip data embed", every_rank=True, instead=instead))
        yield


def _sidecar_paths(urls: list[str], out: str | None) -> list[Path]:
    """Each shard's sidecar (in OUT, else beside it); a shard named twice would be embedded into one file twice."""
    paths, seen = [], {}
    for url in urls:
        path = sidecar_path(out or Path(url).parent, url)
        if path in seen:
            raise UsageError(
                f"--shards names the shard {describe_source(url)} twice ({seen[path]!r} and {url!r} are one file): "
                "give each shard once"
            )
        seen[path] = url
        paths.append(path)
    return paths


def _verifies(path: Path, url: str, fingerprints: list[str], settings: Settings) -> bool:
    """A sidecar already there counts as done when it may serve this shard, was made with these settings and its
    checksum verifies; one made for another shard (a sidecar renamed or copied there) is refused rather than
    overwritten; one made with other settings is embedded again (said in the log)."""
    try:
        meta = read_metadata(path)
        if meta.get("shard") not in (None, shard_identity(url)):
            raise UsageError(
                f"{path}: holds the embeddings of shard {describe_source(meta['shard'])}, not of "
                f"{describe_source(url)}: remove it, or give another --output"
            )
        why = sidecar_problem(meta, url, fingerprints) or settings.matches(meta, fingerprints)
        if why:
            logger.warning("%s: %s: embedding it again", path, why)
            return False
        read_reinforced(path)
        return True
    except DataError:
        return False
