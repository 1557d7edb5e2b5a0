"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") with timm's update rule, and its trust
ratio taken per ORIGINAL parameter tensor however the optimizer's tensors are sharded.

The update is timm's `timm.optim.Lamb` (1.0, its single-tensor path, at its defaults: bias correction, gradient
averaging, weight decay added to the update, the trust ratio ||w|| / ||update|| applied where a group decays, 1
where either norm is 0), so a run is the optimizer PE, EVA-CLIP and timm train with. timm itself is not a dependency:
its package imports torchvision at import time, which would pull a CUDA torch; tests/unit/train/test_lamb.py
compares this optimizer with timm's own file (`disco_clip_ds.testing.timm_reference`).

Why not timm's class as is: the trust ratio needs the norms of a whole parameter. Under DeepSpeed ZeRO-1/2 the
optimizer holds one flat fp32 partition per parameter group and rank, cut across parameter boundaries; under ZeRO-3
a flat of every parameter's slice; under FSDP2 each parameter's dim-0 shard (a DTensor). timm's Lamb on any of those
takes a norm per partition or shard: another optimizer, whose result changes with the number of ranks. Here each
held tensor is described by its `Pieces` (which stretch of it belongs to which original parameter); each rank sums
the squares of its pieces per parameter, one all_reduce per step call adds them over the ranks, and every piece is
updated with its parameter's ratio. Elementwise, everything else is the same on a shard as on the whole tensor.

Memory: the two moments per parameter, as Adam (`disco-clip plan` counts them alike); the update is computed twice
(once for its norm, once to apply it) rather than kept, so no buffer beyond AdamW's per-tensor temporaries.
Global gradient-norm clipping is left to the Trainer / DeepSpeed (--max_grad_norm), which clip across shards;
timm's optimizer-internal clipping (max_grad_norm=1.0 there) would clip per shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Pieces:
    """Which stretches of a held (flattened) tensor belong to which original parameter: (start, numel, key) each,
    `key` an index below `num_keys`; `group`: the process group over which the pieces of one key are summed.
    Every rank describes its held tensors with the same `num_keys` and group, so the sums line up."""

    pieces: tuple[tuple[int, int, int], ...]
    num_keys: int
    group: object = None


class Lamb(torch.optim.Optimizer):
    """timm's Lamb with per-parameter trust ratios under sharding (module docstring).

    `layout`: None, or a callable returning {id(held tensor): Pieces}, called once at the first step (when the
    wrapper that flattened the optimizer's parameters exists: `train.lamb_shards.zero_pieces`). A held tensor the
    layout does not name is a whole parameter, or, a DTensor, one parameter's shard over its mesh."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        trust_clip: bool = False,
        always_adapt: bool = False,
        layout: Callable[[], dict[int, Pieces]] | None = None,
    ):
        if not (0.0 <= lr and 0.0 <= eps and 0.0 <= weight_decay and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"Lamb: invalid lr {lr}, betas {betas}, eps {eps} or weight_decay {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
        )
        super().__init__(params, defaults)
        self.layout = layout
        self._pieces: dict[int, Pieces] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pieces is None:
            self._pieces = self.layout() if self.layout is not None else {}
        held = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, group in held:
            self._moments(p, group)
        sums = {}  # process group -> [num_keys, 2] sums of squares (weights, update)
        where = [self._square_sums(p, group, sums) for p, group in held]
        # one collective per process group (one in all) per step call, and one host read of the ratios
        ratios = {pg: _trust_ratios(_all_reduced(table, pg)).tolist() for pg, table in sums.items()}
        for (p, group), pieces in zip(held, where):
            self._apply(p, group, None if pieces is None else ratios[pieces.group], pieces)
        return loss

    def _moments(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = (_local(t) for t in (p.grad, state["exp_avg"], state["exp_avg_sq"]))
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """timm's update of `p` (its local part) from the moments already advanced this step."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        step = state["step"].item()
        bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
        denom = (_local(state["exp_avg_sq"]).sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
        update = (_local(state["exp_avg"]) / bias_correction1).div_(denom)
        if group["weight_decay"] != 0:
            update.add_(_local(p), alpha=group["weight_decay"])
        return update

    def _square_sums(self, p: torch.Tensor, group: dict, sums: dict) -> Pieces | None:
        """Add the squares of `p`'s pieces (weights and update) to their keys' rows in `sums`; `p`'s Pieces, or
        None where the group takes no trust ratio (timm: where it does not decay, unless always_adapt)."""
        if not (group["weight_decay"] != 0 or group["always_adapt"]):
            return None
        pieces = self._pieces.get(id(p)) or _own_pieces(p, sums)
        weights, update = _local(p).reshape(-1), self._update(p, group).reshape(-1)
        table = sums.get(pieces.group)
        if table is None or table.shape[0] < pieces.num_keys:
            grown = torch.zeros(pieces.num_keys, 2, dtype=torch.float32, device=weights.device)
            if table is not None:
                grown[: table.shape[0]] = table
            table = sums[pieces.group] = grown
        for start, numel, key in pieces.pieces:
            table[key, 0] += weights.narrow(0, start, numel).float().square().sum()
            table[key, 1] += update.narrow(0, start, numel).float().square().sum()
        return pieces

    def _apply(self, p: torch.Tensor, group: dict, ratios: list[float] | None, pieces: Pieces | None) -> None:
        update, weights = self._update(p, group).reshape(-1), _local(p).reshape(-1)
        if pieces is None:
            weights.add_(update, alpha=-group["lr"])
            return
        for start, numel, key in pieces.pieces:
            ratio = min(ratios[key], 1.0) if group["trust_clip"] else ratios[key]  # LAMBC's clip
            weights.narrow(0, start, numel).add_(update.narrow(0, start, numel), alpha=-group["lr"] * ratio)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard (a view: in-place changes reach the DTensor), else itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _own_pieces(p: torch.Tensor, sums: dict) -> Pieces:
    """A whole parameter, or a DTensor's shard: one piece with the next key of its process group (every rank holds
    the same DTensors in the same order, so the keys agree)."""
    group = _shard_group(p)
    key = sums[group].shape[0] if group in sums else 0
    return Pieces(((0, _local(p).numel(), key),), key + 1, group)


def _shard_group(p: torch.Tensor):
    """The process group over which a DTensor parameter's shards add up to the whole: its mesh's group where it is
    sharded (FSDP2: Shard(0) on a 1-D mesh); None for a plain tensor or a replicated DTensor."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return None
    sharded = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    if len(sharded) > 1:
        raise NotImplementedError("Lamb: a parameter sharded over more than one mesh dimension")
    return p.device_mesh.get_group(sharded[0]) if sharded else None


def _all_reduced(table: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(table, group=group)
    return table


def _trust_ratios(table: torch.Tensor) -> torch.Tensor:
    """||w|| / ||update|| per key from the summed squares; 1 where either norm is 0 (timm's `_lamb_trust_ratio`)."""
    weight_norm, update_norm = table[:, 0].sqrt(), table[:, 1].sqrt()
    ratio = weight_norm / update_norm
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))
