"""Shard lists: brace expansion, '::'-joined sources, sample counts from sizes.json or img2dataset stats, and the
disjoint split of shards over (rank, DataLoader worker)."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from braceexpand import braceexpand  # webdataset's own dependency, the same expansion its ShardList does

from disco_clip_ds.atomic import write_json  # noqa: F401  (the data modules' JSON writer: atomic.py's, named here)
from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.errors import UsageError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # the image keys of a webdataset sample, as img2dataset writes them
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)


def is_url(spec: str) -> bool:
    """Whether a shard spec is remote (`scheme://...`) or a webdataset `pipe:` command rather than a local path."""
    return bool(_URL.match(spec)) or spec.startswith("pipe:")


def expand_shards(spec: str) -> list[str]:
    """Expand `"a/{00000..00009}.tar::b/{000..003}.tar"` into a list of shard paths or URLs.

    Sources are joined with '::'; each is brace-expanded. A local directory stands for its `*.tar` files.
    Raises ValueError for an empty spec, and FileNotFoundError for a local directory without tar files.
    """
    return [url for source in expand_sources(spec) for url in source]


def expand_sources(spec: str) -> list[list[str]]:
    """The shards of each '::'-joined source of `spec`, in order (a weighted mixture reads each as its own stream);
    `expand_shards` is their concatenation. Raises as `expand_shards` does."""
    sources: list[list[str]] = []
    for source in (s.strip() for s in spec.split("::")):
        if not source:
            continue
        if not is_url(source) and Path(source).is_dir():
            tars = sorted(str(p) for p in Path(source).glob("*.tar"))
            if not tars:
                raise FileNotFoundError(f"no .tar shards in directory {describe_source(source)}")
            sources.append(tars)
        else:
            sources.append(list(braceexpand(source)))
    if not any(sources):
        raise ValueError(f"no shards in {spec!r}: give paths like 'dir/{{00000..00009}}.tar', sources joined by '::'")
    return sources


def source_specs(spec: str) -> list[str]:
    """The '::'-joined sources of `spec` as written (one per `expand_sources` entry)."""
    return [s.strip() for s in spec.split("::") if s.strip()]


def repeated_shard(urls: list[str]) -> tuple[str, str] | None:
    """The first shard of `urls` named a second time (`a::a`, overlapping brace patterns, one file by two paths), as
    (its first spelling, its second); None when each is named once. Local shards are compared as the files they
    resolve to, URLs as written."""
    seen: dict[str, str] = {}
    for url in urls:
        key = url if is_url(url) else os.path.realpath(url)
        if key in seen:
            return seen[key], url
        seen[key] = url
    return None


def twice_text(first: str, second: str) -> str:
    """'the shard S twice (as A and B)' of `repeated_shard`'s pair, for a refusal."""
    spellings = f" (as {describe_source(first)} and {describe_source(second)})" if first != second else ""
    return f"the shard {describe_source(second)} twice{spellings}"


def missing_shards(urls: list[str]) -> list[str]:
    """The local shards of `urls` that are not files (a remote one is found missing only when it is read). Training
    skips them, as webdataset's and open_clip's readers do; an evaluation refuses them (eval/sources.py)."""
    return [url for url in urls if not is_url(url) and not os.path.isfile(url)]


def count_samples(urls: list[str]) -> int:
    """Total samples in the given local shards, from each folder's sizes.json or img2dataset's *_stats.json.

    Raises ValueError naming the shards it cannot count (remote URLs, or folders with neither file): pass
    --train_num_samples for those.
    """
    sizes = shard_sizes(urls)
    return sum(sizes[url] for url in urls)


def shard_sizes(urls: list[str]) -> dict[str, int]:
    """Samples in each of the given local shards, from each folder's sizes.json or img2dataset's *_stats.json.

    Raises ValueError as `count_samples` does when a shard cannot be counted.
    """
    counts, unknown = {}, []
    cache: dict[Path, dict[str, int]] = {}
    for url in urls:
        if is_url(url):
            unknown.append(url)
            continue
        path = Path(url)
        sizes = cache.setdefault(path.parent, _folder_sizes(path.parent))
        if path.name in sizes:
            counts[url] = sizes[path.name]
        else:
            unknown.append(url)
    if unknown:
        raise ValueError(
            f"cannot count the samples of {len(unknown)} shard(s), e.g. {describe_source(unknown[0])}: no entry in a "
            "sizes.json or img2dataset *_stats.json beside them; pass --train_num_samples"
        )
    return counts


def empty_reader(urls: list[str], num_readers: int) -> tuple[int, list[str]] | None:
    """The first reader whose shards all hold 0 samples by their recorded counts, with those shards; None when every
    reader has samples or the counts are not all known (the stream then finds out as it reads)."""
    try:
        sizes = shard_sizes(urls)
    except ValueError:
        return None
    for reader in range(num_readers):
        shards = shards_for_reader(urls, reader, num_readers)
        if not any(sizes[url] for url in shards):
            return reader, shards
    return None


def _folder_sizes(folder: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for stats in folder.glob("*_stats.json"):  # img2dataset: NNNNN_stats.json with "successes"
        try:
            sizes[stats.name.replace("_stats.json", ".tar")] = int(json.loads(stats.read_text())["successes"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"unreadable img2dataset stats file {stats}: {e}") from e
    sizes_file = folder / "sizes.json"
    if sizes_file.is_file():
        try:
            sizes.update({name: int(n) for name, n in json.loads(sizes_file.read_text()).items()})
        except (ValueError, AttributeError, TypeError) as e:
            raise ValueError(f'unreadable {sizes_file} (want {{"00000.tar": count, ...}}): {e}') from e
    return sizes


def shards_for_reader(urls: list[str], reader: int, num_readers: int) -> list[str]:
    """This reader's disjoint share of `urls` (reader = rank * workers_per_rank + worker).

    Raises ValueError when there are fewer shards than readers, since some readers would get nothing.
    """
    if len(urls) < num_readers:
        raise ValueError(
            f"{len(urls)} shard(s) for {num_readers} readers (ranks x dataloader workers): each reader needs at "
            "least one shard; lower --dataloader_num_workers or split the data into more shards"
        )
    return urls[reader::num_readers]


def epoch_order(shards: list[str], seed: int, epoch: int, reader: int) -> list[str]:
    """The reader's shards in a fresh order for each pass over them (resampling for multi-epoch runs)."""
    order = list(shards)
    random.Random(f"{seed}/{epoch}/{reader}").shuffle(order)
    return order


def resampled_order(urls: list[str], seed: int, epoch: int, reader: int) -> list[str]:
    """A pass of a reader under --dataset_resampled: len(urls) shards drawn with replacement from all of `urls`
    (open_clip's ResampledShards: every reader draws from every shard), seeded by (seed, pass, reader)."""
    return random.Random(f"{seed}/resampled/{epoch}/{reader}").choices(urls, k=len(urls))


def local_shards(spec: str, command: str) -> list[str]:
    """The shards of SPEC ('::'-joined sources, brace patterns, folders) for a command that reads local files only
    (`data embed`, `data filter`); a UsageError in one line for a bad spec, a remote shard or a missing one."""
    try:
        urls = expand_shards(spec)
    except (ValueError, OSError) as error:
        raise UsageError(f"--shards: {error}") from error
    remote = [u for u in urls if is_url(u)]
    if remote:
        raise UsageError(f"--shards: {command} reads local shards only, not {describe_source(remote[0])}")
    missing = missing_shards(urls)
    if missing:
        raise UsageError(f"--shards: {describe_source(missing[0])} does not exist")
    return urls
