"""Checkpoints that are complete or absent, the one rule for the newest complete checkpoint, and a one-line error
for a full disk.

The Trainer writes checkpoint-N in place, so a kill mid-save leaves a folder that the stock `get_last_checkpoint`
picks and every resume then fails on. Neither transformers (5.x dropped its tmp-checkpoint staging) nor DeepSpeed
stages a multi-rank save, hence `CompleteCheckpointsMixin`: the Trainer writes into tmp-checkpoints/checkpoint-N and
rank 0 renames it to checkpoint-N once every rank has written its part. Training and export pick a
checkpoint with `newest_complete`, which skips any folder `checkpoint_problem` finds incomplete.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from . import faults
from .errors import CheckpointError
from .ranks import all_true, barrier, from_rank0, rank

logger = logging.getLogger("disco_clip_ds.checkpoints")

STAGING = "tmp-checkpoints"
WEIGHT_FILES = (  # the full-weight files that transformers writes, in the order they are looked for
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def has_weights(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds full model weights (one of WEIGHT_FILES)."""
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


# --- what counts as a complete checkpoint ---


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder` cannot be resumed from (None when it is complete): Trainer state, weights, and every rank's
    DeepSpeed files. Checkpoints written through CompleteCheckpointsMixin are complete by construction; this catches
    those from older runs or copied by hand."""
    folder = Path(folder)
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


def newest_complete(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint-N in output_dir (None if there is none), warning about each newer one skipped."""
    for folder in checkpoint_folders(output_dir):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        logger.warning("skipping incomplete checkpoint %s (%s)", folder, problem)
    return None


def resolve_latest(output_dir: str | os.PathLike) -> str | None:
    """`newest_complete` chosen on rank 0, so that every rank resumes the same checkpoint."""
    newest = newest_complete(output_dir) if rank() == 0 else None
    return from_rank0(str(newest) if newest else None)


# --- disk space ---


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _free_bytes(output_dir: Path, step: int) -> int:
    forced = faults.forced_free_bytes(step)
    return forced if forced is not None else shutil.disk_usage(output_dir).free


def disk_full_message(output_dir: Path, needed: int | None, step: int) -> str:
    """One line: where space ran out, what is still intact, and how to go on."""
    last = newest_complete(output_dir)
    need = f"needs ~{_size(needed)}, " if needed else ""
    return (
        f"no space left in {output_dir} ({need}{_size(_free_bytes(output_dir, step))} free) while saving "
        f"checkpoint-{step}; "
        f"{'the last complete checkpoint ' + last.name + ' is intact' if last else 'no checkpoint was saved'}: "
        "free space, then resume with --resume_from_checkpoint latest"
    )


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.save's C++ writer loses the errno: "basic_ios::clear: iostream error", "file write failed"
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("iostream error", "write failed", "No space left", "unexpected pos")
    )


# --- the Trainer side ---


class CompleteCheckpointsMixin:
    """Mix into a Trainer subclass (before Trainer): checkpoint-N appears complete or not at all, rotation
    (save_total_limit) only counts complete ones, and a full disk is one clear CheckpointError."""

    _staging_dir: Path | None = None

    def _get_output_dir(self, trial) -> str:
        # The stock _save_checkpoint writes into _get_output_dir(trial)/checkpoint-N: point it at the staging area.
        return str(self._staging_dir) if self._staging_dir is not None else super()._get_output_dir(trial)

    def _save_rng_state(self, output_dir: str) -> None:
        faults.in_save(self.state.global_step)  # the named point: model and DeepSpeed files written, state not
        super()._save_rng_state(output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = Path(super()._get_output_dir(trial))
        step, name, device = (
            self.state.global_step,
            f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
            self.args.device,
        )
        staging = run_dir / STAGING
        needed = None
        if rank() == 0:
            previous = newest_complete(run_dir)
            needed = int(1.1 * _folder_bytes(previous)) if previous else None
        # the check on rank 0, the verdict on every rank: all ranks stop together, before writing anything
        enough = all_true(rank() != 0 or not needed or _free_bytes(run_dir, step) >= needed, device)
        if not enough:
            raise CheckpointError(disk_full_message(run_dir, from_rank0(needed), step))
        if rank() == 0 and (staging / name).exists():
            shutil.rmtree(staging / name)
        self._staging_dir, error = staging, None
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as e:
            error = e
        finally:
            self._staging_dir = None
        if not all_true(error is None, device):
            if rank() == 0:
                shutil.rmtree(staging / name, ignore_errors=True)
            if error is None:
                raise CheckpointError(f"another rank failed to save {name}; the last complete checkpoint is intact")
            if _is_disk_full(error):
                raise CheckpointError(disk_full_message(run_dir, needed, step)) from error
            raise error
        if rank() == 0:
            self._publish(staging / name, run_dir / name)
        barrier()  # no rank moves on (or exits) before checkpoint-N exists

    def _publish(self, staged: Path, final: Path) -> None:
        problem = checkpoint_problem(staged)
        if problem:
            raise CheckpointError(f"{staged} is incomplete after every rank saved ({problem})")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)  # atomic on one filesystem: checkpoint-N is complete or absent
        if not any(staged.parent.iterdir()):
            staged.parent.rmdir()
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        best = self.state.best_model_checkpoint
        rotate_checkpoints(
            output_dir=str(final.parent),
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=None if best is None or STAGING in best else best,
        )
