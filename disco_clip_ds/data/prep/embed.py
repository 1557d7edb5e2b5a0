"""`disco-clip data embed`: a teacher's embeddings of every sample of webdataset shards, written once into a sidecar
per shard (data/embeddings.py), resumable: a shard whose sidecar verifies and is this teacher's is not embedded
again, so a re-run after a kill continues where the last one stopped."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from disco_clip_ds.data.embeddings import read_metadata, read_sidecar, sidecar_path, teacher_fingerprint, write_sidecar
from disco_clip_ds.data.shards import IMAGE_EXTS, is_url
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.transforms import ImageTransform, Normalize
from disco_clip_ds.errors import DataError, UsageError

logger = logging.getLogger("disco_clip_ds.data.embed")
TEXT_KEYS = ("txt", "text", "caption")


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


def embed_shards(
    teacher: str, urls: list[str], out: str | None, batch_size: int = 64, tokenizer_name: str | None = None
) -> dict:
    """Embed every sample of the local shards `urls` with `teacher` (a CLIPModel or SiglipModel folder or hub id)
    into sidecars in OUT (default: beside each shard). Returns {"embedded": [...], "kept": [...], "skipped": n}:
    shards written, shards whose sidecar already verified for this teacher, samples without image or caption (the
    training stream skips those too)."""
    from disco_clip_ds.models.build import build_model

    remote = [u for u in urls if is_url(u)]
    if remote:
        raise UsageError(f"data embed reads local shards only, not {remote[0]}")
    fingerprint = teacher_fingerprint(teacher)
    model = build_model(teacher).eval().requires_grad_(False)
    config = model.config
    tokenizer, length, transform, normalize = teacher_preprocessing(teacher, tokenizer_name, config)
    summary = {"embedded": [], "kept": [], "skipped": 0}
    for url in urls:
        path = sidecar_path(out or Path(url).parent, url)
        if path.is_file() and _verifies(path, fingerprint):
            summary["kept"].append(str(path))
            continue
        keys, images, texts = [], [], []
        samples = raw_samples(url)
        while batch := list(itertools.islice(samples, batch_size)):
            crops, captions = [], []
            for sample in batch:
                image = next((sample[k] for k in IMAGE_EXTS if k in sample), None)
                text = next((sample[k] for k in TEXT_KEYS if k in sample), None)
                try:
                    caption = text.decode("utf-8").strip() if text is not None else ""
                    if image is None or not caption:
                        raise ValueError("no image or no caption")
                    crops.append(transform.from_bytes(image, None))
                except Exception as error:  # as the training stream: skipped, counted, said
                    summary["skipped"] += 1
                    logger.warning("skipping sample %s of %s: %s", sample["__key__"], url, error)
                    continue
                captions.append(caption)
                keys.append(sample["__key__"])
            if not crops:
                continue
            tokens = tokenizer(captions, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
            with torch.no_grad():
                outputs = model(
                    input_ids=tokens["input_ids"],
                    attention_mask=tokens.get("attention_mask"),
                    pixel_values=normalize(crops),
                    return_loss=False,
                    return_logits=False,
                )
            images.append(outputs.image_embeds.float())
            texts.append(outputs.text_embeds.float())
        if not keys:
            raise DataError(f"{url}: no sample with an image and a caption")
        params = model.logit_params()
        meta = {
            "teacher": fingerprint,
            "teacher_name": teacher,
            "model_type": config.model_type,
            "logit_scale": repr(float(params[0])),
            "logit_bias": repr(float(params[1])) if len(params) > 1 else "",
            "shard": Path(url).name,
        }
        write_sidecar(path, keys, torch.cat(images), torch.cat(texts), meta)
        summary["embedded"].append(str(path))
        logger.info("%s: %d samples embedded", path, len(keys))
    return summary


def _verifies(path: Path, fingerprint: str) -> bool:
    """A sidecar already there counts as done when it is this teacher's and its checksum verifies."""
    try:
        if read_metadata(path).get("teacher") != fingerprint:
            return False
        read_sidecar(path)
        return True
    except DataError:
        return False
