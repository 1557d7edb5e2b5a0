"""DeepSpeed universal checkpoints, for a resume on another number of ranks (`checkpoint.resume` decides when):
the conversion beside the original, loading it, and what deepspeed's ZeRO-3 universal load gets wrong."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
from pathlib import Path

from disco_clip_ds.checkpoint.layout import deepspeed_tag, saved_ranks
from disco_clip_ds.distributed.ranks import decided_on_rank0, rank
from disco_clip_ds.errors import CheckpointError

logger = logging.getLogger("disco_clip_ds.checkpoint.universal")

UNIVERSAL_DIR = "universal"  # OUTPUT_DIR/universal/checkpoint-N: a converted checkpoint, beside the original


def universal_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """OUTPUT_DIR/universal/checkpoint-N: `checkpoint` with its DeepSpeed ZeRO state converted to a universal
    checkpoint (`deepspeed.checkpoint.ds_to_universal`), which DeepSpeed loads on any number of ranks under
    `"checkpoint": {"load_universal": true}`. The Trainer's files are links to the original, which is never
    written to; the conversion runs on rank 0 while the others wait, into a staging folder renamed when complete,
    so that a kill mid-conversion leaves the original as it was and the next resume converts again."""
    checkpoint, root = Path(checkpoint).resolve(), Path(output_dir) / UNIVERSAL_DIR
    decided_on_rank0(lambda: _convert_once(checkpoint, root))
    return root / checkpoint.name


def _convert_once(checkpoint: Path, root: Path) -> None:
    """Convert `checkpoint` into root/checkpoint-N unless done, and drop the conversions of earlier checkpoints;
    any failure is one CheckpointError (raised on every rank by `decided_on_rank0`)."""
    final = root / checkpoint.name
    try:
        if not (final / "latest_universal").is_file():
            _convert(checkpoint, root)
        for old in root.iterdir():  # conversions of earlier checkpoints are of no further use
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    except Exception as exc:  # any failure of the conversion: every rank reports it
        raise CheckpointError(
            f"converting {checkpoint} to a universal checkpoint failed: {type(exc).__name__}: {exc}; the checkpoint "
            f"is unchanged: resume on {saved_ranks(checkpoint)} rank(s)"
        ) from exc


def _convert(checkpoint: Path, root: Path) -> None:
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    tag = deepspeed_tag(checkpoint)
    if tag is None or not tag.is_dir():
        raise CheckpointError(f"{checkpoint} has no DeepSpeed state ('latest' and its tag folder) to convert")
    staging = root / f"tmp-{checkpoint.name}"
    shutil.rmtree(staging, ignore_errors=True)  # what an interrupted conversion left
    staging.mkdir(parents=True)
    for entry in checkpoint.iterdir():
        if entry.name not in ("latest", "latest_universal", tag.name):
            (staging / entry.name).symlink_to(entry)
    options = argparse.Namespace(
        input_folder=str(tag),
        output_folder=str(staging / f"{tag.name}_universal"),
        num_extract_workers=1,  # in this process: a rank's process group should not be forked
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # The Trainer's engine saves no universal_checkpoint_info (Megatron-DeepSpeed's models carry it); DeepSpeed's
        # own flag adds the default one, in memory only.
        inject_missing_state=True,
    )
    logger.info("converting %s to a universal checkpoint for another world size", checkpoint)
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # ds_to_universal prints its progress
        ds_to_universal.main(options)  # writes staging/latest_universal last
    logger.debug("ds_to_universal: %s", printed.getvalue())
    os.replace(staging, root / checkpoint.name)


def load_universal(args) -> None:
    """Have DeepSpeed load universal checkpoints: `"checkpoint": {"load_universal": true}` in the run's DeepSpeed
    config, before the Trainer builds its engine (`args`: TrainingArguments with a DeepSpeed plugin)."""
    config = args.deepspeed_plugin.hf_ds_config.config
    config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}


def repair_zero3_universal_load(optimizer, checkpoint: str | os.PathLike) -> None:
    """Undo what deepspeed's ZeRO-3 universal loader (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`, 0.19.8)
    gets wrong, once `engine.load_checkpoint(checkpoint)` has run (`optimizer`: the engine's ZeRO-3 optimizer; a
    no-op for any other optimizer or a checkpoint that is not universal). It restores the fp32 master weights and
    both Adam moments exactly, but
    - gives every sub-group's state one and the same `step` tensor, which torch's Adam increments in place once per
      sub-group: with two parameter groups (decay and no decay) it counts two per optimizer step, and Adam's bias
      correction runs ahead: each sub-group gets its own copy;
    - sets every parameter group's hyperparameters to group 0's: the no-decay group gets weight decay: each group
      gets its own saved ones back (converted from the original checkpoint, as ZeRO-1/2's loader restores them).
    tests/launched/test_resume_on_another_world_size.py reproduces both on deepspeed's own conversion and load."""
    checkpoint = Path(checkpoint)
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if flats is None or not (checkpoint / "latest_universal").is_file():
        return
    import torch

    tag = checkpoint / (checkpoint / "latest_universal").read_text().strip()
    # mmap: the file also holds rank 0's whole fp32 partition, which is not read
    saved = torch.load(tag / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False, mmap=True)
    groups, inner = saved["param_groups"], optimizer.optimizer
    if len(groups) != len(inner.param_groups):
        raise CheckpointError(
            f"{checkpoint}: {len(groups)} optimizer parameter groups saved, {len(inner.param_groups)} built"
        )
    for group, old in zip(inner.param_groups, groups):
        group.update({k: v for k, v in old.items() if k != "params"})
    for flat in flats:
        state = inner.state.get(flat, {})
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def drop_universal(output_dir: str | os.PathLike) -> None:
    """Remove OUTPUT_DIR/universal on rank 0 (a conversion used by an earlier resume)."""
    if rank() == 0:
        shutil.rmtree(Path(output_dir) / UNIVERSAL_DIR, ignore_errors=True)
