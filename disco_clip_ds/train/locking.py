"""Locked towers (open_clip's --lock-image / --lock-text and their unlocked layers): which parameters of a CLIPModel
or SiglipModel train. A frozen parameter (requires_grad False) gets no gradient and no optimizer state: the
Trainer's optimizer, our per-tower groups (train/optim.py) and DeepSpeed's ZeRO optimizers all leave it out.

A locked tower is frozen whole with its projection; with --lock_{image,text}_tower_unlocked_layers N its last N
encoder layers and everything after them (the post-norm: CLIP's post_layernorm / final_layer_norm; SigLIP's
attention-pooling or linear head; CLIP's projection) train again, while what runs before the layers (embeddings,
CLIP's vision pre-LayerNorm) stays frozen. --lock_image_tower_freeze_norm keeps every LayerNorm of the vision tower
frozen (gains and biases), the unlocked layers' and the post-norm included: a ViT has no BatchNorm statistics for
open_clip's --lock-image-freeze-bn-stats to freeze, so its normalisation's learned affine parameters are what stays.
(open_clip's --lock-text-freeze-layer-norm is about the locked layers' LayerNorms, which here are always frozen.)
The flags' rules and refusals, and the planner's count of what trains: plan/trainable.py.
"""

from __future__ import annotations

from torch import nn

from disco_clip_ds.plan.trainable import TowerLock, tower_locks

# The modules of a tower (CLIP's and SigLIP's vision_model / text_model) that run before its first encoder layer:
# frozen in any locked tower, as open_clip's first group (patch embedding, positions, ln_pre) stays locked unless all
# of them are unlocked.
BEFORE_LAYERS = ("embeddings", "pre_layrnorm")
# CLIP's projections sit beside the towers; SigLIP's heads are inside them (`head`).
PROJECTIONS = {"vision": "visual_projection", "text": "text_projection"}


def lock_towers(model, model_args) -> None:
    """Freeze the towers `model_args` locks (--lock_image_tower, --lock_text_tower and their unlocked layers and
    norms) in a CLIPModel or SiglipModel, in place; logit_scale and logit_bias, shared by both towers, always train.
    The counts are checked beforehand against the model's config (train/validate/)."""
    for tower, lock in tower_locks(model_args).items():
        lock_tower(model, tower, lock)


def lock_tower(model, tower: str, lock: TowerLock) -> None:
    """Freeze `tower` ("vision" or "text") of `model` and its projection, then unlock its last `lock.unlocked_layers`
    encoder layers and what follows them; under `lock.freeze_norm` the tower's LayerNorms stay frozen."""
    encoder_tower = getattr(model, f"{tower}_model")
    projection = getattr(model, PROJECTIONS[tower], None)
    encoder_tower.requires_grad_(False)
    if projection is not None:
        projection.requires_grad_(False)
    if lock.unlocked_layers == 0:  # open_clip's unlocked groups 0: the whole tower
        return
    for name, child in encoder_tower.named_children():
        if name not in (*BEFORE_LAYERS, "encoder"):  # the post-norm and SigLIP's head follow the layers
            child.requires_grad_(True)
    layers = encoder_tower.encoder.layers
    for layer in layers[len(layers) - lock.unlocked_layers :]:
        layer.requires_grad_(True)
    if projection is not None:
        projection.requires_grad_(True)
    if lock.freeze_norm:
        for module in encoder_tower.modules():
            if isinstance(module, nn.LayerNorm):
                module.requires_grad_(False)
