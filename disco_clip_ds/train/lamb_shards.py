"""Where each original parameter lies in the flat tensors a DeepSpeed ZeRO optimizer hands its client optimizer, as
train/lamb.py's `Pieces`, so that LAMB's trust ratio is taken per parameter (FSDP2 needs none of this: its
parameters are DTensors, one per original parameter).

- ZeRO-1/2 (DeepSpeedZeroOptimizer) and ZeRO-1 under bf16 (BF16_Optimizer) hold one flat fp32 partition per
  parameter group and rank, cut across parameter boundaries; DeepSpeed itself records where each parameter's
  fragment of it lies (`param._hp_mapping`, what its universal checkpoints and `safe_get_full_fp32_param` read).
- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) holds per sub-group a flat of every parameter's own slice: parameter p of
  n elements is cut into ceil(n / world) per rank, rank r's from r x that, the last one padded.

ZeRO takes Lamb as a client optimizer because the Trainer sets "zero_allow_untested_optimizer" for any optimizer it
builds (transformers' deepspeed_optim_sched). Keys are the positions of the trainable parameters in
`engine.module.parameters()`, the same on every rank."""

from __future__ import annotations

import torch.distributed as dist

from disco_clip_ds.train.lamb import Pieces


def zero_pieces(engine) -> dict[int, Pieces]:
    """{id(flat tensor the client optimizer holds): its Pieces} for a DeepSpeed engine under ZeRO stage 1, 2 or 3."""
    zero = engine.optimizer
    if not hasattr(zero, "dp_process_group"):  # no ZeRO (stage 0): the optimizer holds the parameters themselves
        return {}
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    key_of = {id(p): key for key, p in enumerate(trainable)}
    group = zero.dp_process_group
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        pieces = _stage3(zero, key_of, dist.get_rank(group))
    else:
        pieces = _hp_mapped(zero, trainable, key_of)
    return {held: Pieces(tuple(found), len(trainable), group) for held, found in pieces.items()}


def _hp_mapped(zero, trainable: list, key_of: dict) -> dict[int, list]:
    """ZeRO-1/2: each parameter's fragment of its group's flat partition, from DeepSpeed's own record of it."""
    flats = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_groups_flat_partition
    pieces = {id(flat): [] for flat in flats}
    for param in trainable:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # no part of this parameter is in this rank's partition
            continue
        address = mapping.hp_fragment_address
        pieces[id(flats[mapping.param_group_index])].append((address.start, address.numel, key_of[id(param)]))
    return pieces


def _stage3(zero, key_of: dict, rank: int) -> dict[int, list]:
    """ZeRO-3: each parameter's own slice, in the order its sub-group's flat concatenates them."""
    pieces = {}
    for flat, params in zip(zero.fp32_partitioned_groups_flat, zero.fp16_groups):
        found, offset = [], 0
        for param in params:
            size = param.ds_tensor.ds_numel  # ceil(numel / world): this rank's slice, padding included
            valid = max(0, min(size, param.ds_numel - rank * size))
            if valid:
                found.append((offset, valid, key_of[id(param)]))
            offset += size
        pieces[id(flat)] = found
    return pieces
