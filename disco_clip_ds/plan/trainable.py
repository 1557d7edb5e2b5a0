"""Locked towers, as `disco-clip train` and `disco-clip plan` read the flags: --lock_image_tower / --lock_text_tower,
--lock_{image,text}_tower_unlocked_layers N and --lock_image_tower_freeze_norm (`tower_locks`), the refusals of
combinations that cannot mean anything (`lock_problem`, shared by both commands), and the parameters that train
(`trainable_numels`), for which the planner counts gradients and optimizer state.

A locked tower is frozen with its projection, except its last N encoder layers and everything after them (post-norm,
SigLIP's head, CLIP's projection); N = 0 freezes it whole (open_clip's unlocked groups 0). train/locking.py freezes
the modules; the count here reads the parameters' names, so that the two can be checked against each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# tower -> its locking flag (without "--"); the unlocked-layers flag is that name + "_unlocked_layers"
LOCK_FLAGS = {"vision": "lock_image_tower", "text": "lock_text_tower"}
FREEZE_NORM_FLAG = "lock_image_tower_freeze_norm"  # the vision tower's only: open_clip's --lock-image-freeze-bn-stats
LOCK_ARGUMENTS = (*LOCK_FLAGS.values(), *(f"{flag}_unlocked_layers" for flag in LOCK_FLAGS.values()), FREEZE_NORM_FLAG)
# A tower's parameters by name (CLIPModel, SiglipModel): its encoder's, and CLIP's projection beside it.
_TOWER_PREFIX = {"vision": ("vision_model.", "visual_projection."), "text": ("text_model.", "text_projection.")}


@dataclass(frozen=True)
class TowerLock:
    """How a locked tower is locked: its last `unlocked_layers` encoder layers (and what follows them) train (0: none,
    the whole tower is frozen); `freeze_norm`: its LayerNorms stay frozen even there."""

    unlocked_layers: int = 0
    freeze_norm: bool = False


def tower_locks(args) -> dict[str, TowerLock]:
    """{"vision" | "text": its TowerLock} for each tower the flags lock (`args`: train's ModelArguments or plan's
    parsed arguments, which name them alike; an unset count is 0)."""
    return {
        tower: TowerLock(
            getattr(args, f"{flag}_unlocked_layers", None) or 0,
            tower == "vision" and bool(getattr(args, FREEZE_NORM_FLAG, False)),
        )
        for tower, flag in LOCK_FLAGS.items()
        if getattr(args, flag, False)
    }


def lock_problem(args, config) -> str | None:
    """What is wrong with the locking flags of `args` for a model of `config` (CLIPConfig or SiglipConfig), as one
    line naming the fix; None when nothing is."""
    for tower, flag in LOCK_FLAGS.items():
        unlocked = getattr(args, f"{flag}_unlocked_layers", None)
        if unlocked is None:
            continue
        layers = getattr(config, f"{tower}_config").num_hidden_layers
        if not getattr(args, flag, False):
            return f"--{flag}_unlocked_layers {unlocked} says how much of a locked tower trains: add --{flag}"
        if not 0 <= unlocked <= layers:
            return (
                f"--{flag}_unlocked_layers {unlocked}: the {tower} tower has {layers} encoder layers: give 0 (the "
                f"whole tower frozen) to {layers} (only the embeddings frozen)"
            )
    if getattr(args, FREEZE_NORM_FLAG, False) and not tower_locks(args).get("vision", TowerLock()).unlocked_layers:
        return (
            f"--{FREEZE_NORM_FLAG} keeps the LayerNorms of the vision tower's unlocked layers frozen: it needs "
            "--lock_image_tower --lock_image_tower_unlocked_layers N with N >= 1 (a locked tower is frozen whole)"
        )
    return None


def trainable_numels(model, locks: dict[str, TowerLock]) -> list[int]:
    """The sizes of the parameters of `model` (a CLIPModel or SiglipModel, e.g. on the meta device) that train
    under `locks`; logit_scale and logit_bias always do."""
    from torch import nn

    norms = {
        f"{module_name}.{name}"
        for module_name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm)
        for name, _ in module.named_parameters(recurse=False)
    }
    layers = {tower: getattr(model.config, f"{tower}_config").num_hidden_layers for tower in locks}
    return [param.numel() for name, param in model.named_parameters() if _trains(name, locks, layers, name in norms)]


def _trains(name: str, locks: dict[str, TowerLock], layers: dict[str, int], is_norm: bool) -> bool:
    tower = next((t for t, prefixes in _TOWER_PREFIX.items() if name.startswith(prefixes)), None)
    lock = locks.get(tower)
    if lock is None:  # an unlocked tower, logit_scale, logit_bias
        return True
    if lock.unlocked_layers == 0 or (lock.freeze_norm and is_norm):
        return False
    layer = re.match(rf"{tower}_model\.encoder\.layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)) >= layers[tower] - lock.unlocked_layers
    # before the layers: the embeddings and CLIP's vision pre-LayerNorm; after them: post-norm, head, projection
    return re.match(rf"{tower}_model\.(embeddings|pre_layrnorm)\.", name) is None
