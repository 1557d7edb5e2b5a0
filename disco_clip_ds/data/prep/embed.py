"""`disco-clip data embed`: a teacher's embeddings of every sample of webdataset shards, written once into a sidecar
per shard (data/embeddings.py), resumable: a shard whose sidecar verifies and is this teacher's is not embedded
again, so a re-run after a kill continues where the last one stopped. The teacher is checked before any model is
built: a name that is neither a folder nor a model on the hub, or a model type whose embeddings cannot be stored here,
is one line (exit 2)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from disco_clip_ds.data.embeddings import (
    read_metadata,
    read_sidecar,
    shard_facts,
    shard_identity,
    sidecar_path,
    sidecar_problem,
    teacher_fingerprint,
    write_sidecar,
)
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import IMAGE_EXTS, is_url, shard_sizes
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.transforms import ImageTransform, Normalize
from disco_clip_ds.distributed.ranks import all_gathered, decided_on_rank0
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError

logger = logging.getLogger("disco_clip_ds.data.embed")
TEXT_KEYS = ("txt", "text", "caption")
MODEL_TYPES = ("clip", "siglip")  # teachers with one image size, whose center crops data embed stores


def teacher_config(teacher: str):
    """The teacher's config, read before any model is built; a UsageError in one line for a folder that is not there,
    a name that is neither a model folder nor a model on the hub (or, offline, in its cache), and a model type whose
    embeddings this command cannot store."""
    from disco_clip_ds.models.build import load_config

    folder = Path(teacher).expanduser()
    if not folder.exists() and teacher.startswith(("/", "./", "../", "~")):
        raise UsageError(f"--teacher {teacher}: no such folder")
    try:
        config = load_config(str(folder) if folder.exists() else teacher)
    except (OSError, ValueError) as error:  # transformers' messages run over several lines
        what = "not a model folder" if folder.exists() else "no such folder, nor a model on the hub or in its cache"
        raise UsageError(f"--teacher {teacher}: {what} ({str(error).splitlines()[0]})") from error
    if config.model_type == "siglip2":
        raise UsageError(
            f"--teacher {teacher}: a SigLIP 2 model, whose NaFlex image input has no one image size to crop to; "
            f"data embed stores the embeddings of {' and '.join(MODEL_TYPES)} teachers"
        )
    if config.model_type not in MODEL_TYPES:
        raise UsageError(f"--teacher {teacher}: a {config.model_type} model; give a CLIPModel or SiglipModel")
    return config


def teacher_preprocessing(name_or_path: str, tokenizer_name: str | None, config):
    """(tokenizer, text length, ImageTransform, Normalize) of the teacher's own view of a sample: its tokenizer (or
    `tokenizer_name`), padded to its text positions, and a center crop at its image size with its normalisation
    (its image processor's, else CLIP's)."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPImageProcessor

    source = tokenizer_name or name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"{source}: no tokenizer ({error}); pass --tokenizer_name") from error
    if len(tokenizer) < 3:  # transformers builds an empty tokenizer from a folder without tokenizer files
        raise UsageError(f"{source}: no tokenizer files; pass --tokenizer_name")
    try:
        processor = AutoImageProcessor.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError):
        processor = CLIPImageProcessor()
    size = config.vision_config.image_size
    return (
        tokenizer,
        config.text_config.max_position_embeddings,
        ImageTransform(size, train=False),
        Normalize(processor.image_mean, processor.image_std),
    )


@dataclass
class Teacher:
    """A teacher as data embed runs it: the model (eval mode, no gradients), its fingerprint, and its own view of a
    sample (`teacher_preprocessing`)."""

    name: str
    model: torch.nn.Module
    fingerprint: str
    tokenizer: object
    text_length: int
    transform: ImageTransform
    normalize: Normalize


def checked_fingerprint(teacher: str) -> str:
    """`teacher`'s fingerprint once its config is checked (`teacher_config`); a UsageError in one line when its
    weights cannot be read. A hub id's files are fetched here (into the cache the model is then built from)."""
    teacher_config(teacher)
    try:
        return teacher_fingerprint(teacher)
    except (OSError, ValueError) as error:  # a hub id whose weights cannot be fetched
        raise UsageError(f"--teacher {teacher}: its weights cannot be read ({str(error).splitlines()[0]})") from error


def load_teacher(teacher: str, tokenizer_name: str | None = None, device: str | torch.device = "cpu") -> Teacher:
    """`teacher` (a CLIPModel or SiglipModel folder or hub id) checked, fingerprinted (`checked_fingerprint`) and
    built on `device`; a UsageError in one line when it cannot be."""
    from disco_clip_ds.models.build import build_model

    fingerprint = checked_fingerprint(teacher)
    model = build_model(teacher).eval().requires_grad_(False).to(device)
    tokenizer, length, transform, normalize = teacher_preprocessing(teacher, tokenizer_name, model.config)
    return Teacher(teacher, model, fingerprint, tokenizer, length, transform, normalize)


def sample_image(sample: dict) -> bytes | None:
    """The encoded image of a webdataset sample (its first image extension), None when it has none."""
    return next((sample[k] for k in IMAGE_EXTS if k in sample), None)


