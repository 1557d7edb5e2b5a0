"""`disco-clip data embed`: the embeddings of every sample of webdataset shards by one teacher or an ensemble, for K
augmentations of each image and for each of its captions, written once into a sidecar per shard (data/embeddings.py).

Resumable: a shard whose sidecar verifies and was made with the same settings (teachers, augmentations, caption keys,
dtype, seed: `Settings`) is not embedded again, so a re-run after a kill continues where the last one stopped; a
sidecar made with other settings is embedded again (overwritten: the settings asked for now are the ones wanted), and
one made for another shard is refused. The teachers are checked before any model is built (data/prep/teachers.py).

The augmentations are the training pipeline's own random resized crop (no flip, no RandAugment: the pipeline has
neither), drawn per sample from (seed, key, a) (`transforms.crop_boxes`); each teacher sees each box resized to its
own image size, with its own normalisation. A sample missing an image, a caption key or a decodable image is skipped
and counted, as the training stream skips it."""

from __future__ import annotations

import itertools
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
from disco_clip_ds.data.prep.teachers import Teacher, checked_fingerprint, load_teacher
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import IMAGE_EXTS, is_url, shard_sizes
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.transforms import crop_boxes
from disco_clip_ds.distributed.ranks import all_gathered, decided_on_rank0, launched, process_group
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError

logger = logging.getLogger("disco_clip_ds.data.embed")
TEXT_KEYS = ("txt", "text", "caption")  # the members the caption key "txt" is read from, first found (as training)
DEFAULT_CAPTION_KEYS = ("txt",)

__all__ = ["Settings", "embed_launched", "embed_shards", "load_teacher", "sample_image", "sample_captions"]


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
        if stored.get("format") != "2":
            return "made by an older version (one teacher, the centre crop, one caption)"
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
) -> dict:
    """Embed every sample of the local shards `urls` with `teacher` (a CLIPModel or SiglipModel folder or hub id, or
    a list of them: an ensemble) into sidecars in OUT (default: beside each shard), with `settings` (default: the
    centre crop, the caption "txt", float32). Returns {"embedded": [...], "kept": [...], "skipped": n,
    "missing_captions": {key: n}}: shards written, shards whose sidecar already verified with these settings,
    samples skipped (no image, undecodable, or a caption key missing: those counted per key too).

    Rank `rank` of `world` embeds shards rank, rank + world, ... of `urls` (`embed_launched` runs every rank) and
    shows a progress bar when it is rank 0."""
    settings = settings or Settings(teacher, tokenizer_name)
    remote = [u for u in urls if is_url(u)]
    if remote:
        raise UsageError(f"data embed reads local shards only, not {describe_source(remote[0])}")
    paths = _sidecar_paths(urls, out)[rank::world]  # every shard's, so that one named twice is found on any rank
    urls = urls[rank::world]
    loaded = [load_teacher(t, settings.tokenizer_of(i), device) for i, t in enumerate(settings.teachers)]
    fingerprints = _distinct(settings.teachers, [t.fingerprint for t in loaded])
    summary = {"embedded": [], "kept": [], "skipped": 0, "missing_captions": {}}
    with _progress(urls, rank, world) as bar:
        for index, (url, path) in enumerate(zip(urls, paths)):
            if path.is_file() and _verifies(path, url, fingerprints, settings):
                summary["kept"].append(str(path))
                bar.update(_recorded_size(url))
                continue
            skipped, missing = _embed_shard(loaded, settings, url, path, batch_size, bar)
            summary["skipped"] += skipped
            for key, n in missing.items():
                summary["missing_captions"][key] = summary["missing_captions"].get(key, 0) + n
            summary["embedded"].append(str(path))
            faults.after_sidecar(rank + index * world)
    return summary


