"""The Trainer side of complete-or-absent checkpoints: staged saves published with a manifest, a final model
verified once written, a full disk as one line on every rank (the rules are in disco_clip_ds.checkpoint.layout)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from disco_clip_ds import faults
from disco_clip_ds.checkpoint.final_model import final_files
from disco_clip_ds.checkpoint.layout import STAGING, newest_complete, save_problem
from disco_clip_ds.checkpoint.manifest import MANIFEST, write_manifest
from disco_clip_ds.checkpoint.space import disk_full_message, folder_bytes, free_bytes, is_disk_full
from disco_clip_ds.distributed.ranks import all_true, any_true, barrier, from_rank0, rank
from disco_clip_ds.errors import CheckpointError


class CompleteCheckpoints:
    """Checkpoint-N appears complete, with its manifest, or not at all; rotation (save_total_limit) only counts
    complete ones; the final model (`save_final`) gets a manifest once written; a full disk is one clear
    CheckpointError on every rank, before or during any of these saves. DiscoTrainer's hooks call it
    (`_get_output_dir` reads `staging_dir`, `_save_checkpoint` calls `save_checkpoint`, `save_model` calls
    `save_model`); `trainer` is the DiscoTrainer.

    No failure may leave ranks waiting in different collectives (a hang with no message): every rank checks the
    free space before writing, and while a save is under way a write that fails on one rank is recorded instead of
    raised (`failures`), so that the rank goes on through the same DeepSpeed barriers as the others and every rank
    learns of it in the agreement that follows."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.staging_dir: Path | None = None  # where the Trainer's save writes checkpoint-N while one is under way
        self.failures: list[BaseException] | None = None  # a list while a save is under way: this rank's failed writes

    def save_model(self, save, output_dir: str | None, internal_call: bool) -> None:
        """The Trainer's `save(output_dir, internal_call)`; during a checkpoint or final save, a write that fails is
        recorded."""
        if self.failures is None:
            return save(output_dir, internal_call)
        try:  # the writes come after any gather (ZeRO-3) that save_model does with the other ranks
            save(output_dir, internal_call)
        except Exception as error:  # e.g. OSError, torch's RuntimeError, SafetensorError
            self.failures.append(error)

    def save_checkpoint(self, save, run_dir: Path) -> None:
        """checkpoint-N of `run_dir`, complete or absent: `save()` (the Trainer's _save_checkpoint) writes it into
        the staging area, then rank 0 adds the manifest and publishes it."""
        step = self.trainer.state.global_step
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        staging = run_dir / STAGING
        needed = self._checkpoint_bytes(run_dir)
        self._check_space(run_dir, needed, step, name, every_rank_writes=True)
        if rank() == 0 and (staging / name).exists():
            shutil.rmtree(staging / name)
        self.staging_dir = staging
        with self._recording_failures() as failures:
            try:
                save()
            except Exception as error:  # after DeepSpeed's last barrier: nothing collective is left
                failures.append(error)
            finally:
                self.staging_dir = None
        self._settle(failures[0] if failures else None, run_dir, needed, name, staging / name)
        error = None  # every rank has written its part: rank 0 adds the manifest and publishes
        if rank() == 0:
            try:
                self._publish(staging / name, run_dir / name)
            except Exception as e:  # a full disk while writing the manifest, or an incomplete folder
                error = e
        self._settle(error, run_dir, needed, name, staging / name)  # no rank moves on before checkpoint-N exists

    def save_final(self, metrics: dict) -> None:
        """The final save into output_dir (train metrics, model, Trainer state), then its manifest, written last:
        a kill or a full disk on the way leaves none, and the next run repairs the final model (`keep_final_model`)."""
        trainer = self.trainer
        run_dir, step = Path(trainer.args.output_dir), trainer.state.global_step
        needed = int(1.1 * self._model_bytes()) + 2**20
        self._check_space(run_dir, needed, step, "the final model", every_rank_writes=False)
        before = {}
        if rank() == 0:
            (run_dir / MANIFEST).unlink(missing_ok=True)  # until the new one is written, the final model is unverified
            before = final_files(run_dir)
        with self._recording_failures() as failures:
            try:
                trainer.save_metrics("train", metrics)
                trainer.save_model(str(run_dir))
                faults.in_final_save(step)
                trainer.save_state()
            except Exception as error:  # e.g. OSError, torch's RuntimeError, SafetensorError
                failures.append(error)
        self._settle(failures[0] if failures else None, run_dir, needed, "the final model", None)
        error = None  # every rank has written its part: the manifest, over what this save wrote, comes last
        if rank() == 0:
            try:
                write_manifest(run_dir, sorted(n for n, t in final_files(run_dir).items() if before.get(n) != t))
            except Exception as e:  # e.g. no space left for the manifest
                error = e
        self._settle(error, run_dir, needed, "the final model", None)

    @contextlib.contextmanager
    def _recording_failures(self):
        """While a save runs: a write that fails on this rank (the Trainer's weights, DeepSpeed's files) is
        recorded, and the rank skips its remaining DeepSpeed writes but not the collectives between them. DeepSpeed
        writes every checkpoint file through its checkpoint_engine, copies zero_to_fp32.py, and writes 'latest'
        (rank 0) just before its closing barrier: that last one is written here instead, after it."""
        self.failures = failures = []
        trainer = self.trainer
        engine = trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None
        patched = []

        def guard(write):
            @functools.wraps(write)
            def guarded(*args, **kwargs):
                if failures:
                    return None
                try:
                    faults.in_deepspeed_write(trainer.state.global_step)
                    return write(*args, **kwargs)
                except Exception as error:  # e.g. OSError, torch's RuntimeError, SafetensorError
                    failures.append(error)
                    return None

            return guarded

        def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):  # noqa: B006 (DeepSpeed's signature)
            tag = str(tag or f"global_step{engine.global_steps}")
            done = original(save_dir, tag, client_state, False, exclude_frozen_parameters)
            if save_latest and engine.global_rank == 0:
                guard(Path(save_dir, "latest").write_text)(tag)
            return done

        if engine is not None and hasattr(engine, "checkpoint_engine"):
            original = engine.save_checkpoint
            for owner, attr, replacement in (
                (engine.checkpoint_engine, "save", guard(engine.checkpoint_engine.save)),
                (engine, "_copy_recovery_script", guard(engine._copy_recovery_script)),
                (engine, "save_checkpoint", functools.wraps(original)(save_checkpoint)),
            ):
                patched.append((owner, attr, owner.__dict__.get(attr)))
                setattr(owner, attr, replacement)
        try:
            yield failures
        finally:
            self.failures = None
            for owner, attr, previous in reversed(patched):
                if previous is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, previous)

    def _settle(self, error, run_dir: Path, needed: int, what: str, staged: Path | None) -> None:
        """Every rank learns whether the save failed anywhere; if it did, rank 0 removes the partial save and every
        rank raises: one line for a full disk (on any rank), else the error itself."""
        device = self.trainer.args.device
        if all_true(error is None, device):
            return
        disk_full = any_true(is_disk_full(error), device)
        if rank() == 0 and staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
            with contextlib.suppress(OSError):
                staged.parent.rmdir()  # tmp-checkpoints, when nothing else is staged
        barrier()  # the partial save is gone before any rank reports
        if disk_full:
            raise CheckpointError(disk_full_message(run_dir, needed, what)) from error
        if error is None:
            raise CheckpointError(f"another rank failed to save {what}; the last complete checkpoint is intact")
        raise error

    def _check_space(self, run_dir: Path, needed: int, step: int, what: str, every_rank_writes: bool) -> None:
        """Every rank (that writes) compares its free space with `needed`; all stop together, before writing."""
        free = free_bytes(run_dir, step) if every_rank_writes or self.trainer.args.should_save else None
        if not all_true(free is None or free >= needed, self.trainer.args.device):
            raise CheckpointError(disk_full_message(run_dir, needed, what, free))

    def _checkpoint_bytes(self, run_dir: Path) -> int:
        """The space checkpoint-N will take (same on every rank): the last complete checkpoint's size, or before the
        first one an estimate from the weights and every rank's optimizer state, each +10 %."""
        previous = newest_complete(run_dir, checksums=False, warn=False) if rank() == 0 else None
        measured = from_rank0(folder_bytes(previous) if previous else None)
        if measured:
            return int(1.1 * measured)
        optimizer = torch_sum(_optimizer_bytes(self.trainer.optimizer), self.trainer.args.device)
        # the weights twice: model.safetensors and DeepSpeed's model states; 1 MiB for the small files
        return int(1.1 * (2 * self._model_bytes() + optimizer)) + 2**20

    def _model_bytes(self) -> int:
        # under ZeRO-3 a parameter's full size is ds_numel (its local tensor is a partition)
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in self.trainer.model.parameters())

    def _publish(self, staged: Path, final: Path) -> None:
        problem = save_problem(staged)
        if problem:
            raise CheckpointError(f"{staged} is incomplete after every rank saved ({problem})")
        write_manifest(staged)  # over every file present, from whichever part of the code it came
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
        best = self.trainer.state.best_model_checkpoint
        rotate_checkpoints(
            output_dir=str(final.parent),
            save_total_limit=self.trainer.args.save_total_limit,
            best_model_checkpoint=None if best is None or STAGING in best else best,
        )


def _optimizer_bytes(optimizer) -> int:
    """This rank's optimizer state in bytes: the innermost torch optimizer's parameters (under ZeRO, the fp32
    partition) and state tensors (e.g. Adam's moments), as its checkpoint shard will hold them."""
    import torch

    while hasattr(optimizer, "optimizer"):  # accelerate's wrapper, DeepSpeed's ZeRO optimizer, then torch's
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        return 0
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def torch_sum(value: int, device) -> int:
    """`value` summed over the ranks."""
    import torch
    import torch.distributed as dist

    from disco_clip_ds.distributed.ranks import is_distributed

    if not is_distributed():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return int(t.item())
