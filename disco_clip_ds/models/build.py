"""A model by its config's model_type (MODEL_CLASSES): build_model (fresh or pretrained weights), from the config a
run's checks loaded (models/configs.py `load_config`, the one loader) or loading it."""

from __future__ import annotations

import copy

from disco_clip_ds.models.base import gather_attention_output_projections, init_seed
from disco_clip_ds.models.clip import DiscoCLIPModel
from disco_clip_ds.models.configs import load_config
from disco_clip_ds.models.resolution import gather_position_embedding, resize_position_embeddings
from disco_clip_ds.models.siglip import DiscoSiglipModel
from disco_clip_ds.models.siglip2 import DiscoSiglip2Model


def build_model(
    model_name_or_path: str | None = None,
    model_config: str | None = None,
    loss_impl: str = "tiled",
    chunk_size: int | None = None,
    seed: int | None = None,
    config=None,
    image_size: int | None = None,
) -> DiscoCLIPModel | DiscoSiglipModel | DiscoSiglip2Model:
    """A DiscoCLIPModel, DiscoSiglipModel or DiscoSiglip2Model (by the config's model_type) from pretrained weights
    (hub id or folder) or fresh from a config JSON file.

    A fresh weight (all of them, or those a checkpoint lacks) is drawn from `seed` and its name only (models/base.py
    `drawn_by_name`): the same under any ZeRO stage, world size or device. None: torch.initial_seed(), the seed that
    transformers' set_seed (a run's --seed) last set.

    `config`: the model's config as already loaded (a run's `CheckedRun.config`), copied, not loaded again.
    `image_size`: a square-image model's side when it differs from its config's (the last stage of a progressive
    resolution schedule): its position embeddings are resized to it once, here (models/resolution.py). Under ZeRO-3
    the position embedding's weight and a pooling attention's output projection are gathered with the module whose
    forward reads them (`gather_position_embedding`, `gather_attention_output_projections`)."""
    if bool(model_name_or_path) == bool(model_config):
        raise ValueError("give exactly one of model_name_or_path (pretrained weights) or model_config (a config JSON)")
    # a copy: the loss settings below must not change the caller's config
    config = load_config(model_name_or_path, model_config) if config is None else copy.deepcopy(config)
    model_class = MODEL_CLASSES.get(config.model_type)
    if model_class is None:
        raise ValueError(f"model_type {config.model_type!r} is not one of {sorted(MODEL_CLASSES)}")
    config.loss_impl, config.chunk_size = loss_impl, chunk_size
    with init_seed(seed):
        if model_name_or_path:
            model = model_class.from_pretrained(model_name_or_path, config=config)
        else:
            model = model_class(config)
    if image_size is not None and config.model_type != "siglip2":
        resize_position_embeddings(model, image_size)
    gather_position_embedding(model)  # under ZeRO-3: with the embeddings module that reads it
    gather_attention_output_projections(model)  # and SigLIP's pooling attention's output projection with it
    return model


MODEL_CLASSES = {"clip": DiscoCLIPModel, "siglip": DiscoSiglipModel, "siglip2": DiscoSiglip2Model}
__all__ = ["MODEL_CLASSES", "build_model", "load_config"]