def embed_shards(
    teacher: str,
    urls: list[str],
    out: str | None,
    batch_size: int = 64,
    tokenizer_name: str | None = None,
    rank: int = 0,
    world: int = 1,
    device: str | torch.device = "cpu",
) -> dict:
    """Embed every sample of the local shards `urls` with `teacher` (a CLIPModel or SiglipModel folder or hub id)
    into sidecars in OUT (default: beside each shard). Returns {"embedded": [...], "kept": [...], "skipped": n}:
    shards written, shards whose sidecar already verified for this teacher, samples without image or caption (the
    training stream skips those too).

    Rank `rank` of `world` embeds shards rank, rank + world, ... of `urls` (`embed_launched` runs every rank) and
    shows a progress bar when it is rank 0."""
    remote = [u for u in urls if is_url(u)]
    if remote:
        raise UsageError(f"data embed reads local shards only, not {describe_source(remote[0])}")
    paths = _sidecar_paths(urls, out)[rank::world]  # every shard's, so that one named twice is found on any rank
    urls = urls[rank::world]
    loaded = load_teacher(teacher, tokenizer_name, device)
    summary = {"embedded": [], "kept": [], "skipped": 0}
    with _progress(urls, rank, world) as bar:
        for url, path in zip(urls, paths):
            if path.is_file() and _verifies(path, url, loaded.fingerprint):
                summary["kept"].append(str(path))
                bar.update(_recorded_size(url))
                continue
            summary["skipped"] += _embed_shard(loaded, url, path, batch_size, bar)
            summary["embedded"].append(str(path))
    return summary


def _embed_shard(loaded: Teacher, url: str, path: Path, batch_size: int, bar) -> int:
    """Write shard `url`'s sidecar at PATH; returns the samples skipped (no image or caption, or undecodable)."""
    keys, images, texts, skipped = [], [], [], 0
    device = next(loaded.model.parameters()).device
    samples = raw_samples(url)
    while batch := list(itertools.islice(samples, batch_size)):
        crops, captions = [], []
        for sample in batch:
            image = sample_image(sample)
            text = next((sample[k] for k in TEXT_KEYS if k in sample), None)
            try:
                caption = text.decode("utf-8").strip() if text is not None else ""
                if image is None or not caption:
                    raise ValueError("no image or no caption")
                crops.append(loaded.transform.from_bytes(image, None))
            except Exception as error:  # as the training stream: skipped, counted, said
                skipped += 1
                logger.warning("skipping sample %s of %s: %s", sample["__key__"], describe_source(url), error)
                continue
            captions.append(caption)
            keys.append(sample["__key__"])
        bar.update(len(batch))
        if not crops:
            continue
        tokens = loaded.tokenizer(
            captions, padding="max_length", truncation=True, max_length=loaded.text_length, return_tensors="pt"
        )
        with torch.no_grad():
            outputs = loaded.model(
                input_ids=tokens["input_ids"].to(device),
                attention_mask=tokens["attention_mask"].to(device) if "attention_mask" in tokens else None,
                pixel_values=loaded.normalize(crops).to(device),
                return_loss=False,
                return_logits=False,
            )
        images.append(outputs.image_embeds.float().cpu())
        texts.append(outputs.text_embeds.float().cpu())
    if not keys:
        raise DataError(f"{describe_source(url)}: no sample with an image and a caption")
    params = loaded.model.logit_params()
    meta = {
        "teacher": loaded.fingerprint,
        "teacher_name": loaded.name,
        "model_type": loaded.model.config.model_type,
        "logit_scale": repr(float(params[0])),
        "logit_bias": repr(float(params[1])) if len(params) > 1 else "",
        **shard_facts(url),
    }
    write_sidecar(path, keys, torch.cat(images), torch.cat(texts), meta)
    logger.info("%s: %d samples embedded", path, len(keys))
    return skipped


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
    teacher: str, urls: list[str], out: str | None, batch_size: int = 64, tokenizer_name: str | None = None
) -> tuple[dict, int]:
    """`embed_shards` on every rank of a torchrun launch (its RANK, WORLD_SIZE, LOCAL_RANK; one rank per GPU, on the
    GPU of its LOCAL_RANK; gloo ranks on CPU), or in this one process when not launched. Returns (every rank's
    summary merged, this rank). The teacher is checked and fetched on rank 0 first; an error on any rank is raised
    on every rank, after all have finished (a rank that stopped early would leave the others waiting)."""
    rank, world, local = (int(os.environ.get(name, default)) for name, default in _LAUNCH)
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    with _process_group(world, device):
        decided_on_rank0(lambda: checked_fingerprint(teacher))
        try:
            outcome = ("ok", embed_shards(teacher, urls, out, batch_size, tokenizer_name, rank, world, device))
        except DiscoClipError as error:
            outcome = ("error", error)
        outcomes = all_gathered(outcome)
    errors = [value for kind, value in outcomes if kind == "error"]
    if errors:
        raise errors[0]
    merged = {"embedded": [], "kept": [], "skipped": 0}
    for _, summary in outcomes:
        for name in merged:
            merged[name] += summary[name]
    return merged, rank


_LAUNCH = (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0))  # torchrun's variables, and their values alone


@contextlib.contextmanager
def _process_group(world: int, device: torch.device):
    """A process group of `world` ranks for the duration (NCCL on GPUs, gloo on CPU); nothing for one rank."""
    import torch.distributed as dist

    if world <= 1 or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


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


def _verifies(path: Path, url: str, fingerprint: str) -> bool:
    """A sidecar already there counts as done when it may serve this shard for this teacher and its checksum
    verifies; one made for another shard (a sidecar renamed or copied there) is refused rather than overwritten."""
    try:
        meta = read_metadata(path)
        if meta.get("shard") not in (None, shard_identity(url)):
            raise UsageError(
                f"{path}: holds the embeddings of shard {describe_source(meta['shard'])}, not of "
                f"{describe_source(url)}: remove it, or give another --output"
            )
        if sidecar_problem(meta, url, fingerprint):
            return False
        read_sidecar(path)
        return True
    except DataError:
        return False
