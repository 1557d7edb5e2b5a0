"""Checkpoints that are complete, verified or skipped, the one rule for the newest good checkpoint, a final model
that can be verified and repaired, and a one-line error for a full disk.

The Trainer writes checkpoint-N in place, so a kill mid-save leaves a folder that the stock `get_last_checkpoint`
picks and every resume then fails on. Neither transformers (5.x dropped its tmp-checkpoint staging) nor DeepSpeed
stages a multi-rank save, hence `CompleteCheckpointsMixin`: the Trainer writes into tmp-checkpoints/checkpoint-N and
rank 0, once every rank has written its part, records every file's size and checksum in its manifest.json and
renames it to checkpoint-N. A file cut short or damaged later (a full disk on another job, a bad copy) shows against
the manifest: training and export pick a checkpoint with `newest_complete`, which skips (naming why) any folder
`checkpoint_problem` finds incomplete or not matching its manifest. The final model in the run folder gets a manifest
too, written last: a final save cut short leaves none, and a re-run rewrites the final model from the last
checkpoint (`keep_final_model`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from disco_clip_ds import faults
from disco_clip_ds.distributed.ranks import from_rank0, rank
from disco_clip_ds.errors import CheckpointError, DiscoClipError, UsageError

logger = logging.getLogger("disco_clip_ds.checkpoint.layout")

STAGING = "tmp-checkpoints"
MANIFEST = "manifest.json"
WEIGHT_FILES = (  # the full-weight files that transformers writes, in the order they are looked for
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def has_weights(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds full model weights (one of WEIGHT_FILES)."""
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


# --- manifests: every file's size and checksum ---


def _checksum(path: Path) -> str:
    # xxh3-128 (xxhash, a dependency of datasets): it catches truncation, bit rot and partial copies as surely as a
    # cryptographic hash (nobody forges checkpoints here) at memory speed, several GB/s per core, where sha256 or
    # blake2b manage a few hundred MB/s: checksumming a multi-GB checkpoint costs about what reading it costs.
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _checksums(folder: Path, names: list[str]) -> list[str]:
    # one thread per file: the hash releases the GIL, and a ZeRO checkpoint has one large shard per rank
    with ThreadPoolExecutor(max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda name: _checksum(folder / name), names))


def write_manifest(folder: str | os.PathLike, names: list[str] | None = None) -> None:
    """Record the size and checksum of every file under `folder` (or of `names`, paths relative to it) in
    folder/manifest.json, written atomically."""
    folder = Path(folder)
    if names is None:
        names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    sizes = [(folder / name).stat().st_size for name in names]
    files = {
        name: {"size": size, "xxh3_128": digest}
        for name, size, digest in zip(names, sizes, _checksums(folder, names), strict=True)
    }
    tmp = folder / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def manifest_problem(folder: str | os.PathLike, checksums: bool = True) -> str | None:
    """What in `folder` does not match its manifest.json (None: every file it lists is there with its size and, with
    `checksums`, its checksum). Call only where a manifest exists.

    Sizes are always compared (one stat per file). Checksums are compared by default: a flipped or zeroed block
    keeps the size, and resuming from it fails deep inside DeepSpeed or trains on damaged weights; at xxh3 speed the
    cost is about that of the reads the resume does anyway (the files are then in the page cache)."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing (the manifest lists it)"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} is {size} bytes, the manifest says {entry['size']}"
    if checksums:
        names = list(files)
        for name, digest in zip(names, _checksums(folder, names), strict=True):
            if digest != files[name]["xxh3_128"]:
                return f"{name} does not match its checksum in the manifest"
    return None


# --- what counts as a complete checkpoint ---


def checkpoint_problem(folder: str | os.PathLike, checksums: bool = True) -> str | None:
    """Why `folder` cannot be resumed from (None when it can): its manifest (when it has one: every checkpoint
    written through CompleteCheckpointsMixin does), then Trainer state, weights and every rank's DeepSpeed files (all
    that older checkpoints, or those written by other tools, are checked for)."""
    folder = Path(folder)
    if (folder / MANIFEST).exists():
        problem = manifest_problem(folder, checksums)
        if problem:
            return problem
    try:
        json.loads((folder / "trainer_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError):
        return "no readable trainer_state.json"
    ranks = len(list(folder.glob("rng_state_*.pth"))) or int((folder / "rng_state.pth").exists())
    if not ranks:
        return "no rng_state*.pth"
    latest = folder / "latest"
    if latest.is_file():  # DeepSpeed: the tag folder holds model states and one optimizer shard per rank
        tag = folder / latest.read_text().strip()
        if not any(tag.glob("*model_states.pt")):
            return f"no DeepSpeed model states in {tag.name}"
        shards = list(tag.glob("*optim_states.pt"))
        if shards and len(shards) != ranks:
            return f"{len(shards)} DeepSpeed optimizer shards for {ranks} ranks"
        return None
    if has_weights(folder) or any(folder.glob("pytorch_model_fsdp_*")):
        return None
    return "no weights"


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The optimizer step a checkpoint was saved at."""
    return json.loads((Path(folder) / "trainer_state.json").read_text())["global_step"]


