"""The final model in the run folder: verified by its manifest (written last), rewritten from the last checkpoint
when a final save was cut short."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from disco_clip_ds.checkpoint.consolidate import build_plain_model, load_state_dict
from disco_clip_ds.checkpoint.layout import WEIGHT_FILES, deepspeed_tag, has_weights
from disco_clip_ds.checkpoint.manifest import MANIFEST, manifest_problem, write_manifest
from disco_clip_ds.checkpoint.space import disk_full_message, is_disk_full
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import CheckpointError

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
    """Why the final model in `run_dir` cannot be used (None when it can): missing, or, as the final save writes its
    manifest last, no manifest (the final save did not complete), or a file that does not match it."""
    run_dir = Path(run_dir)
    if (run_dir / MANIFEST).exists():
        return manifest_problem(run_dir, checksums)
    if not (has_weights(run_dir) or deepspeed_tag(run_dir) is not None):
        return "missing"
    return f"no {MANIFEST}: the final save did not complete"


def keep_final_model(run_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> str | None:
    """For a finished run, decided on rank 0 and returned on every rank: None when its final model verifies (then
    nothing is touched); else the final model is rewritten from `checkpoint` (the last checkpoint, at the final
    step) and one line says so."""
    return decided_on_rank0(lambda: _keep_final_model(Path(run_dir), Path(checkpoint)))


def _keep_final_model(run_dir: Path, checkpoint: Path) -> str | None:
    problem = final_model_problem(run_dir)
    if problem is None:
        return None
    try:
        written = _write_final_from(checkpoint, run_dir)
    except Exception as error:  # copyfile's OSError, or safetensors' error when consolidating
        if is_disk_full(error):
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
        state_dict, _ = load_state_dict(checkpoint)
        build_plain_model(checkpoint, state_dict).save_pretrained(run_dir)  # model.safetensors and config.json
        copied = sorted({*copied, "model.safetensors", "config.json"})
    write_manifest(run_dir, copied)
    return copied


def final_files(run_dir: Path) -> dict[str, int]:
    """The files directly in run_dir with their modification times: what the final save wrote is what changed."""
    return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file() and p.name != MANIFEST}
