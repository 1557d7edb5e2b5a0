"""An exponential moving average (EMA) of the weights, kept in fp32 and sharded like the fp32 master weights, saved in
every checkpoint (one safetensors file per rank, covered by the checkpoint's manifest) and restored exactly on resume,
on any number of ranks.

The update rule and schedule are timm's `ModelEmaV3` (timm/utils/model_ema.py), applied after each optimizer step:

    ema <- lerp(ema, w, 1 - d(step)),   d(step) = 0 while step <= start_step + 1, then
    d = min(decay, 1 - (1 + (step - start_step - 1) / gamma) ** -power)   with warmup, else d = decay.

Of ModelEmaV3's options: `decay` (--ema_decay), `update_after_step` (--ema_start_step), `use_warmup`
(--ema_warmup, on by default here, off in timm) with timm's `warmup_gamma` 1.0 and `warmup_power` 2/3, and `min_decay`
0.0 are supported; `exclude_buffers` is always on in effect (the model's buffers, position ids, are not trained), and
`device` (an EMA on another device) and karras decay are not. With decay 0 the EMA is a copy of the weights, so until
`start_step` the EMA tracks the weights exactly.

What each rank averages: the piece of the fp32 master weights it updates itself, read in place after the optimizer
step, never a gathered copy.
- DeepSpeed ZeRO-1/2: each trainable parameter's fragment in this rank's fp32 partition (`param._hp_mapping`, the
  mapping DeepSpeed's own universal checkpoints use).
- DeepSpeed ZeRO-3: each parameter's slice of `fp32_partitioned_groups_flat` (`get_local_fp32_param`).
- FSDP2: each DTensor parameter's local shard (the sharded parameters are fp32; mixed precision casts on the fly).
- otherwise (one process, DDP): the parameters themselves.
Each fragment is saved under the parameter's name with its offset in the flattened full parameter, so a resume on
another world size re-partitions it exactly (each rank reads, lazily, the slices its own fragments cover) and an
export assembles the full EMA from every rank's file."""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
from transformers import TrainerCallback

from disco_clip_ds.checkpoint.ema import EMA_DIR, Fragment, fill_fragments, saved_settings, write_fragments

logger = logging.getLogger("disco_clip_ds.train.ema")

WARMUP_GAMMA, WARMUP_POWER, MIN_DECAY = 1.0, 2.0 / 3.0, 0.0  # timm ModelEmaV3's defaults


def ema_decay(step: int, decay: float, start_step: int = 0, warmup: bool = True) -> float:
    """The decay applied at optimizer step `step` (1-based, as the Trainer counts after the step): timm ModelEmaV3's
    `get_decay` with update_after_step=`start_step`, use_warmup=`warmup`, warmup_gamma 1, warmup_power 2/3, min_decay
    0."""
    step = max(0, step - start_step - 1)
    if step <= 0:
        return 0.0
    if not warmup:
        return decay
    warm = 1.0 - (1.0 + step / WARMUP_GAMMA) ** -WARMUP_POWER
    return max(min(warm, decay), MIN_DECAY)


