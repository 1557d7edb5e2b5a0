"""The target set of DataComp's image-based filter as embeddings: `data filter --target` keeps the training samples
whose cluster centre is the nearest centre of at least one of these.

A target is one of
- a shards folder whose shards have `data embed` sidecars beside them: their stored image embeddings, read, not
  recomputed;
- a CLIP_benchmark-style eval folder (classnames.txt beside test/*.tar, or beside the *.tar themselves as the demo's
  eval split has them) or a shards folder without sidecars: its images embedded by the teacher, with data embed's
  preprocessing (the teacher's center crop and normalisation), so they sit where the training set's sidecars do;
- a text file of class names, one per line (CLIP_benchmark's classnames.txt): the teacher's text embeddings of
  "a photo of a {name}." (`CLASS_TEMPLATE`, one template: DataComp's target is images, and a class name stands in for
  its images; the 80 OpenAI templates are ImageNet's wording, and a small teacher's tokenizer may not know it).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

from disco_clip_ds.data.embeddings import read_sidecar, sidecar_path, sidecar_problem
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.teacher_id import teacher_fingerprint
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.texts import read_lines

CLASS_TEMPLATE = "a photo of a {name}."


def target_embeddings(
    target: str, teacher: str | None, tokenizer_name: str | None = None, batch_size: int = 64
) -> np.ndarray:
    """The target's embeddings, (n, d) float32, L2-normalised, in shard and sample order (or class-name order).

    `teacher`: the model whose embeddings the training set has (a folder or hub id). A folder of sidecars made by
    another teacher is refused in one line; None takes the sidecars as they are (all of one teacher). Images and class
    names need it. A UsageError in one line for a target that is none of the kinds above."""
    path = Path(target).expanduser()
    if path.is_file():
        return _class_name_embeddings(path, _need(teacher, target, "class names"), tokenizer_name, batch_size)
    if not path.is_dir():
        raise UsageError(f"--target {target}: no such file or folder")
    shards = _target_shards(path)
    if not shards:
        raise UsageError(
            f"--target {target}: no *.tar shards in it (nor in {path / 'test'}); give a shards folder, a "
            "CLIP_benchmark-style eval folder or a text file of class names"
        )
    sidecars = [sidecar_path(path, s) for s in shards]
    if any(p.is_file() for p in sidecars):
        return _stored_embeddings(target, shards, sidecars, teacher)
    return _image_embeddings(shards, _need(teacher, target, "images"), tokenizer_name, batch_size)


def _need(teacher: str | None, target: str, what: str) -> str:
    if not teacher:
        raise UsageError(f"--target {target}: its {what} must be embedded: give the teacher that embedded the shards")
    return teacher


def _target_shards(folder: Path) -> list[str]:
    """A CLIP_benchmark folder's test/*.tar, else the folder's own *.tar, sorted by name."""
    test = folder / "test"
    tars = sorted(test.glob("*.tar")) if test.is_dir() else []
    return [str(p) for p in tars or sorted(folder.glob("*.tar"))]


def _stored_embeddings(target: str, shards: list[str], sidecars: list[Path], teacher: str | None) -> np.ndarray:
    """The image embeddings the sidecars beside `shards` hold; every shard must have one, all of one teacher (the
    named one, when given)."""
    fingerprint = teacher_fingerprint(teacher) if teacher else None
    rows = []
    for shard, path in zip(shards, sidecars):
        if not path.is_file():
            raise UsageError(
                f"--target {target}: shard {describe_source(shard)} has no sidecar ({path.name}) where the others "
                f"have: run `disco-clip data embed --teacher TEACHER --shards {Path(target)}`"
            )
        _, image, _, meta = read_sidecar(path)
        fingerprint = fingerprint or meta.get("teacher")
        problem = sidecar_problem(meta, shard, fingerprint)
        if problem:
            who = f"--teacher {teacher}" if teacher else f"the other sidecars' teacher ({fingerprint})"
            raise UsageError(
                f"--target {target}: {path.name} was {problem}; the training set is embedded by {who}: embed the "
                "target with that teacher"
            )
        rows.append(image.float())
    return _normalised(torch.cat(rows))


def _image_embeddings(shards: list[str], teacher: str, tokenizer_name: str | None, batch_size: int) -> np.ndarray:
    """The teacher's embeddings of every image of `shards` (samples without a decodable image: a DataError)."""
    from disco_clip_ds.data.prep.embed import load_teacher, sample_image

    loaded = load_teacher(teacher, tokenizer_name)
    rows = []
    for shard in shards:
        samples = raw_samples(shard)
        while batch := list(itertools.islice(samples, batch_size)):
            crops = []
            for sample in batch:
                image = sample_image(sample)
                try:
                    if image is None:
                        raise ValueError("no image")
                    crops.append(loaded.transform.from_bytes(image, None))
                except Exception as error:  # a target image that cannot be read would silently narrow the target
                    where = f"sample {sample['__key__']} of {describe_source(shard)}"
                    raise DataError(f"--target: {where}: {error}") from error
            with torch.no_grad():
                out = loaded.model.image_features(loaded.normalize(crops)).pooler_output
            rows.append(out.float())
    return _normalised(torch.cat(rows))


def _class_name_embeddings(path: Path, teacher: str, tokenizer_name: str | None, batch_size: int) -> np.ndarray:
    """The teacher's text embeddings of CLASS_TEMPLATE for each class name of the file (blank lines skipped), padded
    as data embed pads captions."""
    from disco_clip_ds.data.prep.embed import load_teacher

    if path.suffix in (".tar", ".safetensors", ".parquet", ".npy"):
        raise UsageError(f"--target {path}: a {path.suffix} file, not a text file of class names: give its folder")
    names = read_lines(path, "--target")
    if not names:
        raise UsageError(f"--target {path}: no class names in it (one per line)")
    loaded = load_teacher(teacher, tokenizer_name)
    prompts, rows = [CLASS_TEMPLATE.format(name=name) for name in names], []
    for start in range(0, len(prompts), batch_size):
        tokens = loaded.tokenizer(
            prompts[start : start + batch_size],
            padding="max_length",
            truncation=True,
            max_length=loaded.text_length,
            return_tensors="pt",
        )
        with torch.no_grad():
            out = loaded.model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens.get("attention_mask")
            ).pooler_output
        rows.append(out.float())
    return _normalised(torch.cat(rows))


def _normalised(embeddings: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(embeddings.float(), dim=-1).numpy().astype(np.float32)
