"""The one reader of a checkpoint folder and of the checkpoint-N folders of a run: the step a checkpoint is at, its
DeepSpeed tag, the ranks that saved it, whether it is complete and matches its manifest, and the one rule for the
newest good checkpoint. Every other module (resume, final model, export, training) asks here.

The Trainer writes checkpoint-N in place, so a kill mid-save leaves a folder that the stock `get_last_checkpoint`
picks and every resume then fails on. Neither transformers (5.x dropped its tmp-checkpoint staging) nor DeepSpeed
stages a multi-rank save, hence `CompleteCheckpointsMixin`: the Trainer writes into tmp-checkpoints/checkpoint-N and
rank 0, once every rank has written its part and `save_problem` finds the save complete, records every file's size
and checksum in its manifest.json and renames it to checkpoint-N. A checkpoint without a manifest is therefore a
save that did not complete, and a file cut short or damaged later (a full disk on another job, a bad copy) shows
against the manifest: training and export pick a checkpoint with `newest_complete`, which skips (naming why) any
folder `checkpoint_problem` refuses. The final model in the run folder gets a manifest too, written last
(checkpoint/final_model.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from disco_clip_ds.checkpoint.ema import ema_files
from disco_clip_ds.checkpoint.manifest import MANIFEST, manifest_problem
from disco_clip_ds.distributed.ranks import decided_on_rank0
from disco_clip_ds.errors import CheckpointError, UsageError

logger = logging.getLogger("disco_clip_ds.checkpoint.layout")

STAGING = "tmp-checkpoints"
TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = (  # the full-weight files that transformers writes, in the order they are looked for
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# --- what one folder holds ---


def has_weights(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds full model weights (one of WEIGHT_FILES)."""
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


def deepspeed_tag(checkpoint: str | os.PathLike) -> Path | None:
    """The folder of DeepSpeed's state that checkpoint/latest names (it may be missing from a damaged checkpoint);
    None when there is no `latest` file (a checkpoint saved without DeepSpeed)."""
    latest = Path(checkpoint) / "latest"
    return Path(checkpoint) / latest.read_text().strip() if latest.is_file() else None


def has_zero_partitions(checkpoint: str | os.PathLike) -> bool:
    """Whether DeepSpeed ZeRO (stage 1-3) saved the fp32 master weights in per-rank optimizer partitions
    (*zero_pp_rank_*optim_states.pt); stage 0 writes none."""
    tag = deepspeed_tag(checkpoint)
    return tag is not None and any(tag.glob("*zero_pp_rank_*optim_states.pt"))


def is_zero3(checkpoint: str | os.PathLike) -> bool:
    """Whether the checkpoint was saved under ZeRO-3: one model-states file per rank."""
    tag = deepspeed_tag(checkpoint)
    return tag is not None and any(tag.glob("zero_pp_rank_*_model_states.pt"))


def saved_ranks(checkpoint: str | os.PathLike) -> int:
    """How many ranks saved `checkpoint`: the Trainer writes one RNG state per rank (rng_state_R.pth), or a single
    rng_state.pth for one process; 0 when there is none."""
    checkpoint = Path(checkpoint)
    return len(list(checkpoint.glob("rng_state_*.pth"))) or int((checkpoint / "rng_state.pth").is_file())


def trainer_state(checkpoint: str | os.PathLike) -> dict:
    """The Trainer's trainer_state.json in `checkpoint` (steps, log history); JSON, nothing unpickled."""
    return json.loads((Path(checkpoint) / TRAINER_STATE).read_text())


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The optimizer step a checkpoint was saved at."""
    return trainer_state(folder)["global_step"]


# --- whether it is complete ---


def save_problem(folder: str | os.PathLike) -> str | None:
    """What a finished save of `folder` lacks (None: nothing): the Trainer state, an RNG state per rank, and either
    DeepSpeed's model states with one optimizer shard per rank, or full weights (FSDP: its own files); an EMA file per
    rank when the run keeps an EMA. The check before a save's manifest is written; `checkpoint_problem` repeats it
    under the manifest."""
    folder = Path(folder)
    try:
        checkpoint_step(folder)
    except (OSError, ValueError, KeyError):
        return f"no readable {TRAINER_STATE}"
    ranks = saved_ranks(folder)
    if not ranks:
        return "no rng_state*.pth"
    emas = len(ema_files(folder))
    if emas and emas != ranks:
        return f"{emas} EMA files for {ranks} ranks"
    tag = deepspeed_tag(folder)
    if tag is not None:  # DeepSpeed: the tag folder holds model states and one optimizer shard per rank
        if not any(tag.glob("*model_states.pt")):
            return f"no DeepSpeed model states in {tag.name}"
        shards = list(tag.glob("*optim_states.pt"))
        if shards and len(shards) != ranks:
            return f"{len(shards)} DeepSpeed optimizer shards for {ranks} ranks"
        return None
    if has_weights(folder) or any(folder.glob("pytorch_model_fsdp_*")):
        return None
    return "no weights"


def checkpoint_problem(folder: str | os.PathLike, checksums: bool = True) -> str | None:
    """Why `folder` cannot be resumed from or exported (None when it can): no manifest (the save did not complete),
    a file that does not match it (sizes; with `checksums`, checksums too), or what `save_problem` finds."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return f"no {MANIFEST}: the save did not complete"
    return manifest_problem(folder, checksums) or save_problem(folder)


