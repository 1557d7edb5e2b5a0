"""MetaCLIP's balancing (Xu et al., "Demystifying CLIP Data", 2023; facebookresearch/MetaCLIP): captions matched
against a metadata list, then each sample kept with a probability that flattens the head of the entries' counts.

Matching is MetaCLIP's `substr_matching` (metaclip/substr_matching.py): an entry matches a caption when " entry "
(the entry with a space each side) is a substring of the spaced caption: " caption " with each of , . ; : ? ! `
wrapped in spaces and tabs and line breaks made spaces. So it is case-sensitive ("Dog" is not "dog"), an entry
matches whole words only ("cat" is not in "cats" nor in "concat"), punctuation next to a word does not stop it
("cat," and "(cat" differ: only the listed punctuation is spaced), and every entry found counts, overlapping ones
too ("apple" and "apple pie" in "apple pie"). The search is an Aho-Corasick automaton over the spaced entries
(pyahocorasick, as MetaCLIP's own script), one pass over each caption whatever the list's length.

Balancing is MetaCLIP's `balancing.py`: count[e] is the number of samples whose caption matches entry e, over the
pool (here: the samples every other rule keeps); p[e] = min(1, t / count[e]); a sample is kept when any of its
entries draws it (a uniform draw u < p[e] per entry of the sample), so with probability 1 - prod(1 - p[e]). A sample
whose caption matches no entry is dropped, as MetaCLIP curates only matched pairs.

The draws are numpy's, seeded with (--seed, the shard's index in --shards) and made for every matched pair of the
shard in sample order, so the decision depends on neither --processes nor the order shards are scanned in.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path
from typing import NamedTuple

import numpy as np

from disco_clip_ds.data.prep.embed_loader import TEXT_KEYS
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.tarcopy import Members, sample_members
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.texts import decode_text, read_text

PUNCTUATION = (",", ".", ";", ":", "?", "!", "`")  # MetaCLIP's `spacing`: wrapped in spaces
BLANKS = ("\t", "\n", "\r")  # MetaCLIP's `spacing`: made spaces

_MATCHERS: dict[str, Matcher] = {}  # a worker builds the automaton once per metadata list, not once per shard


def check_balance(metadata: str | None, balance_t: float | None) -> None:
    """--metadata and --balance_t together, t > 0; a UsageError in one line otherwise."""
    if (metadata is None) != (balance_t is None):
        raise UsageError("--metadata and --balance_t go together: MetaCLIP's balancing needs the list and its t")
    if balance_t is not None and not balance_t > 0:
        raise UsageError(f"--balance_t {balance_t}: give a positive count (MetaCLIP: 20000 for 400M samples)")


def read_entries(path: str) -> list[str]:
    """The metadata list's entries: its non-blank lines, stripped, each once (the first kept), in file order; a
    UsageError for a file that is missing, not UTF-8 text, or without any entry."""
    text = read_text(path, "--metadata")
    if "\0" in text:
        raise UsageError(f"--metadata {path}: holds NUL bytes, not a text file: give one entry a line, in UTF-8")
    entries = list(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
    if not entries:
        raise UsageError(f"--metadata {path}: no entries (the file is empty): give one entry a line, in UTF-8")
    return entries


class Listing(NamedTuple):
    """A checked metadata list, as the scan tasks receive it: its path, its file's sha256 (a saved scan matched
    against another list is scanned again) and its number of entries."""

    path: str
    digest: str
    size: int


def listing(path: str) -> Listing:
    """The Listing of the metadata file at `path`, read and checked (`read_entries`)."""
    size = len(read_entries(path))
    return Listing(path, hashlib.sha256(Path(path).read_bytes()).hexdigest(), size)


def spacing(text: str) -> str:
    """MetaCLIP's `spacing`: " text " with its punctuation wrapped in spaces and its tabs and line breaks spaces."""
    spaced = f" {text} "
    for mark in PUNCTUATION:
        if mark in spaced:  # a scan is cheaper than a replace that copies the caption unchanged
            spaced = spaced.replace(mark, f" {mark} ")
    for blank in BLANKS:
        if blank in spaced:
            spaced = spaced.replace(blank, " ")
    return spaced


class Matcher:
    """An Aho-Corasick automaton of the spaced entries; `match` gives a caption's entry ids."""

    def __init__(self, entries: list[str]):
        import ahocorasick

        self.size = len(entries)
        self.automaton = ahocorasick.Automaton(ahocorasick.STORE_INTS)
        for index, entry in enumerate(entries):
            self.automaton.add_word(f" {entry} ", index)
        self.automaton.make_automaton()

    def match(self, caption: str) -> list[int]:
        """The sorted ids of the entries found in `caption` (each once)."""
        return sorted({index for _, index in self.automaton.iter(spacing(caption))})


