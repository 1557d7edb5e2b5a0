"""`disco-clip data verify`: read every shard to its end, decode a sample of images, write sizes.json."""

from __future__ import annotations

import re
import statistics
import tarfile
from pathlib import Path

from disco_clip_ds.data.decode import BadImage, EncodedImage
from disco_clip_ds.data.shards import IMAGE_EXTS, write_json
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.errors import DataError

_SHARD_RE = re.compile(r"^(\d+)\.tar$")


def inspect_shard(path: Path, decode_limit: int) -> dict:
    """Read a tar to its end through the one shard reader (data/streams/tar_samples.py), so that its count is the
    training stream's and webdataset's (samples keyed at the first dot of a member's base name) and a shard cut short
    anywhere, at a member boundary included, is found; decode up to `decode_limit` images as training does
    (data/decode.py: what it would skip is reported with the reason it would give), collect caption lengths."""
    samples, caption_words, decoded, errors = 0, [], 0, []
    try:
        for sample in raw_samples(str(path)):
            samples += 1
            image = next((ext for ext in IMAGE_EXTS if ext in sample), None)
            if image is not None and decoded < decode_limit:
                try:
                    EncodedImage(sample[image]).decode()
                    decoded += 1
                except BadImage as err:  # report which sample is undecodable, go on
                    errors.append(f"{sample['__key__']}.{image}: cannot decode ({err})")
            if "txt" in sample:
                caption_words.append(len(sample["txt"].decode("utf-8", errors="replace").split()))
    except (tarfile.TarError, OSError, EOFError, ValueError) as err:
        errors.append(f"unreadable tar: {err}" if samples == 0 else f"after {samples} samples: {err}")
    return {"samples": samples, "decoded": decoded, "caption_words": caption_words, "errors": errors}


def verify(folder: Path, decode_per_shard: int = 16) -> dict:
    """Check every NNNNN.tar in `folder`; write sizes.json for the readable ones; return a report."""
    shards = sorted(p for p in folder.glob("*.tar") if _SHARD_RE.match(p.name))
    if not shards:
        raise DataError(f"no NNNNN.tar shard in {folder}")
    sizes, broken, words, decoded = {}, {}, [], 0
    for path in shards:
        result = inspect_shard(path, decode_per_shard)
        decoded += result["decoded"]
        words += result["caption_words"]
        if result["errors"]:
            broken[path.name] = result["errors"]
        else:
            sizes[path.name] = result["samples"]
    # only good shards, written even when none is: a training run reading sizes.json must not count a broken one
    write_json(folder / "sizes.json", sizes)
    return {
        "shards": len(shards),
        "broken": broken,
        "samples": sum(sizes.values()),
        "decoded": decoded,
        "caption_words": _length_stats(words),
    }


def _length_stats(lengths: list[int]) -> dict:
    if not lengths:
        return {"count": 0}
    return {
        "count": len(lengths),
        "empty": sum(1 for n in lengths if n == 0),
        "min": min(lengths),
        "median": statistics.median(lengths),
        "mean": round(statistics.fmean(lengths), 2),
        "max": max(lengths),
    }
