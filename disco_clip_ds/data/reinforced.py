"""A shard's stored reinforcement in memory (`Reinforced`: the sample keys, each teacher's facts and embeddings, the
crop boxes, the settings), the settings a sidecar's header records, and the checksums of its stored form (format 3:
one per block of rows and one of the header; format 2: one of the whole file); data/embeddings.py describes the
layout, data/sidecar_io.py writes and reads it whole, data/sidecar_file.py by rows."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass

import torch

from disco_clip_ds.errors import DataError

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
# what a sidecar records of its shard: its identity, size, (a resharded shard's) sha256, and how many of its samples
# `data embed` skipped (no image, undecodable, a caption key missing: they have no row)
SHARD_META = ("shard", "shard_bytes", "shard_sha256", "skipped")
STORED_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}  # the safetensors dtype of each stored dtype
# how far from 1 a stored embedding's L2 norm may be: the teachers' embeddings are L2-normalised in float32, then
# rounded to the stored dtype (bfloat16's 8 bits move a norm by at most ~0.4%); a row scaled, or not normalised, is
# further off
NORM_TOLERANCE = 0.02
_WHOLE = re.compile(r"-?[0-9]{1,18}")


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


class NotStored(DataError):
    """A sample, or the caption chosen for it, has no stored embedding: the training stream skips and counts it, as
    a sample without that caption member (data/streams/reinforced.py)."""


def settings_problem(meta: dict) -> str | None:
    """Why a sidecar's metadata cannot be read as its format's settings (a field missing, of the wrong type, or out of
    range); None when every field the readers use (`settings_of`, `stored_fingerprints`, `with_first_teacher`)
    is sound. Reads no key list: cheap enough for every sidecar at the start of a run."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        return "its metadata holds a value that is not text"
    if "skipped" in meta and not _whole(meta["skipped"], 0):
        return f"its count of skipped samples is {meta['skipped'][:40]!r}, not a whole number"
    if meta.get("format") not in SECOND_LAYOUT:
        bad = [k for k in ("logit_scale", "logit_bias") if meta.get(k) and not _finite(meta[k])]
        return f"its {bad[0]} is {meta[bad[0]][:40]!r}, not a finite number" if bad else None
    try:
        teachers, captions = json.loads(meta["teachers"]), json.loads(meta["caption_keys"])
        augmentations, dtype, seed = meta["augmentations"], meta["dtype"], meta.get("seed", "")
    except KeyError as error:
        return f"its metadata has no {error}"
    except ValueError as error:
        return f"its teachers or caption keys are not JSON ({error})"
    return _teachers_problem(teachers) or _fields_problem(captions, augmentations, dtype, seed)


def _teachers_problem(teachers) -> str | None:
    facts = ("name", "model_type")
    if not isinstance(teachers, list) or not teachers or not all(isinstance(t, dict) for t in teachers):
        return "its teachers are not a list of teachers"
    prints = [t.get("fingerprint") for t in teachers]
    if not all(isinstance(f, str) and f for f in prints) or len(set(prints)) != len(prints):
        return "its teachers' fingerprints are not distinct names"
    for t in teachers:
        numbers = [t.get(k) for k in ("logit_scale", "logit_bias")]
        if not all(v is None or (type(v) in (int, float) and math.isfinite(v)) for v in numbers):
            return f"teacher {t['fingerprint'][:40]}'s logit scale or bias is not a finite number"
        if not all(t.get(k) is None or isinstance(t.get(k), str) for k in facts):
            return f"teacher {t['fingerprint'][:40]}'s name or model type is not text"
    return None


def _fields_problem(captions, augmentations: str, dtype: str, seed: str) -> str | None:
    if not isinstance(captions, list) or not captions or not all(isinstance(c, str) and c for c in captions):
        return "its caption keys are not a list of names"
    if len(set(captions)) != len(captions):
        return "its caption keys name one key twice"
    if not _whole(augmentations, 0):
        return f"its augmentations are {augmentations[:40]!r}, not a whole number"
    if dtype not in DTYPES:
        return f"its dtype is {dtype[:40]!r}, not one of {', '.join(DTYPES)}"
    if seed and not _whole(seed):
        return f"its seed is {seed[:40]!r}, not a whole number"
    return None


def _whole(text: str, least: int | None = None) -> bool:
    return bool(_WHOLE.fullmatch(text)) and (least is None or int(text) >= least)


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def layout_problem(meta: dict, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """Why a sidecar's tensors (name: (safetensors dtype, shape), each of one row per sample) are not its format's
    layout for its metadata (`settings_problem` passed): a tensor missing or unexpected, of another dtype, or
    embeddings of one teacher of other widths (image against text) or shapes; None when they are."""
    if meta.get("format") not in SECOND_LAYOUT:
        want = {"image": ("F32", 2), "text": ("F32", 2)}
    else:
        captions, k, code = json.loads(meta["caption_keys"]), int(meta["augmentations"]), STORED_CODES[meta["dtype"]]
        want = {}
        for teacher in json.loads(meta["teachers"]):
            want[f"image/{teacher['fingerprint']}"] = (code, 3)
            want.update({f"text/{teacher['fingerprint']}/{c}": (code, 2) for c in captions})
        if k:
            want["boxes"] = ("I32", 3)
    if set(shapes) != set(want):
        odd = sorted(set(want) - set(shapes)) or sorted(set(shapes) - set(want))
        what = "lacks" if set(want) - set(shapes) else "has the unexpected"
        return f"its tensors do not fit its metadata: it {what} tensor {odd[0][:80]}"
    for name, (code, dims) in want.items():
        if shapes[name][0] != code or len(shapes[name][1]) != dims:
            got = f"{shapes[name][0]} of {len(shapes[name][1])} dimensions"
            return f"its tensor {name[:80]} is {got}, not {code} of {dims}"
    return _widths_problem(meta, shapes)


def _widths_problem(meta: dict, shapes: dict) -> str | None:
    width = lambda name: shapes[name][1][-1]
    if meta.get("format") not in SECOND_LAYOUT:
        if width("image") != width("text") or width("image") < 1:
            return f"its image embeddings are {width('image')} wide and its text embeddings {width('text')}"
        return None
    k = int(meta["augmentations"])
    if k and shapes["boxes"][1][1:] != (k, 4):
        return f"its crop boxes are of shape {list(shapes['boxes'][1][1:])} per sample, not [{k}, 4]"
    for teacher in json.loads(meta["teachers"]):
        image = f"image/{teacher['fingerprint']}"
        if shapes[image][1][1] != max(k, 1) or width(image) < 1:
            return f"its tensor {image[:80]} holds {shapes[image][1][1]} augmentations per sample, not {max(k, 1)}"
        for caption in json.loads(meta["caption_keys"]):
            text = f"text/{teacher['fingerprint']}/{caption}"
            if width(text) != width(image):
                return (
                    f"teacher {teacher['fingerprint'][:40]}'s image embeddings are {width(image)} wide and its text "
                    f"embeddings of {caption[:40]} {width(text)}"
                )
    return None


def stored_widths(meta: dict, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """{fingerprint: width of its embeddings} of a sidecar whose layout passed `layout_problem`."""
    if meta.get("format") not in SECOND_LAYOUT:
        return {meta.get("teacher"): shapes["image"][1][-1]}
    return {t["fingerprint"]: shapes[f"image/{t['fingerprint']}"][1][-1] for t in json.loads(meta["teachers"])}


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
