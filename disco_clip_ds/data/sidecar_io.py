"""A sidecar written and read whole (data/embeddings.py describes the layout): the first layout's writer
(`write_sidecar`), the second's (`write_reinforced`, format 3), their readers, which verify every checksum before
returning a row (`read_sidecar`, `read_reinforced`), and the header alone (`read_metadata`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from disco_clip_ds.atomic import write_bytes
from disco_clip_ds.data.reinforced import (
    DTYPES,
    LEGACY_CAPTION_KEY,
    SECOND_LAYOUT,
    Reinforced,
    block_digests,
    block_rows,
    header_digest,
    reinforced_checksum,
    settings_of,
    settings_problem,
    with_first_teacher,
)
from disco_clip_ds.data.sidecar_file import open_sidecar
from disco_clip_ds.errors import DataError, UsageError


def _checksum(keys: list[str], image: torch.Tensor, text: torch.Tensor) -> str:
    digest = hashlib.sha256(json.dumps(keys).encode())
    for tensor in (image, text):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def write_sidecar(path: Path, keys: list[str], image: torch.Tensor, text: torch.Tensor, meta: dict) -> None:
    """Write a shard's embeddings to PATH atomically (a temporary file renamed): a kill leaves the old file or none.
    The same embeddings and metadata give the same bytes (`_canonical`)."""
    from safetensors.torch import save

    image, text = image.float().contiguous(), text.float().contiguous()
    metadata = {
        **{k: str(v) for k, v in meta.items()},
        "keys": json.dumps(keys),
        "sha256": _checksum(keys, image, text),
    }
    write_bytes(path, _canonical(save({"image": image, "text": text}, metadata=metadata)))


def _canonical(data: bytes, signed: bool = False) -> bytes:
    """A safetensors file with its JSON header's keys sorted: safetensors writes the metadata map in an order that
    changes from one write to the next (a Rust HashMap), which would make two writes of one sidecar differ. The
    header stays what the format says: its length (8 bytes, little-endian), the JSON padded with spaces to a multiple
    of 8, then the tensors' bytes, unchanged. `signed`: its metadata gets "sha256", of the header (`header_digest`)."""
    length = int.from_bytes(data[:8], "little")
    parsed = json.loads(data[8 : 8 + length])
    if signed:
        parsed["__metadata__"]["sha256"] = header_digest(parsed)
    header = json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + length :]


def read_metadata(path: Path) -> dict:
    """A sidecar's metadata (its header alone); a DataError naming the file when it cannot be read. Of a sidecar of
    the second layout it also holds "teacher", "teacher_name", "model_type", "logit_scale" and "logit_bias" of its
    first teacher, where a reader of the first layout finds them (`with_first_teacher`)."""
    return with_first_teacher(raw_metadata(path))


def raw_metadata(path: Path) -> dict:
    """A sidecar's metadata as stored, once its settings read (`settings_problem`); else a DataError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error}") from error
    problem = settings_problem(meta)
    if problem:
        raise DataError(f"{path}: {problem}: run `disco-clip data embed` for its shard again")
    return meta


def _read_whole(path: Path, matches) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(the sample keys, every tensor) of a sidecar read whole through the one reader of its header and rows
    (data/sidecar_file.py: the layout and every value checked; a format-3 file's blocks verified, an older one's
    whole-file checksum by `matches(keys, tensors)`)."""
    sidecar = open_sidecar(path)
    try:
        return sidecar.keys, sidecar.read_all(lambda tensors: matches(sidecar.keys, tensors))
    finally:
        sidecar.close()


def read_sidecar(path: Path) -> tuple[dict[str, int], torch.Tensor, torch.Tensor, dict]:
    """({key: row}, image, text, metadata) of a sidecar, once its checksum verifies; else a DataError naming it. Of a
    sidecar of several teachers, augmentations or captions: the first teacher's image embedding of the first
    augmentation and its text embedding of the first caption key, as float32 (what curation and resharding read)."""
    if raw_metadata(path).get("format") in SECOND_LAYOUT:
        stored = read_reinforced(path)
        image, text = stored.images[0][:, 0].float(), stored.texts[0][stored.caption_keys[0]].float()
        return stored.rows(), image, text, read_metadata(path)
    meta = read_metadata(path)
    keys, tensors = _read_whole(path, lambda keys, t: _checksum(keys, t["image"], t["text"]) == meta.get("sha256"))
    return {k: i for i, k in enumerate(keys)}, tensors["image"], tensors["text"], meta


def write_reinforced(path: Path, stored: Reinforced) -> None:
    """Write a shard's reinforcement to PATH atomically (a temporary file renamed): a kill leaves the old file or none.
    The embeddings are cast to `stored.dtype`; the same contents give the same bytes (`_canonical`). Format 3: a
    checksum per block of rows ("block_rows", "block_xxh3") and one of the header ("sha256")."""
    from safetensors.torch import save

    if stored.dtype not in DTYPES:
        raise UsageError(f"--embedding_dtype {stored.dtype}: give one of {', '.join(DTYPES)}")
    dtype = DTYPES[stored.dtype]
    tensors = {
        name: (t.to(torch.int32) if name == "boxes" else t.to(dtype)).contiguous()
        for name, t in stored.tensors().items()
    }
    _check_finite(path, stored.keys, tensors)
    rows = block_rows(sum(t[:1].nbytes for t in tensors.values()))
    header = {**stored.header(), "block_rows": str(rows), "block_xxh3": json.dumps(block_digests(tensors, rows))}
    write_bytes(path, _canonical(save(tensors, metadata=header), signed=True))


def _check_finite(path: Path, keys: list[str], tensors: dict[str, torch.Tensor]) -> None:
    """Every stored embedding finite (after the cast to the stored dtype); else a DataError naming the first sample
    that is not, with nothing written: a reader refuses such a row, so it is never stored."""
    for name, tensor in sorted(tensors.items()):
        bad = torch.nonzero(~torch.isfinite(tensor.flatten(1)).all(dim=1)) if name != "boxes" else []
        if len(bad):
            raise DataError(
                f"{path}: the embedding {name} of sample {keys[int(bad[0])]} is not finite (the teacher's forward "
                "overflowed: embed with --precision float32): nothing written"
            )


def read_reinforced(path: Path) -> Reinforced:
    """A sidecar's reinforcement, once it verifies whole (any format; a first-layout one as one teacher, K = 0 and
    the caption key "txt"), in the stored dtype; else a DataError naming it."""
    meta = raw_metadata(path)
    if meta.get("format") not in SECOND_LAYOUT:
        rows, image, text, meta = read_sidecar(path)
        return replace(settings_of(meta), keys=list(rows), images=[image[:, None]], texts=[{LEGACY_CAPTION_KEY: text}])
    keys, tensors = _read_whole(path, lambda keys, t: reinforced_checksum(meta, t) == meta.get("sha256"))
    stored, prints = settings_of(meta), [t.fingerprint for t in settings_of(meta).teachers]
    return replace(
        stored,
        keys=keys,
        images=[tensors[f"image/{f}"] for f in prints],
        texts=[{key: tensors[f"text/{f}/{key}"] for key in stored.caption_keys} for f in prints],
        boxes=tensors.get("boxes"),
    )