def matcher(listing: Listing) -> Matcher:
    """The Matcher of a metadata list, built once per process."""
    if listing.digest not in _MATCHERS:
        _MATCHERS[listing.digest] = Matcher(read_entries(listing.path))
    return _MATCHERS[listing.digest]


def shard_matches(url: str, located: Members | None, keys: list[str], rows: np.ndarray, match: Matcher) -> dict:
    """The scan's arrays of a shard's matches: "meta_ids" (int32, every sample's entry ids one after another) and
    "meta_starts" (int64, n + 1: sample i's ids are meta_ids[meta_starts[i]:meta_starts[i + 1]]). Samples without
    embeddings (`rows` < 0, dropped as no_embedding) are not matched."""
    ids, starts = [], [0]
    for key, row, caption in zip(keys, rows, _captions(url, located)):
        if row >= 0:
            ids += match.match(decode_text(caption, f"{url}: sample {key}'s caption", DataError))
        starts.append(len(ids))
    return {"meta_ids": np.array(ids, np.int32), "meta_starts": np.array(starts, np.int64)}


def _captions(url: str, located: Members | None):
    """Each sample's caption bytes, in shard order (b"" without one): the first of its txt, text, caption members,
    read where the tar headers say they lie, or through tarfile for a shard that is not plain (tarcopy.py)."""
    located = located if located is not None else sample_members(url)
    if located is None:
        for sample in raw_samples(url):
            yield next((sample[k] for k in TEXT_KEYS if sample.get(k) is not None), b"")
        return
    caption = _caption_members(located)
    with open(url, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for j in caption.tolist():
            yield b"" if j < 0 else mm[int(located.offsets[j]) : int(located.offsets[j]) + int(located.sizes[j])]


def _caption_members(located: Members) -> np.ndarray:
    """Each sample's caption member (an index into the shard's members; -1 for none): its first member of the
    first of TEXT_KEYS it has."""
    counts = np.diff(np.asarray(located.starts, np.int64))
    sample_of = np.repeat(np.arange(len(counts)), counts)
    caption = np.full(len(counts), -1, np.int64)
    codes = [located.exts.index(key) for key in TEXT_KEYS if key in located.exts]
    for code in reversed(codes):  # the first key written last wins
        members = np.flatnonzero(np.asarray(located.ext) == code)[::-1]  # and of its members, the first
        caption[sample_of[members]] = members
    return caption


def balance_drops(scans: list[Path], offsets, pool: np.ndarray, t: float, seed: int, size: int) -> np.ndarray:
    """The mask of the pool's samples (`pool`: those every other rule keeps) that balancing drops, from the matches
    the scans saved; two passes over the scans (the counts, then the draws), one shard's matches held at a time."""
    counts = np.zeros(size, np.int64)
    for scan, start in zip(scans, offsets):
        ids, starts = _matches(scan)
        members = pool[start : start + len(starts) - 1]
        counts += np.bincount(ids[np.repeat(members, np.diff(starts))], minlength=size)
    probability = keep_probability(counts, t)
    kept = np.zeros(len(pool), bool)
    for shard, (scan, start) in enumerate(zip(scans, offsets)):
        ids, starts = _matches(scan)
        kept[start : start + len(starts) - 1] = draw_shard(ids, starts, probability, seed, shard)
    return pool & ~kept


def _matches(scan: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(scan) as saved:
        return saved["meta_ids"], saved["meta_starts"]


def keep_probability(counts: np.ndarray, t: float) -> np.ndarray:
    """MetaCLIP's per-entry probability: min(1, t / count) (an entry no sample matches: 1)."""
    return t / np.maximum(counts.astype(np.float64), t)


def entry_hits(ids: np.ndarray, probability: np.ndarray, seed: int, shard: int) -> np.ndarray:
    """Per matched pair of a shard (in sample order), whether its entry draws the sample: u < p[entry], u uniform
    from a generator seeded with (seed, shard)."""
    return np.random.default_rng([seed, shard]).random(len(ids)) < probability[ids]


def draw_shard(ids: np.ndarray, starts: np.ndarray, probability: np.ndarray, seed: int, shard: int) -> np.ndarray:
    """The mask of a shard's samples that any of their entries draws: a uniform u per matched pair (in sample
    order, from a generator seeded with (seed, shard)), kept where u < p[entry]."""
    hits = entry_hits(ids, probability, seed, shard)
    sample_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    kept = np.zeros(len(starts) - 1, bool)
    kept[sample_of[hits]] = True
    return kept
