"""FLIP's patch dropout (Li et al., CVPR 2023), keyed by sample: the image tower sees a random subset of its patch
tokens in training, drawn per sample from (seed, the sample's key, its pass) rather than from a global generator.

The data stream draws each sample's kept patches (`draw_kept_patches`) with the sample's own RNG, as it draws its
crop, and the batch carries them (`PATCHES_KEY`); the model's forward keeps those tokens only (`keep_tokens`, after
the position embeddings, the class token always kept). A sample's mask then does not depend on the rank, the
micro-batch or the DataLoader worker that handles it, so contrastive accumulation's two passes over a micro-batch
see the same mask, K x b stays one batch of K x b, world size and K stay interchangeable, and a resumed run draws
what the uninterrupted one drew. open_clip's PatchDropout draws from torch's global generator at every call.

Under a --resolution_schedule (models/resolution.py) a sample's patch grid is the step's, which only the step knows:
the stream draws each sample's kept patches for every stage's grid, the last one's under PATCHES_KEY and each
earlier one's under `stage_key` (all from the sample's own RNG), and the trainer keeps the step's grid's
(`at_grid`) before the step runs. A sample's mask at a step is then a function of the sample and the step alone.
"""

from __future__ import annotations

import contextlib
import random

import torch
from torch import nn

# The batch key of the kept patches' indices: (batch, kept) int64, each row sorted, patch 0 the top-left one.
PATCHES_KEY = "patch_keep"


def kept_patches(num_patches: int, dropout: float) -> int:
    """How many of `num_patches` patch tokens a sample keeps at dropout rate `dropout` (open_clip's count)."""
    return max(1, int(num_patches * (1 - dropout)))


def patch_counts(vision_config, dropout: float) -> tuple[int, int] | None:
    """(patches per image, patches kept) of an image tower at dropout rate `dropout`; None when it is 0 (off)."""
    if dropout == 0:
        return None
    num_patches = (vision_config.image_size // vision_config.patch_size) ** 2
    return num_patches, kept_patches(num_patches, dropout)


def stage_patch_counts(vision_config, dropout: float, sides) -> tuple[tuple[int, int], ...]:
    """(patches per image, patches kept) at each image side of `sides` (a --resolution_schedule's stages) other than
    the tower's own (its config's, the last stage's): () when `dropout` is 0 (off)."""
    if dropout == 0:
        return ()
    grids = [(side // vision_config.patch_size) ** 2 for side in sides if side != vision_config.image_size]
    return tuple((n, kept_patches(n, dropout)) for n in grids)


def stage_key(num_patches: int) -> str:
    """The batch key of the kept patches drawn for an earlier stage's grid of `num_patches` patches."""
    return f"{PATCHES_KEY}@{num_patches}"


def draw_kept_patches(num_patches: int, kept: int, rng: random.Random) -> torch.Tensor:
    """`kept` distinct patch indices out of `num_patches`, sorted, drawn with `rng` (the sample's own)."""
    return torch.tensor(sorted(rng.sample(range(num_patches), kept)), dtype=torch.int64)


def draw_sample_patches(patches: tuple[int, int], stages: tuple[tuple[int, int], ...], rng: random.Random):
    """A sample's kept patches: at the tower's grid (`patches`: patches, kept), a tensor; with a schedule's earlier
    grids (`stages`), {PATCHES_KEY: the tower's grid's, stage_key(n): each earlier grid's}, drawn in that order from
    `rng` (the tower's grid first: its mask is the one a run without a schedule draws)."""
    kept = draw_kept_patches(*patches, rng)
    if not stages:
        return kept
    return {PATCHES_KEY: kept, **{stage_key(n): draw_kept_patches(n, k, rng) for n, k in stages}}


def at_grid(batch: dict, num_patches: int | None) -> None:
    """`batch` (in place) with the kept patches of the grid of `num_patches` patches (a step's, under a schedule) under
    PATCHES_KEY and no other grid's; None: no kept patches at all (FLIP's unmasked tuning)."""
    stages = {key: batch.pop(key) for key in [k for k in batch if k.startswith(f"{PATCHES_KEY}@")]}
    if num_patches is None:
        batch.pop(PATCHES_KEY, None)
    elif stage_key(num_patches) in stages:
        batch[PATCHES_KEY] = stages[stage_key(num_patches)]


def keep_tokens(hidden: torch.Tensor, keep: torch.Tensor, class_tokens: int) -> torch.Tensor:
    """The tokens of `hidden` (batch, class_tokens + patches, width) a sample keeps: its `class_tokens` leading
    ones, then the patches whose indices its row of `keep` (batch, kept) names."""
    patches = hidden[:, class_tokens:]
    index = keep.to(hidden.device).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return torch.cat((hidden[:, :class_tokens], patches.gather(1, index)), dim=1)


class PatchDropout:
    """Applies a batch's kept patches to an image tower: a forward hook on the tower's embeddings module (whose
    output has the position embeddings added) keeps the tokens named by the indices set with `kept(...)`.

    Outside `kept(...)` (evaluation, export, a batch without indices) the tower runs as the plain transformers
    model; the hook holds no parameter and no config entry, so a saved model has no trace of it."""

    def __init__(self, embeddings: nn.Module, class_tokens: int):
        self.class_tokens, self._keep = class_tokens, None
        embeddings.register_forward_hook(self._hook)

    @contextlib.contextmanager
    def kept(self, keep: torch.Tensor | None):
        """While inside, the tower keeps the patches `keep` (batch, kept) names; None: all of them."""
        self._keep = keep
        try:
            yield
        finally:
            self._keep = None

    def _hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        if self._keep is None:
            return None
        if self._keep.shape[0] != output.shape[0]:
            raise ValueError(f"{PATCHES_KEY} holds {self._keep.shape[0]} rows for a batch of {output.shape[0]} images")
        return keep_tokens(output, self._keep, self.class_tokens)
