"""What a reinforced set costs on disk: the bytes `disco-clip data embed` writes per sample (data/embeddings.py's
layout) for K augmentations x T teachers x C caption keys at a stored dtype, and their total for N samples.

Per sample, with D the sum of the teachers' embedding widths (d_1 + ... + d_T) and b the dtype's bytes:

    images    max(K, 1) x D x b       (K = 0 stores the centre crop, as one augmentation)
    texts     C x D x b
    boxes     K x 4 x 4               (int32 left, top, right, bottom; none when K = 0)
    key       len(key) + 6            (the key in the header's JSON list, itself a JSON string: \"key\", )

plus, per shard, a header of a few hundred bytes (the teachers' facts, the settings, the checksum), left out here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
BOX_BYTES = 4 * 4  # one int32 box
KEY_OVERHEAD = 6  # the key's two quotes (escaped: the list is a string in the JSON header) and its ", "


@dataclass(frozen=True)
class StoragePlan:
    """Bytes per sample by term (`images`, `texts`, `boxes`, `key`), their sum `per_sample`, and `total` for
    `samples` samples."""

    images: int
    texts: int
    boxes: int
    key: int
    per_sample: int
    samples: int
    total: int

    def as_dict(self) -> dict:
        return asdict(self)


def storage_plan(
    samples: int,
    augmentations: int,
    teacher_dims: list[int],
    caption_keys: int,
    dtype: str = "float16",
    key_length: int = 9,
) -> StoragePlan:
    """The storage of `samples` samples embedded with `data embed --augmentations K --teacher ... --caption_keys ...
    --embedding_dtype dtype`: `teacher_dims` holds each teacher's embedding width (its projection size), `caption_keys`
    the number of caption keys, `key_length` a sample key's length in bytes (9 for img2dataset's 000000123). A
    ValueError for settings data embed refuses."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: give one of {', '.join(DTYPE_BYTES)}")
    if augmentations < 0 or caption_keys < 1 or not teacher_dims or samples < 0:
        raise ValueError("give K >= 0 augmentations, at least one caption key and one teacher, and N >= 0 samples")
    width = sum(teacher_dims) * DTYPE_BYTES[dtype]
    terms = {
        "images": max(augmentations, 1) * width,
        "texts": caption_keys * width,
        "boxes": augmentations * BOX_BYTES,
        "key": key_length + KEY_OVERHEAD,
    }
    per_sample = sum(terms.values())
    return StoragePlan(**terms, per_sample=per_sample, samples=samples, total=per_sample * samples)


def format_storage(plan: StoragePlan) -> str:
    """One line: bytes per sample by term, and the total."""
    terms = ", ".join(f"{name} {getattr(plan, name)}" for name in ("images", "texts", "boxes", "key"))
    return f"stored per sample: {plan.per_sample} bytes ({terms}); {plan.samples} samples: {plan.total / 1e12:.3f} TB"
