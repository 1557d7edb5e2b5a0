"""A teacher's embeddings stored once per shard (`disco-clip data embed`, read by `--teacher_embeddings`): a sidecar
file beside each shard, NAME.teacher.safetensors for NAME.tar, holding the teacher's L2-normalised image and text
embeddings of every sample of the shard, one row per sample key.

Sidecar layout: fp32 tensors "image" and "text" (n, d'), and metadata "keys" (the sample keys, JSON, in row order),
"teacher" (the teacher's fingerprint, `teacher_fingerprint`), "model_type", "logit_scale" (the teacher's multiplier)
and "logit_bias" (SigLIP), "sha256" (of the keys and both tensors' bytes: a torn or altered file is found when read).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from disco_clip_ds.errors import DataError, UsageError

SUFFIX = ".teacher.safetensors"
KEEP_SIDECARS = 4  # sidecars a DataLoader worker keeps loaded


def sidecar_path(folder: str | Path, shard: str) -> Path:
    """The sidecar of shard `shard` (a path or URL) in FOLDER: its file name with .tar replaced by SUFFIX."""
    name = Path(shard.rstrip("/")).name
    return Path(folder) / ((name[: -len(".tar")] if name.endswith(".tar") else name) + SUFFIX)


def teacher_fingerprint(name_or_path: str) -> str:
    """A short fingerprint of a teacher's weights: sha256 of a folder's config.json and weight files, or of a hub id's
    resolved config and weights (as transformers caches them)."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(name_or_path, allow_patterns=["config.json", "*.safetensors", "*.bin"]))
    digest = hashlib.sha256()
    files = sorted(
        p for p in folder.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin") and p.is_file()
    )
    if not any(p.name == "config.json" for p in files):
        raise UsageError(f"{name_or_path}: no config.json: not a model folder")
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _checksum(keys: list[str], image: torch.Tensor, text: torch.Tensor) -> str:
    digest = hashlib.sha256(json.dumps(keys).encode())
    for tensor in (image, text):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def write_sidecar(path: Path, keys: list[str], image: torch.Tensor, text: torch.Tensor, meta: dict) -> None:
    """Write a shard's embeddings to PATH atomically (a temporary file renamed): a kill leaves the old file or none."""
    from safetensors.torch import save_file

    image, text = image.float().contiguous(), text.float().contiguous()
    metadata = {
        **{k: str(v) for k, v in meta.items()},
        "keys": json.dumps(keys),
        "sha256": _checksum(keys, image, text),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"image": image, "text": text}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_metadata(path: Path) -> dict:
    """A sidecar's metadata (its header alone); a DataError naming the file when it cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error}") from error


def read_sidecar(path: Path) -> tuple[dict[str, int], torch.Tensor, torch.Tensor, dict]:
    """({key: row}, image, text, metadata) of a sidecar, once its checksum verifies; else a DataError naming it."""
    from safetensors.torch import load_file

    meta = read_metadata(path)
    try:
        tensors, keys = load_file(str(path)), json.loads(meta["keys"])
    except Exception as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error}") from error
    if _checksum(keys, tensors["image"], tensors["text"]) != meta.get("sha256"):
        raise DataError(f"{path}: its checksum does not match its contents: run `disco-clip data embed` again")
    return {k: i for i, k in enumerate(keys)}, tensors["image"], tensors["text"], meta


class EmbeddingStore:
    """The sidecars in FOLDER made by the teacher of fingerprint `fingerprint`, looked up by (shard, sample key).
    Each DataLoader worker loads a shard's sidecar once, when its first sample is asked for."""

    def __init__(self, folder: str | Path, fingerprint: str):
        self.folder, self.fingerprint = Path(folder), fingerprint
        self._loaded: dict[str, tuple] = {}

    def lookup(self, shard: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's (image, text) embeddings of sample `key` of `shard`: a DataError naming both when the
        sidecar or the key is missing, or the sidecar is another teacher's or does not verify."""
        if shard not in self._loaded:
            path = sidecar_path(self.folder, shard)
            if not path.is_file():
                raise DataError(f"no teacher embeddings for shard {shard} (sample {key}): {path} is missing")
            rows, image, text, meta = read_sidecar(path)
            if meta.get("teacher") != self.fingerprint:
                raise DataError(f"{path}: made by another teacher ({meta.get('teacher')}, not {self.fingerprint})")
            if len(self._loaded) >= KEEP_SIDECARS:  # a shuffle block may span a few shards; older ones are done
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[shard] = (rows, image, text)
        rows, image, text = self._loaded[shard]
        row = rows.get(key)
        if row is None:
            raise DataError(
                f"no teacher embedding for sample {key} of shard {shard} in {sidecar_path(self.folder, shard)}"
            )
        return image[row], text[row]