def _fragments(model, optimizer, rank: int, world: int) -> list[tuple[Fragment, torch.Tensor]]:
    """This rank's fragments of the trainable parameters and, for each, the fp32 master tensor (1-D, a view that the
    optimizer step updates in place)."""
    pieces = []
    zero3 = getattr(optimizer, "fp32_partitioned_groups_flat", None) is not None
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if hasattr(param, "_hp_mapping"):  # ZeRO-1/2; None where this rank holds none of the parameter
            mapping = param._hp_mapping
            if mapping is not None:
                address = mapping.lp_fragment_address
                pieces.append((Fragment(name, address.start, address.numel, shape), mapping.get_hp_fragment()))
        elif zero3 and hasattr(param, "ds_id"):
            local = optimizer.get_local_fp32_param(param)  # this rank's slice, padded at the end of the last rank's
            start = rank * local.numel()
            numel = max(0, min(local.numel(), math.prod(shape) - start))
            if numel:
                pieces.append((Fragment(name, start, numel, shape), local.narrow(0, 0, numel)))
        elif hasattr(param, "to_local"):  # an FSDP2 DTensor: dim 0 split in torch.chunk's pieces
            local = param.to_local()
            rows = -(-shape[0] // world) if shape else 0
            per_row = math.prod(shape[1:])
            if local.numel():
                pieces.append((Fragment(name, rank * rows * per_row, local.numel(), shape), local.view(-1)))
        else:
            pieces.append((Fragment(name, 0, param.numel(), shape), param.data.view(-1)))
    return pieces


class WeightsEma(TrainerCallback):
    """The EMA of `trainer`'s (a DiscoTrainer's) weights. It starts at `on_train_begin`, once the optimizer exists,
    from the fp32 master weights or, when the trainer set `resume_from`, from that checkpoint's EMA; the trainer calls
    `save` into each checkpoint folder; the update runs at `on_optimizer_step`, before the step's other callbacks (the
    in-training eval) and its checkpoint. `swapped()` puts the EMA into the model for the length of a `with` block
    (`--eval_ema`)."""

    def __init__(self, trainer, decay: float, start_step: int = 0, warmup: bool = True):
        self.decay, self.start_step, self.warmup = decay, start_step, warmup
        self.trainer = trainer
        self.resume_from: str | None = None
        self.begun_at = 0  # the optimizer step whose weights the EMA started from (a resume without one: that step)
        self.fragments: list[Fragment] = []
        self.values: list[torch.Tensor] = []  # this rank's EMA, one fp32 tensor per fragment
        # the fp32 master weights each fragment averages: views found once, at the start, of the tensors the optimizer
        # updates in place (looking them up each step would cost a stream sync per parameter under ZeRO-3 on a GPU)
        self.sources: list[torch.Tensor] = []

    # --- where the master weights are ---

    def _optimizer(self):
        engine = self.trainer.model_wrapped
        return getattr(engine, "optimizer", None) if self.trainer.is_deepspeed_enabled else None

    # --- the trainer's calls ---

    def on_train_begin(self, args, state, control, **kwargs):
        self.start(self.resume_from, state.global_step)

    def start(self, checkpoint: str | None, step: int = 0) -> None:
        """Begin from the current fp32 master weights (those of optimizer step `step`), or from `checkpoint`'s EMA
        when it holds one."""
        args = self.trainer.args
        pieces = _fragments(self.trainer.model, self._optimizer(), args.process_index, args.world_size)
        self.fragments = [fragment for fragment, _ in pieces]
        self.sources = [source for _, source in pieces]
        self.values = [source.detach().float().clone() for source in self.sources]
        folder = Path(checkpoint) / EMA_DIR if checkpoint else None
        self.begun_at = step
        if folder is not None and folder.is_dir():
            fill_fragments(folder, self.fragments, self.values)
            self.begun_at = saved_settings(checkpoint).get("begun_at", 0)  # files before this key: from the start
        elif folder is not None:
            logger.warning("%s holds no EMA: the EMA starts from its weights, at step %d", checkpoint, step)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.update(state.global_step + 1)  # the Trainer counts the step just after this callback

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold the weights after optimizer step `step` into the EMA."""
        if not self.values:
            return
        weight = 1.0 - ema_decay(step, self.decay, self.start_step, self.warmup)
        torch._foreach_lerp_(self.values, self.sources, weight)  # ModelEmaV3's update, as one kernel per group

    def save(self, output_dir: str | Path) -> None:
        """This rank's EMA into OUTPUT_DIR/ema/ (checkpoint/ema.py's layout)."""
        settings = {"decay": self.decay, "start_step": self.start_step, "warmup": self.warmup}
        settings["begun_at"] = self.begun_at
        write_fragments(Path(output_dir), self.trainer.args.process_index, self.fragments, self.values, settings)

    # --- evaluating the EMA ---

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the EMA weights inside the block, its own on leaving it (exactly: the values are swapped,
        not recomputed). Collective under DeepSpeed: every rank enters it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for source, value in zip(self.sources, self.values):
            held = source.clone()
            source.copy_(value)
            value.copy_(held)
        self._refresh_model()

    def _refresh_model(self) -> None:
        """The model's own parameters from the fp32 masters, as DeepSpeed's step does after updating them."""
        optimizer = self._optimizer()
        if optimizer is None:
            return  # FSDP2 or one process: the masters are the parameters
        if hasattr(optimizer, "update_lp_params"):  # ZeRO-1/2: copy into the bit16 partition, all-gather
            optimizer.update_lp_params()
        elif hasattr(optimizer, "_reassign_or_swap_out_partitioned_parameters"):  # ZeRO-3: its step's end (0.19.8)
            for group in range(len(optimizer.fp32_partitioned_groups_flat)):
                optimizer._reassign_or_swap_out_partitioned_parameters(group)  # masters -> the model's partitions
            persistent = optimizer.persistent_parameters  # below stage3_param_persistence_threshold: kept whole
            if persistent:
                persistent[0].all_gather(persistent)
            optimizer.invalidate_secondary_tensor()
