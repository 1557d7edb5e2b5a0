"""A shard's stored reinforcement in memory (`Reinforced`: the sample keys, each teacher's facts and embeddings, the
crop boxes, the settings), the settings a sidecar's header records, and the checksums of its stored form (format 3:
one per block of rows and one of the header; format 2: one of the whole file); data/embeddings.py describes the
layout, data/sidecar_io.py writes and reads it whole, data/sidecar_file.py by rows."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

FORMAT = "3"  # the metadata "format" written: the second layout, with a checksum per block of rows
WHOLE_FILE_FORMAT = "2"  # the second layout as first written: one checksum of the whole file
SECOND_LAYOUT = (WHOLE_FILE_FORMAT, FORMAT)  # the formats of several teachers, augmentations and captions
LEGACY_CAPTION_KEY = "txt"  # the caption key a first-layout sidecar's one text embedding is read under
# a block of rows is what a reader verifies (and keeps) at once: about BLOCK_BYTES of every tensor's rows together, at
# least one row and at most BLOCK_ROWS; a sample of DataCompDR's shape (111 kB) is a block of its own, so that a
# sample read at random reads its own bytes alone, while small rows are read and verified some 64 kB at a time
BLOCK_BYTES = 1 << 16
BLOCK_ROWS = 64
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# what a sidecar records of its shard: its identity, size and (a resharded shard's) sha256
SHARD_META = ("shard", "shard_bytes", "shard_sha256")


@dataclass(frozen=True)
class TeacherFacts:
    """What a sidecar records of one teacher: its fingerprint, the name it was given by, its model type, its logit
    scale (the multiplier) and bias (SigLIP's; None for CLIP). A first-layout sidecar may lack the last three."""

    fingerprint: str
    name: str = ""
    model_type: str = ""
    logit_scale: float | None = None
    logit_bias: float | None = None

    @classmethod
    def from_json(cls, item: dict) -> TeacherFacts:
        return cls(**{k: item.get(k) for k in ("fingerprint", "name", "model_type", "logit_scale", "logit_bias")})


@dataclass
class Reinforced:
    """A shard's stored reinforcement: per teacher (in `teachers`' order) the image embeddings (n, max(K, 1), d) and,
    per caption key, the text embeddings (n, d); the crop boxes (n, K, 4) int32 (None when K = 0: the centre crop);
    `meta` holds the shard's facts (`shard_facts`) and, once read, the whole header."""

    keys: list[str]
    teachers: list[TeacherFacts]
    images: list[torch.Tensor]
    texts: list[dict[str, torch.Tensor]]
    boxes: torch.Tensor | None
    caption_keys: list[str]
    augmentations: int = 0
    dtype: str = "float32"
    seed: int | None = None
    meta: dict | None = None

    def rows(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self.keys)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors under their stored names (module docstring)."""
        out = {}
        for teacher, image, texts in zip(self.teachers, self.images, self.texts):
            out[f"image/{teacher.fingerprint}"] = image
            out.update({f"text/{teacher.fingerprint}/{key}": texts[key] for key in self.caption_keys})
        if self.boxes is not None:
            out["boxes"] = self.boxes
        return out

    def header(self) -> dict[str, str]:
        """The metadata to store, without its checksum (all strings, as safetensors keeps them)."""
        teachers = [{k: v for k, v in vars(t).items()} for t in self.teachers]
        return {
            **{k: str(v) for k, v in (self.meta or {}).items() if k in SHARD_META},
            "format": FORMAT,
            "keys": json.dumps(self.keys),
            "teachers": json.dumps(teachers),
            "caption_keys": json.dumps(self.caption_keys),
            "augmentations": str(self.augmentations),
            "dtype": self.dtype,
            "seed": "" if self.seed is None else str(self.seed),
        }


def stored_fingerprints(meta: dict) -> list[str]:
    """The fingerprints of the teachers a sidecar (its metadata) holds, in their stored order."""
    if meta.get("format") in SECOND_LAYOUT:
        return [t["fingerprint"] for t in json.loads(meta["teachers"])]
    return [meta.get("teacher")]


def stored_settings(meta: dict) -> tuple[int, list[str]]:
    """(K, caption keys) of a sidecar (its metadata): a first-layout one holds K = 0 and the caption key "txt"."""
    if meta.get("format") not in SECOND_LAYOUT:
        return 0, [LEGACY_CAPTION_KEY]
    return int(meta["augmentations"]), json.loads(meta["caption_keys"])


def settings_of(meta: dict) -> Reinforced:
    """The settings (teachers' facts, K, caption keys, dtype, seed) of a sidecar's header, without its tensors."""
    if meta.get("format") not in SECOND_LAYOUT:
        teacher = TeacherFacts(
            meta.get("teacher", ""),
            meta.get("teacher_name", ""),
            meta.get("model_type", ""),
            float(meta["logit_scale"]) if meta.get("logit_scale") else None,
            float(meta["logit_bias"]) if meta.get("logit_bias") else None,
        )
        return Reinforced([], [teacher], [], [], None, [LEGACY_CAPTION_KEY], meta=meta)
    return Reinforced(
        [],
        [TeacherFacts.from_json(t) for t in json.loads(meta["teachers"])],
        [],
        [],
        None,
        json.loads(meta["caption_keys"]),
        int(meta["augmentations"]),
        meta["dtype"],
        int(meta["seed"]) if meta.get("seed") else None,
        meta,
    )


def with_first_teacher(meta: dict) -> dict:
    """A sidecar's metadata, with (of the second layout) "teacher", "teacher_name", "model_type", "logit_scale" and
    "logit_bias" of its first teacher, where a reader of the first layout finds them (not stored twice: derived)."""
    if meta.get("format") not in SECOND_LAYOUT:
        return meta
    first = json.loads(meta["teachers"])[0]
    meta = {**meta, "teacher": first["fingerprint"], "model_type": first.get("model_type") or ""}
    meta["teacher_name"] = first.get("name") or ""
    meta["logit_scale"] = repr(first["logit_scale"]) if first.get("logit_scale") is not None else ""
    meta["logit_bias"] = repr(first["logit_bias"]) if first.get("logit_bias") is not None else ""
    return meta


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    # as uint8: numpy has no bfloat16
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def block_rows(row_bytes: int) -> int:
    """The rows of a block of a sidecar whose rows (of every tensor together) are `row_bytes` bytes."""
    return max(1, min(BLOCK_ROWS, BLOCK_BYTES // max(1, row_bytes)))


def block_digest(buffers) -> str:
    """The checksum of one block: xxh3-128 of its rows' bytes of every tensor, in the tensors' sorted name order
    (`buffers`: bytes-like, in that order). xxh3 (xxhash, a dependency of datasets) catches a torn or altered block
    as surely as sha256 at memory speed: verifying costs about what reading costs."""
    import xxhash

    digest = xxhash.xxh3_128()
    for buffer in buffers:
        digest.update(buffer)
    return digest.hexdigest()


def block_digests(tensors: dict[str, torch.Tensor], rows: int) -> list[str]:
    """`block_digest` of each block of `rows` rows of `tensors` (all with one number of rows), in order."""
    n = len(next(iter(tensors.values())))
    names = sorted(tensors)
    return [block_digest(tensor_bytes(tensors[name][a : a + rows]) for name in names) for a in range(0, n, rows)]


def header_digest(header: dict) -> str:
    """sha256 of a safetensors header (tensor table and "__metadata__", the latter without its "sha256") as canonical
    JSON (keys sorted, no spaces): a format-3 sidecar's "sha256". The header holds every block's checksum, so this
    one names the whole contents."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "sha256"}
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def reinforced_checksum(header: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """Format 2's "sha256": of the metadata (without it) and every tensor's name, shape, dtype and bytes."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        digest.update(name.encode() + str(tuple(tensors[name].shape)).encode() + str(tensors[name].dtype).encode())
        digest.update(tensor_bytes(tensors[name]))
    return digest.hexdigest()


def joined_rows(pieces: list[tuple[Reinforced, list[int]]], meta: dict) -> Reinforced:
    """The rows `rows` of each reinforcement of `pieces` ((reinforcement, rows)), in order, as one with the shard facts
    `meta` (resharding: an output shard's sidecar from its input shards'); a ValueError when they were made with other
    teachers or settings (their rows cannot share one file)."""
    first = pieces[0][0]
    settings = lambda r: ([t.fingerprint for t in r.teachers], r.caption_keys, r.augmentations, r.dtype, r.seed)
    for stored, _ in pieces[1:]:
        if settings(stored) != settings(first):
            raise ValueError(f"embedded with other settings: {settings(stored)}, not {settings(first)}")
    take = lambda tensor, rows: tensor[torch.as_tensor(rows, dtype=torch.long)]
    return Reinforced(
        [stored.keys[i] for stored, rows in pieces for i in rows],
        first.teachers,
        [torch.cat([take(s.images[t], rows) for s, rows in pieces]) for t in range(len(first.teachers))],
        [
            {key: torch.cat([take(s.texts[t][key], rows) for s, rows in pieces]) for key in first.caption_keys}
            for t in range(len(first.teachers))
        ],
        None if first.boxes is None else torch.cat([take(s.boxes, rows) for s, rows in pieces]),
        first.caption_keys,
        first.augmentations,
        first.dtype,
        first.seed,
        meta,
    )
