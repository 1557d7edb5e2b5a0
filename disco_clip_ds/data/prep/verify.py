"""`disco-clip data verify`: read every shard to its end, decode a sample of images, write sizes.json."""

from __future__ import annotations

import io
import re
import statistics
import tarfile
from pathlib import Path

from disco_clip_ds.data.shards import IMAGE_EXTS, write_json
from disco_clip_ds.errors import DataError

_SHARD_RE = re.compile(r"^(\d+)\.tar$")


def inspect_shard(path: Path, decode_limit: int) -> dict:
    """Read a tar to its end; count samples, decode up to `decode_limit` images, collect caption lengths.

    Uses `tarfile` directly rather than webdataset: webdataset's readers stop quietly or skip on a
    truncated stream depending on the handler, while this must see every byte and name the failure.
    """
    from PIL import Image

    keys, caption_words, decoded, errors = set(), [], 0, []
    try:
        with tarfile.open(path) as tar:
            for member in tar:  # a tar cut at a member boundary just ends early here: see below
                data = tar.extractfile(member).read() if member.isfile() else b""
                key, _, ext = member.name.rpartition(".")
                ext = ext.lower()
                if ext in IMAGE_EXTS:
                    keys.add(key)
                    if decoded < decode_limit:
                        try:
                            with Image.open(io.BytesIO(data)) as img:
                                img.load()
                            decoded += 1
                        except Exception as err:  # report which sample is undecodable, go on
                            errors.append(f"{member.name}: cannot decode ({err})")
                elif ext == "txt":
                    caption_words.append(len(data.decode("utf-8", errors="replace").split()))
            end = tar.offset
        if not _ends_with_end_of_archive(path, end):
            errors.append(f"truncated tar: no end-of-archive marker after byte {end}")
    except (tarfile.TarError, OSError, EOFError) as err:
        errors.append(f"unreadable tar: {err}")
    return {"samples": len(keys), "decoded": decoded, "caption_words": caption_words, "errors": errors}


def _ends_with_end_of_archive(path: Path, offset: int) -> bool:
    # tarfile treats a header cut short as the end of the archive; a complete tar has two zero
    # blocks (and zero padding) where its last member ends.
    with open(path, "rb") as f:
        f.seek(offset)
        rest = f.read()
    return len(rest) >= 2 * tarfile.BLOCKSIZE and not rest.strip(b"\0")


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
    if sizes:  # only good shards: a training run reading sizes.json should not count broken ones
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
