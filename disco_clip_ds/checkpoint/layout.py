"""The one reader of a run folder's checkpoints: which checkpoint-N exist, what step each is at, whether one is
complete, and the one rule for the newest good checkpoint.

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

import json
import logging
import os
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from disco_clip_ds.checkpoint.manifest import MANIFEST, manifest_problem
from disco_clip_ds.distributed.ranks import decided_on_rank0, from_rank0, rank
from disco_clip_ds.errors import CheckpointError, UsageError

logger = logging.getLogger("disco_clip_ds.checkpoint.layout")

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


def verify_resumable(checkpoint: str | os.PathLike) -> None:
    """Refuse, on every rank, an explicit --resume_from_checkpoint folder that is missing (UsageError) or does not
    verify (CheckpointError), naming the newest checkpoint beside it that does. Checked on rank 0."""
    verdict = decided_on_rank0(lambda: _resume_refusal(Path(checkpoint)))
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