def checkpoint_folders(output_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint-N folders in output_dir, complete or not, newest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


def newest_complete(
    output_dir: str | os.PathLike, checksums: bool = True, older_than: int | None = None, warn: bool = True
) -> Path | None:
    """The newest checkpoint-N in output_dir that is complete and matches its manifest (None if there is none),
    logging one line for each newer one skipped and why. `older_than`: only checkpoints before that step."""
    for folder in checkpoint_folders(output_dir):
        if older_than is not None and int(folder.name.split("-")[-1]) >= older_than:
            continue
        problem = checkpoint_problem(folder, checksums)
        if problem is None:
            return folder
        if warn:
            logger.warning("skipping %s: %s", folder.name, problem)
    return None


def resolve_latest(output_dir: str | os.PathLike) -> str | None:
    """`newest_complete` chosen on rank 0, so that every rank resumes the same checkpoint."""
    newest = newest_complete(output_dir) if rank() == 0 else None
    return from_rank0(str(newest) if newest else None)


def check_resume(checkpoint: str | os.PathLike) -> None:
    """Refuse, on every rank, an explicit --resume_from_checkpoint folder that is missing (UsageError) or does not
    verify (CheckpointError), naming the newest checkpoint beside it that does. Checked on rank 0."""
    verdict = _on_rank0(lambda: _resume_refusal(Path(checkpoint)))
    if verdict:
        kind, message = verdict
        raise (UsageError if kind == "usage" else CheckpointError)(message)


def _resume_refusal(checkpoint: Path) -> tuple[str, str] | None:
    if not checkpoint.is_dir():
        return "usage", f"--resume_from_checkpoint {checkpoint}: no such folder"
    problem = checkpoint_problem(checkpoint)
    if problem is None:
        return None
    step = checkpoint.name.split("-")[-1]
    good = newest_complete(checkpoint.parent, older_than=int(step) if step.isdigit() else None, warn=False)
    instead = (
        f"the newest checkpoint that verifies is {good}" if good else f"no checkpoint in {checkpoint.parent} verifies"
    )
    return "failed", f"cannot resume from {checkpoint}: {problem}; {instead}"


def _on_rank0(compute):
    """compute() on rank 0, its result on every rank. A DiscoClipError raised there is raised on every rank (the
    other ranks would otherwise wait for the result until the process group times out)."""
    result = None
    if rank() == 0:
        try:
            result = ("ok", compute())
        except DiscoClipError as error:
            result = ("error", error)
    kind, value = from_rank0(result)
    if kind == "error":
        raise value
    return value


# --- the final model in the run folder ---

# what a checkpoint holds only to resume from, and the final save does not write
RESUME_ONLY = (
    "scheduler.pt",
    "rng_state*.pth",
    "latest",
    "zero_to_*.py",
    "optimizer.pt",
    "scaler.pt",
    "stream_state.json",
    MANIFEST,
)


def final_model_problem(run_dir: str | os.PathLike, checksums: bool = True) -> str | None:
    """Why the final model in `run_dir` cannot be used (None when it can). The final save writes its manifest
    last, so a final save cut short has none; a run folder of an older version (checkpoints without manifests)
    keeps the old rule: weights present."""
    run_dir = Path(run_dir)
    if (run_dir / MANIFEST).exists():
        return manifest_problem(run_dir, checksums)
    if not (has_weights(run_dir) or (run_dir / "latest").is_file()):
        return "missing"
    newest = next(iter(checkpoint_folders(run_dir)), None)
    if newest is not None and (newest / MANIFEST).exists():
        return f"no {MANIFEST}: the final save did not complete"
    return None


def keep_final_model(run_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> str | None:
    """For a finished run, decided on rank 0 and returned on every rank: None when its final model verifies (then
    nothing is touched); else the final model is rewritten from `checkpoint` (the last checkpoint, at the final
    step) and one line says so."""
    return _on_rank0(lambda: _keep_final_model(Path(run_dir), Path(checkpoint)))


def _keep_final_model(run_dir: Path, checkpoint: Path) -> str | None:
    problem = final_model_problem(run_dir)
    if problem is None:
        return None
    try:
        written = _write_final_from(checkpoint, run_dir)
    except Exception as error:  # copyfile's OSError, or safetensors' error when consolidating
        if _is_disk_full(error):
            needed = sum(p.stat().st_size for p in _final_files_in(checkpoint))
            raise CheckpointError(disk_full_message(run_dir, needed, "the final model")) from error
        raise
    return (
        f"run finished at {checkpoint.name}, but its final model was not usable ({problem}): rewritten in {run_dir} "
        f"from {checkpoint.name} ({', '.join(written)}), the weights the run ended with"
    )


def _final_files_in(checkpoint: Path) -> list[Path]:
    return [p for p in sorted(checkpoint.iterdir()) if p.is_file() and not any(p.match(g) for g in RESUME_ONLY)]


def _write_final_from(checkpoint: Path, run_dir: Path) -> list[str]:
    """Write the final model into run_dir from `checkpoint`: its weight files as the final save writes them (the
    same step's weights), or, for a ZeRO-3 checkpoint without full weights, the fp32 weights consolidated from its
    optimizer partitions as `disco-clip export` does. The manifest comes last."""
    (run_dir / MANIFEST).unlink(missing_ok=True)
    for name in WEIGHT_FILES:  # the final save's leftovers, e.g. a half-written model.safetensors
        (run_dir / name).unlink(missing_ok=True)
    copied = [p.name for p in _final_files_in(checkpoint)]
    for name in copied:
        shutil.copyfile(checkpoint / name, run_dir / name)
    if not has_weights(checkpoint):
        from disco_clip_ds.export.weights import build_plain_model, load_state_dict

        state_dict, _ = load_state_dict(checkpoint)
        build_plain_model(checkpoint, state_dict).save_pretrained(run_dir)  # model.safetensors and config.json
        copied = sorted({*copied, "model.safetensors", "config.json"})
    write_manifest(run_dir, copied)
    return copied


def final_files(run_dir: Path) -> dict[str, int]:
    """The files directly in run_dir with their modification times: what the final save wrote is what changed."""
    return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file() and p.name != MANIFEST}


# --- disk space ---


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _free_bytes(output_dir: Path, step: int) -> int:
    forced = faults.forced_free_bytes(step)
    return forced if forced is not None else shutil.disk_usage(output_dir).free


START_BYTES = 2**20  # run.lock, run.json, the logs: with less free, a run cannot even start


def check_space_at_start(output_dir: str | os.PathLike) -> None:
    """Refuse (CheckpointError, on every rank, decided on rank 0) to start a run in a folder whose disk is full."""

    def check() -> None:
        folder = Path(output_dir).absolute()
        while not folder.exists():
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        if free < START_BYTES:
            raise CheckpointError(
                f"no space left in {output_dir} ({_size(free)} free, a run needs at least {_size(START_BYTES)} to "
                "start and room for its checkpoints): free space or choose another --output_dir"
            )

    _on_rank0(check)


def disk_full_message(output_dir: Path, needed: int | None, what: str, free: int | None = None) -> str:
    """One line: where space ran out (free and needed), what is still intact, and how to go on. `free`: what a
    free-space check saw (default: what is free now)."""
    last = newest_complete(output_dir, checksums=False, warn=False)
    need = f"needs ~{_size(needed)}, " if needed else ""
    free = shutil.disk_usage(output_dir).free if free is None else free
    return (
        f"no space left in {output_dir} ({need}{_size(free)} free) while saving {what}; "
        f"{'the last complete checkpoint ' + last.name + ' is intact' if last else 'no checkpoint was saved'}: "
        "free space, then resume with --resume_from_checkpoint latest"
    )


def _is_disk_full(error: BaseException | None) -> bool:
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    # the writers that lose the errno: torch.save's C++ writer ("basic_ios::clear: iostream error", "file write
    # failed", "unexpected pos"), safetensors ("I/O error: No space left on device (os error 28)")
    text = str(error)
    return error is not None and any(
        s in text for s in ("iostream error", "write failed", "No space left", "unexpected pos", "os error 28")
    )
