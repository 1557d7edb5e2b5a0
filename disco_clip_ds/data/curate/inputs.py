"""What `disco-clip data filter` checks of its inputs before it reads a sample: the shards are local files, each has a
sidecar of one teacher (the named one, when --teacher is given) made for it as it is now, the rules are in range,
and the output folder is new or holds this very filter's earlier, interrupted output. Each refusal is one line."""

from __future__ import annotations

import json
from pathlib import Path

from disco_clip_ds.data.embeddings import read_metadata, sidecar_path, sidecar_problem
from disco_clip_ds.data.shards import local_shards as _local_shards
from disco_clip_ds.data.shards import repeated_shard, twice_text, write_json
from disco_clip_ds.data.teacher_id import teacher_fingerprint
from disco_clip_ds.distributed.runlock import WRITER_LOCK
from disco_clip_ds.errors import DataError, UsageError

ARGUMENTS_FILE = "filter.json"  # the arguments an output was made with: a resume with other ones is refused


def local_shards(spec: str) -> list[str]:
    """The shards of SPEC ('::'-joined sources, brace patterns, folders), each an existing local file, named once."""
    urls = _local_shards(spec, "data filter")
    repeated = repeated_shard(urls)
    if repeated:
        raise UsageError(f"--shards names {twice_text(*repeated)}: give each shard once")
    return urls


def sidecars(urls: list[str], folder: str | None, teacher: str | None) -> tuple[list[Path], str]:
    """Each shard's sidecar (in FOLDER, else beside the shard) and the one teacher fingerprint they share; a
    UsageError naming a shard without one (with the `data embed` command that makes it), sidecars of two teachers,
    a sidecar not of the named teacher or not made for its shard as it is now."""
    paths = [sidecar_path(folder or Path(u).parent, u) for u in urls]
    metas = {u: read_metadata(p) for u, p in zip(urls, paths) if p.is_file()}
    missing = [u for u, p in zip(urls, paths) if not p.is_file()]
    if missing:
        name = teacher or next((m.get("teacher_name") for m in metas.values() if m.get("teacher_name")), "MODEL")
        out = f" --output {folder}" if folder else ""
        expected = sidecar_path(folder or Path(missing[0]).parent, missing[0]).name
        raise UsageError(
            f"--shards: {len(missing)} shard(s) without teacher embeddings, e.g. {missing[0]} (no {expected}): run "
            f"`disco-clip data embed --teacher {name} --shards '{'::'.join(missing)}'{out}`"
        )
    teachers = sorted({m.get("teacher", "?") for m in metas.values()})
    if len(teachers) > 1:
        raise UsageError(
            f"--embeddings: sidecars of {len(teachers)} teachers (fingerprints {', '.join(teachers)}): filter shards "
            "embedded by one teacher; embed the others again with it"
        )
    fingerprint = teachers[0]
    if teacher is not None:
        wanted = teacher_fingerprint(teacher)
        if wanted != fingerprint:
            raise UsageError(
                f"--teacher {teacher}: the sidecars were made by another teacher (fingerprint {fingerprint}, not "
                f"{wanted}): give that teacher, or embed the shards with this one"
            )
    for url, path in zip(urls, paths):
        problem = sidecar_problem(metas[url], url, fingerprint)
        if problem:
            raise UsageError(f"{path}: was {problem}: run `disco-clip data embed` for {url} again")
    return paths, fingerprint


def check_target_teacher(target: str, fingerprint: str) -> None:
    """A target shards folder with sidecars must hold the shards' teacher's (a target embedded by another model would
    point at clusters by another geometry); a UsageError in one line otherwise."""
    folder = Path(target)
    for sidecar in sorted(folder.glob("*.teacher.safetensors")) if folder.is_dir() else []:
        try:
            made_by = read_metadata(sidecar).get("teacher")
        except DataError as error:
            raise UsageError(str(error)) from error
        if made_by != fingerprint:
            raise UsageError(
                f"--target {target}: {sidecar.name} was made by another teacher (fingerprint {made_by}, not the "
                f"shards' {fingerprint}): embed the target with the shards' teacher"
            )


def check_reference(folder: str) -> None:
    """A --dedup_against folder holds shards (its own or a CLIP_benchmark set's test/); else a UsageError."""
    from disco_clip_ds.data.curate.sets import set_shards

    try:
        set_shards(folder)
    except UsageError as error:
        raise UsageError(f"--dedup_against {error}") from error


def claim_output(output: Path, arguments: dict) -> None:
    """Make OUTPUT this filter's: a new or empty folder gets the arguments file; one holding the same arguments is
    resumed; one holding other arguments, or files without an arguments file, is refused in one line."""
    record = output / ARGUMENTS_FILE
    if record.is_file():
        earlier = json.loads(record.read_text())
        if earlier != arguments:
            differ = sorted(k for k in set(earlier) | set(arguments) if earlier.get(k) != arguments.get(k))
            shown = "; ".join(f"--{k} {earlier.get(k)!r} there, {arguments.get(k)!r} here" for k in differ)
            raise UsageError(
                f"--output {output}: holds the output of a filter with other arguments ({shown}): give another "
                "--output, or re-run with the same arguments to resume"
            )
        return
    if output.is_dir() and any(p.name != WRITER_LOCK for p in output.iterdir()):
        raise UsageError(f"--output {output}: holds files that are not a filter's output: give a new or empty folder")
    write_json(record, arguments)