def _embed_shard(
    loaded: list[Teacher], settings: Settings, url: str, path: Path, batch_size: int, bar
) -> tuple[int, Counter]:
    """Write shard `url`'s sidecar at PATH; returns (samples skipped, {caption key: samples skipped for lacking it})."""
    keys, all_boxes, skipped, missing = [], [], 0, Counter()
    images = [[] for _ in loaded]
    texts = [{k: [] for k in settings.caption_keys} for _ in loaded]
    samples = raw_samples(url)
    while batch := list(itertools.islice(samples, batch_size)):
        crops, captions = [[] for _ in loaded], []
        for sample in batch:
            try:
                views, boxes, caption = _sample_views(loaded, settings, sample)
            except KeyError as error:  # a caption key the sample lacks: skipped and counted, as data errors are
                skipped, missing[error.args[0]] = skipped + 1, missing[error.args[0]] + 1
                where = f"{sample['__key__']} of {describe_source(url)}"
                logger.warning("skipping sample %s: no caption %s", where, error)
                continue
            except Exception as error:  # as the training stream: skipped, counted, said
                skipped += 1
                logger.warning("skipping sample %s of %s: %s", sample["__key__"], describe_source(url), error)
                continue
            for teacher_crops, view in zip(crops, views):
                teacher_crops.extend(view)
            captions.append(caption)
            keys.append(sample["__key__"])
            all_boxes.append(boxes)
        bar.update(len(batch))
        if captions:
            for t, teacher in enumerate(loaded):
                image, text = _forward(teacher, crops[t], captions, settings.caption_keys)
                images[t].append(image.view(len(captions), -1, image.shape[-1]))
                for key in settings.caption_keys:
                    texts[t][key].append(text[key])
    if not keys:
        raise DataError(f"{describe_source(url)}: no sample with an image and a caption")
    stored = Reinforced(
        keys,
        [_facts(t) for t in loaded],
        [torch.cat(i) for i in images],
        [{k: torch.cat(v) for k, v in by_key.items()} for by_key in texts],
        torch.tensor(all_boxes, dtype=torch.int32) if settings.augmentations else None,
        settings.caption_keys,
        settings.augmentations,
        settings.dtype,
        settings.seed if settings.augmentations else None,
        shard_facts(url),
    )
    write_reinforced(path, stored)
    logger.info("%s: %d samples embedded", path, len(keys))
    return skipped, missing


def _sample_views(loaded: list[Teacher], settings: Settings, sample: dict) -> tuple[list, list, dict]:
    """(each teacher's uint8 crops of the sample's augmentations, the boxes, its captions); KeyError for a missing
    caption key, ValueError (or PIL's) for a missing or undecodable image."""
    captions = sample_captions(sample, settings.caption_keys)
    image = sample_image(sample)
    if image is None:
        raise ValueError("no image")
    boxes = crop_boxes(image, settings.augmentations, settings.seed, sample["__key__"])
    decoded = {}  # the image decoded once per draft scale, for every teacher
    return [teacher.crops(image, boxes, decoded) for teacher in loaded], boxes, captions


def _forward(teacher: Teacher, crops: list, captions: list[dict], caption_keys: list[str]) -> tuple:
    """The teacher's L2-normalised image embeddings of `crops` and text embeddings {key: (n, d)} of `captions`, in
    float32 on the CPU."""
    device = next(teacher.model.parameters()).device
    texts = [caption[key] for key in caption_keys for caption in captions]  # key-major: one slice per key
    tokens = teacher.tokenizer(
        texts, padding="max_length", truncation=True, max_length=teacher.text_length, return_tensors="pt"
    )
    with torch.no_grad():
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
) -> tuple[dict, int]:
    """`embed_shards` on every rank of a torchrun launch (its RANK, WORLD_SIZE, LOCAL_RANK; one rank per GPU, on the
    GPU of its LOCAL_RANK; gloo ranks on CPU), or in this one process when not launched. Returns (every rank's
    summary merged, this rank). The teachers are checked and fetched on rank 0 first; an error on any rank is raised
    on every rank, after all have finished (a rank that stopped early would leave the others waiting)."""
    settings = settings or Settings(teacher, tokenizer_name)
    rank, world, local = launched()
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    with process_group(world, device):
        decided_on_rank0(lambda: checked_fingerprints(settings.teachers))
        try:
            summary = embed_shards(settings.teachers, urls, out, batch_size, None, rank, world, device, settings)
            outcome = ("ok", summary)
        except DiscoClipError as error:
            outcome = ("error", error)
        outcomes = all_gathered(outcome)
    errors = [value for kind, value in outcomes if kind == "error"]
    if errors:
        raise errors[0]
    merged = {"embedded": [], "kept": [], "skipped": 0, "missing_captions": {}}
    for _, summary in outcomes:
        for name in ("embedded", "kept", "skipped"):
            merged[name] += summary[name]
        for key, n in summary["missing_captions"].items():
            merged["missing_captions"][key] = merged["missing_captions"].get(key, 0) + n
    return merged, rank


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