def model_folder_problem(folder: str | os.PathLike) -> str | None:
    """Why the model in `folder` cannot be trusted (None when it can), checked as `disco-clip export` checks what it
    exports: a Trainer checkpoint (DeepSpeed's `latest`, the Trainer's RNG states) must pass `checkpoint_problem`; a
    folder with a manifest (a run's final model, an export) must match it, checksums included, and a run folder's
    final model must have one (the final save writes it last); a folder of weights with no manifest and no
    checkpoints (save_pretrained's, a hub download) has nothing to be checked against."""
    folder = Path(folder)
    if deepspeed_tag(folder) is not None or saved_ranks(folder):
        return checkpoint_problem(folder)
    if checkpoint_folders(folder) and not (folder / MANIFEST).is_file():
        return f"no {MANIFEST}: the final save did not complete"
    if (folder / MANIFEST).is_file():
        return manifest_problem(folder)
    return None


def verify_model_folder(source: str, flag: str) -> None:
    """Refuse on every rank (CheckpointError; checked on rank 0) a model folder `source` whose files do not verify
    (`model_folder_problem`), naming a checkpoint that does; `flag` names the argument in the message. A hub id, or
    anything else that is not a folder, is left to its loader."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        decided_on_rank0(lambda: _refuse_model(folder, f"{flag} {source}"))


def _refuse_model(folder: Path, named: str) -> None:
    problem = model_folder_problem(folder)
    if problem is None:
        return
    if checkpoint_folders(folder):  # a run folder whose final model is damaged
        good, where = newest_complete(folder, warn=False), "in it"
    else:
        good, where = newest_complete_before(folder), "beside it"
    instead = f"the newest checkpoint {where} that verifies is {good}" if good else f"no checkpoint {where} verifies"
    raise CheckpointError(f"{named} does not verify: {problem}; {instead}")


# --- the checkpoints of a run ---


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
    """The newest checkpoint-N in output_dir that `checkpoint_problem` accepts (None if there is none), logging one
    line for each newer one skipped and why. `older_than`: only checkpoints before that step."""
    for folder in checkpoint_folders(output_dir):
        if older_than is not None and int(folder.name.split("-")[-1]) >= older_than:
            continue
        problem = checkpoint_problem(folder, checksums)
        if problem is None:
            return folder
        if warn:
            logger.warning("skipping %s: %s", folder.name, problem)
    return None


def newest_complete_before(checkpoint: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint beside `checkpoint` that is older than it: what to use instead of a
    checkpoint that does not verify."""
    checkpoint = Path(checkpoint)
    step = checkpoint.name.split("-")[-1]
    return newest_complete(checkpoint.parent, older_than=int(step) if step.isdigit() else None, warn=False)


def resolve_latest(output_dir: str | os.PathLike) -> str | None:
    """`newest_complete` chosen on rank 0, so that every rank resumes the same checkpoint."""
    return decided_on_rank0(lambda: str(newest) if (newest := newest_complete(output_dir)) else None)


def verify_resumable(checkpoint: str | os.PathLike) -> None:
    """Refuse, on every rank, an explicit --resume_from_checkpoint folder that is missing (UsageError) or does not
    verify (CheckpointError), naming the newest checkpoint beside it that does. Checked on rank 0."""
    decided_on_rank0(lambda: _refuse_resume(Path(checkpoint)))


def _refuse_resume(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        raise UsageError(f"--resume_from_checkpoint {checkpoint}: no such folder")
    problem = checkpoint_problem(checkpoint)
    if problem is None:
        return
    good = newest_complete_before(checkpoint)
    instead = (
        f"the newest checkpoint that verifies is {good}" if good else f"no checkpoint in {checkpoint.parent} verifies"
    )
    raise CheckpointError(f"cannot resume from {checkpoint}: {problem}; {instead}")
