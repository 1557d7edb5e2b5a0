"""The output folder of a download: repair before a resume, canonical tars, sizes.json and summary.json."""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections import Counter
from pathlib import Path

from disco_clip_ds.atomic import staged
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.errors import UsageError

_STATS_RE = re.compile(r"^(\d+)_stats\.json$")
_TAR_RE = re.compile(r"^(\d+)\.tar$")
PARTIAL = ".partial"  # the suffix of a shard's tar set aside: cut short by a crash, or found damaged
_OUR_JSON = ("sizes.json", "summary.json")
_CANONICAL_MTIME = 0


def shard_name(shard_id: int) -> str:
    return f"{shard_id:05d}"


def prepare_output_for_resume(output: Path) -> list[int]:
    """Make an existing output folder safe for img2dataset's incremental mode; return shards to redo.

    img2dataset counts a shard as done when `NNNNN_stats.json` exists and parses every `*.json` in
    the folder as such, so our derived sizes.json/summary.json are removed (they are rewritten at the
    end) and a shard whose tar is gone loses its stats file so that it is downloaded again.
    """
    if not output.exists():
        return []
    for name in _OUR_JSON:
        (output / name).unlink(missing_ok=True)
    strays = [p.name for p in output.glob("*.json") if not _STATS_RE.match(p.name)]
    if strays:
        raise UsageError(
            f"{output} holds {', '.join(sorted(strays))}; img2dataset would fail on it. "
            "Move it out of the output folder, or choose another --output."
        )
    redo = []
    for stats in sorted(output.glob("*_stats.json")):
        shard_id = int(_STATS_RE.match(stats.name).group(1))
        if not (output / f"{shard_name(shard_id)}.tar").exists():
            stats.unlink()
            (output / f"{shard_name(shard_id)}.parquet").unlink(missing_ok=True)
            redo.append(shard_id)
    return redo


def done_shards(output: Path) -> dict[int, dict]:
    """`{shard_id: stats}` for every shard img2dataset finished (its `_stats.json` exists)."""
    done = {}
    for stats in output.glob("*_stats.json"):
        shard_id = int(_STATS_RE.match(stats.name).group(1))
        done[shard_id] = json.loads(stats.read_text())
    return dict(sorted(done.items()))


def canonicalize_tar(path: Path) -> int:
    """Rewrite a finished shard with members sorted by name and a fixed mtime; return its sample count, as the one
    shard reader counts it (data/streams/tar_samples.py: webdataset's key rule), which also finds a truncated tar.

    Leaves a tar that is already canonical untouched. The rewrite goes through a temporary file and
    an atomic rename, so an interruption never leaves a half-written shard behind. Sorting keeps each sample's
    members together: a key's members share the prefix "KEY.", which no other key's member names start with.
    """
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        if names != sorted(names) or any(m.mtime != _CANONICAL_MTIME for m in members):
            with staged(path) as tmp, tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as out:
                for member in sorted(members, key=lambda m: m.name):
                    member.mtime = _CANONICAL_MTIME
                    out.addfile(member, tar.extractfile(member))
    return sum(1 for _ in raw_samples(str(path), read=False))


def summarize(output: Path, n_expected: int) -> tuple[dict, dict]:
    """Aggregate img2dataset's per-shard stats into (summary, sizes); canonicalizes finished tars."""
    done = done_shards(output)
    reasons: Counter = Counter()
    totals = Counter()
    sizes = {}
    for shard_id, stats in list(done.items()):
        tar = output / f"{shard_name(shard_id)}.tar"
        try:
            samples = canonicalize_tar(tar)
        except (tarfile.TarError, OSError, ValueError) as err:  # ValueError: a member twice in one sample
            samples, problem = None, f"unreadable tar ({err})"
        else:
            problem = f"tar holds {samples} samples, its stats say {stats['successes']}"
        if samples != stats["successes"]:  # a damaged shard: drop its stats so that a re-run redoes it
            print(f"shard {shard_name(shard_id)}: {problem}; set aside, it will be downloaded again on the next run")
            (output / f"{shard_name(shard_id)}_stats.json").unlink()
            del done[shard_id]
            continue
        sizes[tar.name] = samples
        for key in ("count", "successes", "failed_to_download", "failed_to_resize"):
            totals[key] += stats[key]
        for reason, n in stats["status_dict"].items():
            if reason != "success":
                reasons[reason.strip()] += n
    failed = [shard_name(i) for i in range(n_expected) if i not in done]
    aside = set_aside_unfinished(output, done)
    summary = {
        "shards": n_expected,
        "shards_done": len(done),
        "shards_failed": failed,
        "count": totals["count"],
        "successes": totals["successes"],
        "failed_to_download": totals["failed_to_download"],
        "failed_to_resize": totals["failed_to_resize"],
        "failures_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "shards_set_aside": aside,
    }
    return summary, sizes


def set_aside_unfinished(output: Path, done: dict[int, dict]) -> list[str]:
    """Rename the tar of each shard that is not done (a worker that crashed in it, a damaged one) to NNNNN.tar.partial,
    so that a folder of shards holds finished ones only (training reads `*.tar`); the re-run writes the shard anew.
    A done shard's stale .partial goes. Returns the shards set aside, by name."""
    aside = []
    for tar in sorted(output.glob("*.tar")):
        match = _TAR_RE.match(tar.name)
        if match and int(match.group(1)) not in done:
            os.replace(tar, tar.with_name(tar.name + PARTIAL))
            aside.append(tar.stem)
    for shard_id in done:
        (output / f"{shard_name(shard_id)}.tar{PARTIAL}").unlink(missing_ok=True)
    return aside


def print_summary(summary: dict, output: Path) -> None:
    print(
        f"{output}: {summary['successes']}/{summary['count']} samples in {summary['shards_done']}/{summary['shards']} "
        f"shards; failed_to_download {summary['failed_to_download']}, failed_to_resize {summary['failed_to_resize']}"
    )
    for reason, n in list(summary["failures_by_reason"].items())[:10]:
        print(f"  {n:>8}  {reason}")
    if summary["shards_failed"]:
        print(f"  shards failed for good: {', '.join(summary['shards_failed'])} (re-run the same command to retry)")
    if summary["shards_set_aside"]:
        print(f"  cut short, set aside as NNNNN.tar{PARTIAL}: {', '.join(summary['shards_set_aside'])}")
