"""A teacher's embeddings stored once per shard (`disco-clip data embed`, read by `--teacher_embeddings`): a sidecar
file per shard, NAME.DIGEST.teacher.safetensors for NAME.tar, holding the teacher's L2-normalised image and text
embeddings of every sample of the shard, one row per sample key.

DIGEST is 12 hex digits of the sha256 of the shard's identity (`shard_identity`: a local shard's absolute path, a
remote one's public description), so that shards of one file name in two sources (`a/00000.tar`, `b/00000.tar`) get
two sidecars in one folder; moving the shards to another folder means embedding them again.

Sidecar layout: fp32 tensors "image" and "text" (n, d'), and metadata "keys" (the sample keys, JSON, in row order),
"teacher" (the teacher's fingerprint, `teacher_fingerprint`), "shard" (its shard's identity) and "shard_bytes" (its
size, for a local shard), "model_type", "logit_scale" (the teacher's multiplier) and "logit_bias" (SigLIP), "sha256"
(of the keys and both tensors' bytes: a torn or altered file is found when read). A reader checks the teacher, the
shard and its size (`sidecar_problem`) before it uses a row.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.shards import is_url
from disco_clip_ds.errors import DataError, UsageError

SUFFIX = ".teacher.safetensors"
KEEP_SIDECARS = 4  # sidecars a DataLoader worker keeps loaded


def shard_identity(shard: str) -> str:
    """What a sidecar records of its shard: a local shard's absolute path; a remote one's public description (the
    training stream names a remote shard's samples by it, and it holds no credential)."""
    return describe_source(shard) if is_url(shard) else os.path.abspath(shard)


def sidecar_path(folder: str | Path, shard: str) -> Path:
    """The sidecar of shard `shard` (a path or URL) in FOLDER: its file name with .tar replaced by .DIGEST + SUFFIX,
    DIGEST from the shard's identity, so that two shards of one name never share a sidecar."""
    digest = hashlib.sha256(shard_identity(shard).encode()).hexdigest()[:12]
    return Path(folder) / f"{_stem(shard)}.{digest}{SUFFIX}"


def _stem(shard: str) -> str:
    name = Path(shard.rstrip("/")).name
    return name[: -len(".tar")] if name.endswith(".tar") else name


def shard_facts(shard: str) -> dict:
    """The metadata a sidecar records of its shard: its identity and, for a local shard, its size in bytes."""
    size = _size(shard)
    return {"shard": shard_identity(shard), **({"shard_bytes": size} if size is not None else {})}


def _size(shard: str) -> str | None:
    return str(os.path.getsize(shard)) if not is_url(shard) and os.path.isfile(shard) else None


def sidecar_problem(meta: dict, shard: str, fingerprint: str) -> str | None:
    """Why a sidecar (its metadata `meta`) may not serve shard `shard` for the teacher of `fingerprint`: made by
    another teacher, for another shard (a sidecar renamed or copied), for the shard as it was before it was written
    again (another size); None when it may."""
    if meta.get("teacher") != fingerprint:
        return f"made by another teacher (fingerprint {meta.get('teacher')}, not {fingerprint})"
    if meta.get("shard") != shard_identity(shard):
        return f"made for shard {describe_source(meta.get('shard', '?'))}, not {describe_source(shard)}"
    recorded, size = meta.get("shard_bytes"), _size(shard)
    if recorded is not None and size is not None and recorded != size:
        return f"made for {describe_source(shard)} when it held {recorded} bytes; it now holds {size}"
    return None


def check_sidecars(folder: str | Path, urls: list[str], fingerprint: str, teacher: str) -> None:
    """Before training: every shard of `urls` has a sidecar in FOLDER that may serve it (`sidecar_problem`, from the
    headers alone; checksums are verified as each is read); else a UsageError in one line saying what to run."""
    embed = f"run `disco-clip data embed --teacher {teacher} --shards ... --output {folder}`"
    for url in urls:
        path = sidecar_path(folder, url)
        if not path.is_file():
            old = Path(folder) / (_stem(url) + SUFFIX)  # how an older version named it
            why = f": {old.name} is an older version's, named by the shard's file name alone" if old.is_file() else ""
            raise UsageError(
                f"--teacher_embeddings {folder}: no embeddings of shard {describe_source(url)} ({path.name}){why}: "
                f"{embed}"
            )
        try:
            problem = sidecar_problem(read_metadata(path), url, fingerprint)
        except DataError as error:
            raise UsageError(str(error)) from error
        if problem:
            raise UsageError(f"--teacher_embeddings {folder}: {path.name} was {problem}: {embed}")


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
    """Write a shard's embeddings to PATH atomically (a temporary file renamed): a kill leaves the old file or none.
    The same embeddings and metadata give the same bytes (`_canonical`)."""
    from safetensors.torch import save

    image, text = image.float().contiguous(), text.float().contiguous()
    metadata = {
        **{k: str(v) for k, v in meta.items()},
        "keys": json.dumps(keys),
        "sha256": _checksum(keys, image, text),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(_canonical(save({"image": image, "text": text}, metadata=metadata)))
    os.replace(tmp, path)


def _canonical(data: bytes) -> bytes:
    """A safetensors file with its JSON header's keys sorted: safetensors writes the metadata map in an order that
    changes from one write to the next (a Rust HashMap), which would make two writes of one sidecar differ. The
    header stays what the format says: its length (8 bytes, little-endian), the JSON padded with spaces to a multiple
    of 8, then the tensors' bytes, unchanged."""
    length = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + length]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + length :]


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
        sidecar or the key is missing, or the sidecar may not serve this shard (`sidecar_problem`) or does not
        verify."""
        if shard not in self._loaded:
            path = sidecar_path(self.folder, shard)
            if not path.is_file():
                raise DataError(
                    f"no teacher embeddings for shard {describe_source(shard)} (sample {key}): {path} is missing"
                )
            rows, image, text, meta = read_sidecar(path)
            problem = sidecar_problem(meta, shard, self.fingerprint)
            if problem:
                raise DataError(f"{path}: {problem}: run `disco-clip data embed` for these shards again")
            if len(self._loaded) >= KEEP_SIDECARS:  # a shuffle block may span a few shards; older ones are done
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[shard] = (rows, image, text)
        rows, image, text = self._loaded[shard]
        row = rows.get(key)
        if row is None:
            raise DataError(
                f"no teacher embedding for sample {key} of shard {describe_source(shard)} in "
                f"{sidecar_path(self.folder, shard)}"
            )
        return image[row], text[row]
