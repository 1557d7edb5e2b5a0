"""Teacher embeddings stored once per shard (`disco-clip data embed`, read by `--teacher_embeddings`): a sidecar file
per shard, NAME.DIGEST.teacher.safetensors for NAME.tar, holding, for every sample of the shard (one row per sample
key), the image embeddings of one or several teachers for each of K augmentations of the image, and their text
embeddings of each of the sample's captions (the real one and synthetic ones, each a member of the sample).

DIGEST is 12 hex digits of the sha256 of the shard's identity (`shard_identity`: a local shard's absolute path, a
remote one's public description), so that shards of one file name in two sources (`a/00000.tar`, `b/00000.tar`) get
two sidecars in one folder; moving the shards to another folder means embedding them again.

Layout (metadata "format" 2, `write_reinforced`): for each teacher of fingerprint F (`teacher_fingerprint`), a tensor
"image/F" (n, K, d_F) and, for each caption key C, "text/F/C" (n, d_F), L2-normalised, in the stored dtype (float16,
bfloat16 or float32; read back as float32); "boxes" (n, K, 4) int32, the crop (left, top, right, bottom, source
pixels) of each augmentation (`transforms.crop_boxes`). K = 0 augmentations (the centre crop, as CLIPImageProcessor
makes it) is stored as K = 1 without boxes. Metadata: "keys" (the sample keys, JSON, in row order), "teachers" (JSON:
fingerprint, name, model_type, logit_scale, logit_bias of each, in the order given), "caption_keys" (JSON),
"augmentations" (K), "dtype", "seed" (of the augmentations' draw), "shard" (its shard's identity) and "shard_bytes"
(its size, for a local shard), "sha256" (of all the metadata and every tensor's name and bytes: a torn or altered
file is found when read). A reader checks the teachers, the shard and its size (`sidecar_problem`) before it uses a
row.

The first layout (no "format"; one teacher, the centre crop, one caption: fp32 "image" and "text" (n, d), metadata
"teacher", "model_type", "logit_scale", "logit_bias", "sha256" of the keys and both tensors) is still read, as one
teacher, K = 0 and the caption key "txt" (`read_reinforced`), and still written by `write_sidecar`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.reinforced import DTYPES, FORMAT, Reinforced, TeacherFacts, reinforced_checksum
from disco_clip_ds.data.shards import is_url
from disco_clip_ds.errors import DataError, UsageError

SUFFIX = ".teacher.safetensors"
KEEP_SIDECARS = 4  # sidecars a DataLoader worker keeps loaded
LEGACY_CAPTION_KEY = "txt"  # the caption key a first-layout sidecar's one text embedding is read under


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


def stored_fingerprints(meta: dict) -> list[str]:
    """The fingerprints of the teachers a sidecar (its metadata) holds, in their stored order."""
    if meta.get("format") == FORMAT:
        return [t["fingerprint"] for t in json.loads(meta["teachers"])]
    return [meta.get("teacher")]


def sidecar_problem(meta: dict, shard: str, fingerprint: str | list[str]) -> str | None:
    """Why a sidecar (its metadata `meta`) may not serve shard `shard` for the teacher(s) of `fingerprint` (one or a
    list): made without one of them (by other teachers), for another shard (a sidecar renamed or copied), for the
    shard as it was before it was written again (another size); None when it may."""
    stored = stored_fingerprints(meta)
    missing = [f for f in ([fingerprint] if isinstance(fingerprint, str) else fingerprint) if f not in stored]
    if missing:
        return f"made by another teacher (fingerprint {', '.join(map(str, stored))}, not {', '.join(missing)})"
    if meta.get("shard") != shard_identity(shard):
        return f"made for shard {describe_source(meta.get('shard', '?'))}, not {describe_source(shard)}"
    recorded, size = meta.get("shard_bytes"), _size(shard)
    if recorded is not None and size is not None and recorded != size:
        return f"made for {describe_source(shard)} when it held {recorded} bytes; it now holds {size}"
    return None


def check_sidecars(
    folder: str | Path,
    urls: list[str],
    fingerprint: str | list[str],
    teacher: str,
    augmentations: int = 0,
    caption_keys: list[str] = (),
) -> None:
    """Before training: every shard of `urls` has a sidecar in FOLDER that may serve it for the teacher(s) of
    `fingerprint` (one or a list; `sidecar_problem`, from the headers alone; checksums are verified as each is read),
    holding at least `augmentations` augmentations per sample and every caption key of `caption_keys`; else a
    UsageError in one line saying what to run (`teacher`: the teacher names, as --teacher takes them)."""
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
            meta = read_metadata(path)
        except DataError as error:
            raise UsageError(str(error)) from error
        problem = sidecar_problem(meta, url, fingerprint) or _settings_problem(meta, augmentations, caption_keys)
        if problem:
            raise UsageError(f"--teacher_embeddings {folder}: {path.name} was {problem}: {embed}")


def stored_settings(meta: dict) -> tuple[int, list[str]]:
    """(K, caption keys) of a sidecar (its metadata): a first-layout one holds K = 0 and the caption key "txt"."""
    if meta.get("format") != FORMAT:
        return 0, [LEGACY_CAPTION_KEY]
    return int(meta["augmentations"]), json.loads(meta["caption_keys"])


def settings_of(meta: dict) -> Reinforced:
    """The settings (teachers' facts, K, caption keys, dtype, seed) of a sidecar's header, without its tensors."""
    if meta.get("format") != FORMAT:
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


def _settings_problem(meta: dict, augmentations: int, caption_keys) -> str | None:
    stored, keys = stored_settings(meta)
    if stored < augmentations:
        what = "the centre crop alone" if stored == 0 else f"{stored} augmentations per sample"
        return f"made with {what}, fewer than the {augmentations} needed (embed with --augmentations {augmentations})"
    missing = [key for key in caption_keys if key not in keys]
    if missing:
        return f"made without the caption key {missing[0]} (its keys: {','.join(keys)}; embed with --caption_keys)"
    return None


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
    """A sidecar's metadata (its header alone); a DataError naming the file when it cannot be read. Of a sidecar of
    the second layout it also holds "teacher", "teacher_name", "model_type", "logit_scale" and "logit_bias" of its
    first teacher, where a reader of the first layout finds them (not stored twice: derived here)."""
    meta = _raw_metadata(path)
    if meta.get("format") == FORMAT:
        first = json.loads(meta["teachers"])[0]
        meta = {**meta, "teacher": first["fingerprint"], "model_type": first.get("model_type") or ""}
        meta["teacher_name"] = first.get("name") or ""
        meta["logit_scale"] = repr(first["logit_scale"]) if first.get("logit_scale") is not None else ""
        meta["logit_bias"] = repr(first["logit_bias"]) if first.get("logit_bias") is not None else ""
    return meta


def _raw_metadata(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error}") from error


def read_sidecar(path: Path) -> tuple[dict[str, int], torch.Tensor, torch.Tensor, dict]:
    """({key: row}, image, text, metadata) of a sidecar, once its checksum verifies; else a DataError naming it. Of a
    sidecar of several teachers, augmentations or captions: the first teacher's image embedding of the first
    augmentation and its text embedding of the first caption key, as float32 (what curation and resharding read)."""
    if _raw_metadata(path).get("format") == FORMAT:
        stored = read_reinforced(path)
        image, text = stored.images[0][:, 0].float(), stored.texts[0][stored.caption_keys[0]].float()
        return stored.rows(), image, text, read_metadata(path)
    from safetensors.torch import load_file

    meta = read_metadata(path)
    try:
        tensors, keys = load_file(str(path)), json.loads(meta["keys"])
    except Exception as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error}") from error
    if _checksum(keys, tensors["image"], tensors["text"]) != meta.get("sha256"):
        raise DataError(f"{path}: its checksum does not match its contents: run `disco-clip data embed` again")
    return {k: i for i, k in enumerate(keys)}, tensors["image"], tensors["text"], meta


def write_reinforced(path: Path, stored: Reinforced) -> None:
    """Write a shard's reinforcement to PATH atomically (a temporary file renamed): a kill leaves the old file or none.
    The embeddings are cast to `stored.dtype`; the same contents give the same bytes (`_canonical`)."""
    from safetensors.torch import save

    if stored.dtype not in DTYPES:
        raise UsageError(f"--embedding_dtype {stored.dtype}: give one of {', '.join(DTYPES)}")
    dtype = DTYPES[stored.dtype]
    tensors = {
        name: (t.to(torch.int32) if name == "boxes" else t.to(dtype)).contiguous()
        for name, t in stored.tensors().items()
    }
    header = stored.header()
    header["sha256"] = reinforced_checksum(header, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(_canonical(save(tensors, metadata=header)))
    os.replace(tmp, path)


def read_reinforced(path: Path) -> Reinforced:
    """A sidecar's reinforcement, once its checksum verifies (either layout; a first-layout one as one teacher,
    K = 0 and the caption key "txt"), in the stored dtype; else a DataError naming it."""
    from safetensors.torch import load_file

    meta = _raw_metadata(path)
    if meta.get("format") != FORMAT:
        rows, image, text, meta = read_sidecar(path)
        return replace(settings_of(meta), keys=list(rows), images=[image[:, None]], texts=[{LEGACY_CAPTION_KEY: text}])
    try:
        tensors, stored = load_file(str(path)), settings_of(meta)
        keys = json.loads(meta["keys"])
    except Exception as error:
        raise DataError(f"{path}: not a readable teacher embeddings file: {error}") from error
    if reinforced_checksum(meta, tensors) != meta.get("sha256"):
        raise DataError(f"{path}: its checksum does not match its contents: run `disco-clip data embed` again")
    prints = [t.fingerprint for t in stored.teachers]
    return replace(
        stored,
        keys=keys,
        images=[tensors[f"image/{f}"] for f in prints],
        texts=[{key: tensors[f"text/{f}/{key}"] for key in stored.caption_keys} for f in prints],
        boxes=tensors.get("boxes"),
    )


@dataclass
class StoredSample:
    """One sample's stored reinforcement, as float32, teachers in the order the store was asked for: `images[t]`
    (K', d_t) (K' = K, or 1 for the centre crop), `texts[t]` {caption key: (d_t,)}, `boxes` (K, 4) int32 (None for
    the centre crop)."""

    images: list[torch.Tensor]
    texts: list[dict[str, torch.Tensor]]
    boxes: torch.Tensor | None


class EmbeddingStore:
    """The sidecars in FOLDER holding the teachers of `fingerprints` (one fingerprint, or a list: an ensemble, in the
    order its embeddings are to be returned), looked up by (shard, sample key). Each DataLoader worker loads a
    shard's sidecar once, when its first sample is asked for, as float32. Every sidecar read must agree with the
    first on the augmentations, caption keys and seed (a DataError otherwise: a folder embedded twice with other
    settings). `shards`: the run's shards; the store's facts (`augmentations`, `caption_keys`, `teachers`) are read
    from the header of the first one's sidecar (else of the first sidecar looked up)."""

    def __init__(self, folder: str | Path, fingerprints: str | list[str], shards: list[str] | None = None):
        self.folder = Path(folder)
        self.fingerprints = [fingerprints] if isinstance(fingerprints, str) else list(fingerprints)
        self.fingerprint = self.fingerprints[0]  # the single teacher's, as the first layout's readers know it
        self._loaded: dict[str, tuple] = {}
        self._facts: Reinforced | None = None  # the settings of the first sidecar read, without its tensors
        self._reference = shards[0] if shards else None

    # --- the facts of the stored run ---

    @property
    def augmentations(self) -> int:
        """K: the stored augmentations per sample (0: the centre crop only)."""
        return self._settings().augmentations

    @property
    def caption_keys(self) -> list[str]:
        """The caption keys stored per sample (the first, "txt", is the real caption)."""
        return self._settings().caption_keys

    @property
    def seed(self) -> int | None:
        """The seed the augmentations were drawn from (`transforms.crop_boxes`)."""
        return self._settings().seed

    @property
    def teachers(self) -> list[TeacherFacts]:
        """The facts (logit scale and bias, model type) of each teacher, in the order of `fingerprints`."""
        stored = {t.fingerprint: t for t in self._settings().teachers}
        return [stored[f] for f in self.fingerprints]

    def _settings(self) -> Reinforced:
        """The settings of the first sidecar read; before any: of the first shard's (`shards`), else of the first
        sidecar in the folder (by name) that holds every teacher asked for, from its header alone."""
        if self._facts is None:
            if self._reference is not None:
                self._load(self._reference)
                return self._facts
            for path in sorted(self.folder.glob("*" + SUFFIX)):
                meta = _raw_metadata(path)
                if all(f in stored_fingerprints(meta) for f in self.fingerprints):
                    return settings_of(meta)
            raise DataError(f"{self.folder}: no sidecar holds the teachers {', '.join(self.fingerprints)}")
        return self._facts

    # --- lookups ---

    def lookup(self, shard: str, key: str) -> StoredSample:
        """Sample `key` of `shard`: a DataError naming both when the sidecar or the key is missing, or the sidecar
        may not serve this shard (`sidecar_problem`) or does not verify."""
        rows, images, texts, boxes = self._load(shard, key)
        row = rows.get(key)
        if row is None:
            raise DataError(
                f"no teacher embedding for sample {key} of shard {describe_source(shard)} in "
                f"{sidecar_path(self.folder, shard)}"
            )
        return StoredSample(
            [image[row] for image in images],
            [{name: text[row] for name, text in by_key.items()} for by_key in texts],
            None if boxes is None else boxes[row],
        )

    def pair(self, shard: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The first teacher's (image, text) embeddings (d,) of sample `key`: of its first augmentation (the centre
        crop when K = 0) and its first caption key: what a single-teacher, centre-crop run distils from."""
        sample = self.lookup(shard, key)
        return sample.images[0][0], sample.texts[0][self.caption_keys[0]]

    def _load(self, shard: str, key: str | None = None) -> tuple:
        if shard not in self._loaded:
            path = sidecar_path(self.folder, shard)
            if not path.is_file():
                sample = f" (sample {key})" if key is not None else ""
                raise DataError(f"no teacher embeddings for shard {describe_source(shard)}{sample}: {path} is missing")
            stored = read_reinforced(path)
            problem = sidecar_problem(read_metadata(path), shard, self.fingerprints)
            if problem:
                raise DataError(f"{path}: {problem}: run `disco-clip data embed` for these shards again")
            self._check_settings(path, stored)
            order = [[t.fingerprint for t in stored.teachers].index(f) for f in self.fingerprints]
            images = [stored.images[i].float() for i in order]
            texts = [{k: v.float() for k, v in stored.texts[i].items()} for i in order]
            if len(self._loaded) >= KEEP_SIDECARS:  # a shuffle block may span a few shards; older ones are done
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[shard] = (stored.rows(), images, texts, stored.boxes)
        return self._loaded[shard]

    def _check_settings(self, path: Path, stored: Reinforced) -> None:
        if self._facts is None:
            self._facts = replace(stored, keys=[], images=[], texts=[], boxes=None)
            return
        first, this = self._facts, stored
        for name in ("augmentations", "caption_keys", "seed"):
            if getattr(first, name) != getattr(this, name):
                raise DataError(
                    f"{path}: made with {name} {getattr(this, name)}, other sidecars of {self.folder} with "
                    f"{getattr(first, name)}: embed every shard with one setting"
                )
