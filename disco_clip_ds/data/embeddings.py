"""Teacher embeddings stored once per shard (`disco-clip data embed`, read by `--teacher_embeddings`): a sidecar file
per shard, NAME.DIGEST.teacher.safetensors for NAME.tar, holding, for every sample of the shard (one row per sample
key), the image embeddings of one or several teachers for each of K augmentations of the image, and their text
embeddings of each of the sample's captions (the real one and synthetic ones, each a member of the sample).

DIGEST is 12 hex digits of the sha256 of the shard's identity (`shard_identity`: a local shard's absolute path, a
remote one's public description), so that shards of one file name in two sources (`a/00000.tar`, `b/00000.tar`) get
two sidecars in one folder; moving the shards to another folder means embedding them again.

Layout (metadata "format" 3, `write_reinforced`): for each teacher of fingerprint F (`teacher_fingerprint`), a tensor
"image/F" (n, K, d_F) and, for each caption key C, "text/F/C" (n, d_F), L2-normalised, in the stored dtype (float16,
bfloat16 or float32; read back as float32); "boxes" (n, K, 4) int32, the crop (left, top, right, bottom, source
pixels) of each augmentation (`transforms.crop_boxes`). K = 0 augmentations (the centre crop, as CLIPImageProcessor
makes it) is stored as K = 1 without boxes. Metadata: "keys" (the sample keys, JSON, in row order), "teachers" (JSON:
fingerprint, name, model_type, logit_scale, logit_bias of each, in the order given), "caption_keys" (JSON),
"augmentations" (K), "dtype", "seed" (of the augmentations' draw), "shard" (its shard's identity) and "shard_bytes"
(its size, for a local shard); "block_rows" (R: rows of a block, `reinforced.block_rows`, about 64 kB) and
"block_xxh3" (JSON: per block of R rows, xxh3-128 of its rows' bytes of every tensor in name order); "sha256" (of
the whole header, tensor table and metadata, without itself: `reinforced.header_digest`). What is verified when:
the header (its checksum, every tensor's byte range, the file's length) when a reader opens the file, a block when
it first reads it, before any of its rows is used (data/sidecar_file.py); a torn or altered file is refused with a
DataError naming it. A reader checks the teachers, the shard and its size (`sidecar_problem`) before it uses a row.

Format 2 (the same layout, no block checksums, "sha256" of all the metadata and every tensor's name and bytes) is
still read, verified whole when first read. The first layout (no "format"; one teacher, the centre crop, one
caption: fp32 "image" and "text" (n, d), metadata "teacher", "model_type", "logit_scale", "logit_bias", "sha256" of
the keys and both tensors) is still read, verified whole when first read, as one teacher, K = 0 and the caption key
"txt" (`read_reinforced`), and still written by `write_sidecar`.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.reinforced import (
    DTYPES,
    FORMAT,
    LEGACY_CAPTION_KEY,
    SECOND_LAYOUT,
    WHOLE_FILE_FORMAT,
    NotStored,
    Reinforced,
    TeacherFacts,
    block_rows,
    settings_of,
    stored_fingerprints,
    stored_settings,
    stored_widths,
    with_first_teacher,
)
from disco_clip_ds.data.shards import is_url
from disco_clip_ds.data.sidecar_file import AGAIN, ReadStats, SidecarFile, open_sidecar
from disco_clip_ds.data.sidecar_io import (
    raw_metadata,
    read_metadata,
    read_reinforced,
    read_sidecar,
    write_reinforced,
    write_sidecar,
)
from disco_clip_ds.errors import DataError, UsageError

# the sidecar's format and whole-file reading and writing live in data/reinforced.py and data/sidecar_io.py; they
# are read from here, where sidecars are named, checked and looked up
__all__ = [
    "DTYPES",
    "FORMAT",
    "EmbeddingStore",
    "Reinforced",
    "StoredSample",
    "TeacherFacts",
    "check_sidecars",
    "open_sidecars",
    "read_metadata",
    "read_reinforced",
    "read_sidecar",
    "settings_of",
    "shard_facts",
    "shard_identity",
    "sidecar_path",
    "sidecar_problem",
    "store_memory_bound",
    "stored_row_bytes",
    "write_reinforced",
    "write_sidecar",
]

SUFFIX = ".teacher.safetensors"


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
) -> int:
    """Before training: every shard of `urls` has a sidecar in FOLDER that may serve it for the teacher(s) of
    `fingerprint` (one or a list; `sidecar_problem`, from the headers alone; checksums are verified as each is read),
    holding at least `augmentations` augmentations per sample and every caption key of `caption_keys`; else a
    UsageError in one line saying what to run (`teacher`: the teacher names, as --teacher takes them). Returns the
    samples of the shards that `data embed` skipped, as their sidecars record them (0 for sidecars that do not)."""
    embed = f"run `disco-clip data embed --teacher {teacher} --shards ... --output {folder}`"
    skipped = 0
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
        skipped += int(meta.get("skipped") or 0)
    return skipped


def _settings_problem(meta: dict, augmentations: int, caption_keys) -> str | None:
    stored, keys = stored_settings(meta)
    if stored < augmentations:
        what = "the centre crop alone" if stored == 0 else f"{stored} augmentations per sample"
        return f"made with {what}, fewer than the {augmentations} needed (embed with --augmentations {augmentations})"
    missing = [key for key in caption_keys if key not in keys]
    if missing:
        return f"made without the caption key {missing[0]} (its keys: {','.join(keys)}; embed with --caption_keys)"
    return None


# --- reading by sample, in training ---

MIN_OPEN = 4  # sidecars a store keeps open, and blocks it keeps, at the least (a shuffle block spans a few shards)
KEY_BYTES = 256  # an open sidecar's row map, per sample: the key as a str (up to ~100 characters), its row, its slot
DIGEST_BYTES = 96  # an open sidecar's checksum of one block (a str of 32 hex digits in a list)


def open_sidecars(sources: int) -> int:
    """The sidecars (and verified blocks) a store reading a run of `sources` sources keeps: each source's reader is
    in one shard, or at the turn from one to the next, at a time."""
    return max(MIN_OPEN, 2 * sources)


def stored_row_bytes(widths: list[int], augmentations: int, captions: int, dtype: str) -> int:
    """The bytes of one sample's stored rows (every tensor of a sidecar; its key, in the header, aside): per teacher
    of width d, max(K, 1) image and `captions` text embeddings of d values at `dtype`; 16 K bytes of int32 boxes."""
    values = (max(augmentations, 1) + captions) * sum(widths)
    return values * DTYPES[dtype].itemsize + (16 * augmentations if augmentations else 0)


def store_memory_bound(sources: int, row_bytes: int, shard_samples: int = 10_000) -> int:
    """The most host bytes one DataLoader worker's EmbeddingStore holds (format 3 sidecars), reading a run mixing
    `sources` sources whose stored sample row is `row_bytes` bytes (`stored_row_bytes`), of `shard_samples` samples a
    shard (DataCompDR's 10,000 by default): `open_sidecars(sources)` verified blocks kept and one more being read,
    each of `block_rows(row_bytes)` rows; per open sidecar its row map and block checksums; one sample converted to
    float32 (at most twice its stored bytes). The whole file of an older format is read once when first used, beyond
    this bound."""
    rows = block_rows(row_bytes)
    kept = open_sidecars(sources)
    per_file = shard_samples * KEY_BYTES + -(-shard_samples // rows) * DIGEST_BYTES
    return (kept + 1) * rows * row_bytes + kept * per_file + 2 * row_bytes


@dataclass
class StoredSample:
    """One sample's stored reinforcement, as float32, teachers in the order the store was asked for: `images[t]`
    (K', d_t) (K' = K, or 1 for the centre crop), `texts[t]` {caption key: (d_t,)}, `boxes` (K, 4) int32 (None for
    the centre crop)."""

    images: list[torch.Tensor]
    texts: list[dict[str, torch.Tensor]]
    boxes: torch.Tensor | None


@dataclass
class _Open:
    """An open sidecar of the store: the file, its number (the key of its blocks in the block cache) and the names
    of the tensors of each teacher asked for (in `fingerprints`' order): images, {caption key: texts}, boxes."""

    file: SidecarFile
    number: int
    images: list[str]
    texts: list[dict[str, str]]
    boxes: str | None

    def names(self) -> list[str]:
        return [
            *self.images,
            *(n for by_key in self.texts for n in by_key.values()),
            *([self.boxes] if self.boxes else []),
        ]


class EmbeddingStore:
    """The sidecars in FOLDER holding the teachers of `fingerprints` (one fingerprint, or a list: an ensemble, in the
    order its embeddings are to be returned), looked up by (shard, sample key). A lookup reads the block of rows that
    holds the sample (verified against its checksum when first read) from the open sidecar, never the whole file, and
    converts that sample to float32. Each DataLoader worker keeps `open_sidecars(sources)` sidecars open and as many
    verified blocks, least recently used first out (`store_memory_bound`); `stats` counts what it read. Every sidecar
    read must agree with the first on the augmentations, caption keys and seed (a DataError otherwise: a folder
    embedded twice with other settings). `shards`: the run's shards; the store's facts (`augmentations`,
    `caption_keys`, `teachers`) are read from the header of the first one's sidecar (else of the first sidecar looked
    up). `sources`: the sources the run mixes (1 without a mixture)."""

    def __init__(
        self, folder: str | Path, fingerprints: str | list[str], shards: list[str] | None = None, sources: int = 1
    ):
        self.folder = Path(folder)
        self.fingerprints = [fingerprints] if isinstance(fingerprints, str) else list(fingerprints)
        self.fingerprint = self.fingerprints[0]  # the single teacher's, as the first layout's readers know it
        self.capacity = open_sidecars(sources)
        self._facts: Reinforced | None = None  # the settings of the first sidecar read, without its tensors
        self._widths: dict[str, int] = {}  # {fingerprint: width} of the first sidecar read
        self._reference = shards[0] if shards else None
        self._empty()

    def _empty(self) -> None:
        self.stats = ReadStats()
        self._files: OrderedDict[str, _Open] = OrderedDict()  # by shard, least recently used first
        self._blocks: OrderedDict[tuple[int, int], dict] = OrderedDict()  # by (file number, block)
        self._opened = 0

    def __getstate__(self) -> dict:
        # a store goes to each DataLoader worker with nothing open: each opens the sidecars it reads
        state = dict(self.__dict__)
        for name in ("stats", "_files", "_blocks", "_opened"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._empty()

    def close(self) -> None:
        """Close every open sidecar and drop the kept blocks."""
        for entry in self._files.values():
            entry.file.close()
        self._files.clear()
        self._blocks.clear()

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
                self._open(self._reference)
                return self._facts
            for path in sorted(self.folder.glob("*" + SUFFIX)):
                meta = raw_metadata(path)
                if all(f in stored_fingerprints(meta) for f in self.fingerprints):
                    return settings_of(meta)
            raise DataError(f"{self.folder}: no sidecar holds the teachers {', '.join(self.fingerprints)}")
        return self._facts

    # --- lookups ---

    def lookup(self, shard: str, key: str) -> StoredSample:
        """Sample `key` of `shard`: a NotStored (a DataError; the training stream skips and counts the sample)
        naming both when the sidecar has no row of the key; a DataError naming them when the sidecar is missing, may
        not serve this shard (`sidecar_problem`), or its header or the block of the sample's row does not verify."""
        entry = self._open(shard, key)
        row = entry.file.rows.get(key)
        if row is None:  # `data embed` skipped it (no image, undecodable, a caption key missing)
            raise NotStored(
                f"no teacher embedding for sample {key} of shard {describe_source(shard)} in "
                f"{sidecar_path(self.folder, shard)}"
            )
        values = self._row(entry, row)
        as_float = lambda name: values[name].to(torch.float32, copy=True)  # never a view of a kept block
        return StoredSample(
            [as_float(name).reshape(-1, values[name].shape[-1]) for name in entry.images],
            [{caption: as_float(name) for caption, name in by_key.items()} for by_key in entry.texts],
            None if entry.boxes is None else values[entry.boxes].clone(),
        )

    def check_order(self, shard: str, keys: list[str], after: int = -1) -> int:
        """The row of the last of `keys` (samples of `shard` in the shard's own order) that has one, once their rows
        rise in that order after row `after`: a sidecar's rows are its shard's samples in order (`data embed`, the
        filter write them so), so keys that do not rise name other samples' rows (a key list shifted or reordered,
        its checksum made anew); a DataError naming the sidecar then. Keys without a row are passed over."""
        entry = self._open(shard, keys[0] if keys else None)
        for key in keys:
            row = entry.file.rows.get(key)
            if row is None:
                continue
            if row <= after:
                raise DataError(
                    f"{entry.file.path}: its sample keys are not in its shard's order (sample {key} is row {row}, "
                    f"after a sample of row {after}): its keys do not name their rows: {AGAIN}"
                )
            after = row
        return after

    @property
    def widths(self) -> list[int]:
        """The width of each teacher's stored embeddings, in the order of `fingerprints`: of the first sidecar read,
        which every other one must match (None before any is read, for a store without `shards`)."""
        self._settings()
        return [self._widths.get(f) for f in self.fingerprints]

    def pair(self, shard: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The first teacher's (image, text) embeddings (d,) of sample `key`: of its first augmentation (the centre
        crop when K = 0) and its first caption key: what a single-teacher, centre-crop run distils from."""
        sample = self.lookup(shard, key)
        return sample.images[0][0], sample.texts[0][self.caption_keys[0]]

    def _row(self, entry: _Open, row: int) -> dict[str, torch.Tensor]:
        """The tensors' row `row`: from a kept block, else from its block read (and verified) now, else (the block
        verified and no longer kept) the row alone, read again; an older format's file verified whole first."""
        file = entry.file
        if not file.blockwise:
            if not file.verified:
                self._verify_whole(file)
            return file.read_row(row, entry.names())
        block = row // file.block_rows
        rows = self._blocks.get((entry.number, block))
        if rows is not None:
            self._blocks.move_to_end((entry.number, block))
        elif block in file.verified:
            return file.read_row(row, entry.names())
        else:
            rows = file.read_block(block, entry.names())
            while len(self._blocks) >= self.capacity:
                self._blocks.popitem(last=False)
            self._blocks[(entry.number, block)] = rows
        return {name: tensor[row - block * file.block_rows] for name, tensor in rows.items()}

    def _verify_whole(self, file: SidecarFile) -> None:
        """An older format's sidecar (one checksum of the whole file): read whole by its path and verified, once."""
        (read_reinforced if file.meta.get("format") == WHOLE_FILE_FORMAT else read_sidecar)(file.path)
        if not file.unchanged():
            raise DataError(f"{file.path}: written again while read: run again once `disco-clip data embed` is done")
        file.verified.add(0)
        file.stats.blocks += 1
        file.stats.bytes += file.identity[2]

    def _open(self, shard: str, key: str | None = None) -> _Open:
        entry = self._files.get(shard)
        if entry is not None:
            self._files.move_to_end(shard)
            return entry
        path = sidecar_path(self.folder, shard)
        if not path.is_file():
            sample = f" (sample {key})" if key is not None else ""
            raise DataError(f"no teacher embeddings for shard {describe_source(shard)}{sample}: {path} is missing")
        file = open_sidecar(path, self.stats)
        try:
            entry = self._entry(file, shard)
        except BaseException:
            file.close()
            raise
        while len(self._files) >= self.capacity:
            _, old = self._files.popitem(last=False)
            old.file.close()
            for block in [b for b in self._blocks if b[0] == old.number]:
                del self._blocks[block]
        self._files[shard] = entry
        return entry

    def _entry(self, file: SidecarFile, shard: str) -> _Open:
        """A sidecar just opened, checked (`sidecar_problem`, the first one's settings), with its tensors' names."""
        meta = with_first_teacher(file.meta)
        problem = sidecar_problem(meta, shard, self.fingerprints)
        if problem:
            raise DataError(f"{file.path}: {problem}: run `disco-clip data embed` for these shards again")
        self._check_settings(file.path, settings_of(meta))
        self._check_widths(file.path, stored_widths(meta, {n: (t.code, t.shape) for n, t in file.tensors.items()}))
        self._opened += 1
        if meta.get("format") not in SECOND_LAYOUT:
            return _Open(file, self._opened, ["image"], [{LEGACY_CAPTION_KEY: "text"}], None)
        keys = self._settings().caption_keys
        texts = [{c: f"text/{f}/{c}" for c in keys} for f in self.fingerprints]
        return _Open(
            file,
            self._opened,
            [f"image/{f}" for f in self.fingerprints],
            texts,
            "boxes" if "boxes" in file.tensors else None,
        )

    def _check_widths(self, path: Path, widths: dict[str, int]) -> None:
        widths = {f: widths[f] for f in self.fingerprints}
        if not self._widths:
            self._widths = widths
            return
        for fingerprint, width in widths.items():
            if width != self._widths[fingerprint]:
                raise DataError(
                    f"{path}: its embeddings of teacher {fingerprint} are {width} wide, other sidecars' of "
                    f"{self.folder} {self._widths[fingerprint]}: embed every shard with one teacher"
                )

    def _check_settings(self, path: Path, stored: Reinforced) -> None:
        if self._facts is None:
            self._facts = stored
            return
        first, this = self._facts, stored
        for name in ("augmentations", "caption_keys", "seed"):
            if getattr(first, name) != getattr(this, name):
                raise DataError(
                    f"{path}: made with {name} {getattr(this, name)}, other sidecars of {self.folder} with "
                    f"{getattr(first, name)}: embed every shard with one setting"
                )
