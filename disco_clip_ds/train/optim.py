"""Where the optimizer set-up follows OpenCLIP rather than the Trainer's defaults: weight-decay groups and warmup;
and EVA-CLIP's per-tower learning rates and layer-wise decay, which neither the Trainer nor DeepSpeed offers.

Torch only, so that bench/vs_open_clip/same_batches.py can run these exact rules beside open_clip in its own virtualenv.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

NO_DECAY = ("logit_scale", "class_embedding")  # 0/1-dim CLIP parameters the Trainer's stock list would decay


def without_clip_no_decay(names: list[str]) -> list[str]:
    """The Trainer's decay list (no LayerNorm gains, no biases) minus logit_scale and the class embedding: OpenCLIP's
    set (`open_clip_train/main.py` excludes parameters with ndim < 2, gains, biases and logit_scale)."""
    return [n for n in names if not any(part in n for part in NO_DECAY)]


# A tower's parameters, by name, in CLIPModel and SiglipModel (SigLIP's heads live inside vision_model/text_model).
# Wrappers may prefix the names (FSDP, compile), so each pattern is matched after a dot or at the start.
TOWER_PREFIXES = {"vision": ("vision_model.", "visual_projection."), "text": ("text_model.", "text_projection.")}
_ENCODER_LAYER = re.compile(r"(?:^|\.)(?:vision|text)_model\.encoder\.layers\.(\d+)\.")
# What runs before the first encoder layer: the embeddings, and CLIP's vision pre-LayerNorm
_BEFORE_LAYERS = re.compile(r"(?:^|\.)(?:vision|text)_model\.(?:embeddings|pre_layrnorm)\.")


@dataclass(frozen=True)
class TowerRates:
    """One tower's optimizer settings: its base learning rate and weight decay, its layer decay and depth."""

    lr: float
    weight_decay: float
    layer_decay: float
    num_layers: int


def tower_of(name: str) -> str | None:
    """'vision', 'text' or None (logit_scale, logit_bias: shared by both towers)."""
    for tower, prefixes in TOWER_PREFIXES.items():
        if any(name.startswith(p) or f".{p}" in name for p in prefixes):
            return tower
    return None


def layer_scale(name: str, rates: TowerRates) -> float:
    """EVA-CLIP's layer-wise decay of a tower parameter's learning rate: encoder layer l (from 0) of L gets
    decay^(L - l), the embeddings decay^(L + 1), what follows the last layer (final norm, head, projection) 1."""
    layer = _ENCODER_LAYER.search(name)
    if layer:
        return rates.layer_decay ** (rates.num_layers - int(layer.group(1)))
    if _BEFORE_LAYERS.search(name):
        return rates.layer_decay ** (rates.num_layers + 1)
    return 1.0


def tower_rates(args, config) -> dict[str, TowerRates]:
    """{tower: its TowerRates} for each tower whose --{tower}_lr, --{tower}_weight_decay or --{tower}_layer_decay
    is set (`args`: DiscoTrainingArguments; `config`: the model's CLIPConfig or SiglipConfig); {} when none is, so
    that the Trainer's own groups stay."""
    rates = {}
    for tower in TOWER_PREFIXES:
        lr, wd, decay = (getattr(args, f"{tower}_{what}") for what in ("lr", "weight_decay", "layer_decay"))
        if lr is not None or wd is not None or decay != 1.0:
            layers = getattr(config, f"{tower}_config").num_hidden_layers
            rates[tower] = TowerRates(
                args.learning_rate if lr is None else lr, args.weight_decay if wd is None else wd, decay, layers
            )
    return rates


def parameter_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    decay_names: set[str],
    lr: float,
    weight_decay: float,
    towers: dict[str, TowerRates],
) -> list[dict]:
    """Optimizer parameter groups, one per tower layer scale and decay: a tower's parameters at its rate times
    their layer scale and at its weight decay, parameters outside `decay_names` at no weight decay, the shared ones
    (logit_scale, logit_bias) at `lr`. Frozen parameters are left out, as the Trainer does. Each group's lr is its
    own, so a schedule (LambdaLR) scales every group alike."""
    # keyed by where a parameter sits, not by its rate: the groups, and so a checkpoint's optimizer state, stay the
    # same whatever the values
    groups: dict[tuple, dict] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        tower_name = tower_of(name)
        tower, decays = towers.get(tower_name), name in decay_names
        scale = layer_scale(name, tower) if tower else 1.0
        key = (tower_name if tower else None, scale, decays)
        if key not in groups:
            group_lr = tower.lr * scale if tower else lr
            group_wd = (tower.weight_decay if tower else weight_decay) if decays else 0.0
            groups[key] = {"params": [], "lr": group_lr, "weight_decay": group_wd}
        groups[key]["params"].append(param)
    return list(groups.values())


def warmup_from_first_step(scheduler: LambdaLR, warmup: int) -> LambdaLR:
    """The same schedule with its linear warmup one step earlier: step s < warmup gets lr * (s + 1) / warmup.

    transformers' warmups give step s the factor s / warmup, so the first optimizer step runs at lr 0 and is lost.
    OpenCLIP's (`open_clip_train/scheduler.py`, `_warmup_lr`) starts at lr / warmup and reaches the full lr at step
    warmup - 1; from step `warmup` on both are the same (bench/vs_open_clip/same_batches.py measures
    what the lost step costs)."""
    shifted = [lambda step, f=f: f(step + 1) if step < warmup else f(step) for f in scheduler.lr_lambdas]
    # last_epoch - 1: the constructor steps once, back to where the stock scheduler stands
    shifted_scheduler = LambdaLR(scheduler.optimizer, shifted, last_epoch=scheduler.last_epoch - 1)
    shifted_scheduler.warmup = warmup
    return shifted_scheduler
