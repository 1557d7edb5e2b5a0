"""A shard's stored reinforcement in memory (`Reinforced`: the sample keys, each teacher's facts and embeddings, the
crop boxes, the settings) and the checksum of its stored form; data/embeddings.py writes and reads it (the layout is
described there)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

FORMAT = "2"  # the metadata "format" of the layout of several teachers, augmentations and captions
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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
            **{k: str(v) for k, v in (self.meta or {}).items() if k in ("shard", "shard_bytes")},
            "format": FORMAT,
            "keys": json.dumps(self.keys),
            "teachers": json.dumps(teachers),
            "caption_keys": json.dumps(self.caption_keys),
            "augmentations": str(self.augmentations),
            "dtype": self.dtype,
            "seed": "" if self.seed is None else str(self.seed),
        }


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    # as uint8: numpy has no bfloat16
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def reinforced_checksum(header: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        digest.update(name.encode() + str(tuple(tensors[name].shape)).encode() + str(tensors[name].dtype).encode())
        digest.update(tensor_bytes(tensors[name]))
    return digest.hexdigest()
