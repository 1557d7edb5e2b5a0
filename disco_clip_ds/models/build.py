"""A model by its config's model_type (MODEL_CLASSES): build_model (fresh or pretrained weights), load_config (the
CLIPConfig, SiglipConfig or Siglip2Config of pretrained weights or of a config JSON file)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, CLIPConfig, Siglip2Config, SiglipConfig

from disco_clip_ds.models.base import init_seed
from disco_clip_ds.models.clip import DiscoCLIPModel
from disco_clip_ds.models.siglip import DiscoSiglipModel
from disco_clip_ds.models.siglip2 import DiscoSiglip2Model


def build_model(
    model_name_or_path: str | None = None,
    model_config: str | None = None,
    loss_impl: str = "tiled",
    chunk_size: int | None = None,
    seed: int | None = None,
) -> DiscoCLIPModel | DiscoSiglipModel | DiscoSiglip2Model:
    """A DiscoCLIPModel, DiscoSiglipModel or DiscoSiglip2Model (by the config's model_type) from pretrained weights
    (hub id or folder) or fresh from a config JSON file.

    A fresh weight (all of them, or those a checkpoint lacks) is drawn from `seed` and its name only (models/base.py
    `drawn_by_name`): the same under any ZeRO stage, world size or device. None: torch.initial_seed(), the seed that
    transformers' set_seed (a run's --seed) last set."""
    if bool(model_name_or_path) == bool(model_config):
        raise ValueError("give exactly one of model_name_or_path (pretrained weights) or model_config (a config JSON)")
    config = load_config(model_name_or_path, model_config)
    model_class = MODEL_CLASSES.get(config.model_type)
    if model_class is None:
        raise ValueError(f"model_type {config.model_type!r} is not one of {sorted(MODEL_CLASSES)}")
    config.loss_impl, config.chunk_size = loss_impl, chunk_size
    with init_seed(seed):
        if model_name_or_path:
            return model_class.from_pretrained(model_name_or_path, config=config)
        return model_class(config)


MODEL_CLASSES = {"clip": DiscoCLIPModel, "siglip": DiscoSiglipModel, "siglip2": DiscoSiglip2Model}
CONFIG_CLASSES = {"clip": CLIPConfig, "siglip": SiglipConfig, "siglip2": Siglip2Config}


def load_config(model_name_or_path: str | None = None, model_config: str | None = None):
    """The CLIPConfig, SiglipConfig or Siglip2Config of pretrained weights (hub id or folder) or of a config JSON
    file."""
    if model_name_or_path:
        return AutoConfig.from_pretrained(model_name_or_path)
    path = Path(model_config)
    if not path.is_file():
        raise FileNotFoundError(f"model config {path} not found (e.g. recipes/models/tiny.json)")
    return _config_from_json(path)


def _config_from_json(path: Path):
    model_type = json.loads(path.read_text()).get("model_type", "clip")  # a CLIPConfig JSON may omit it
    config_class = CONFIG_CLASSES.get(model_type)
    if config_class is None:
        raise ValueError(f"{path}: model_type {model_type!r} is not one of {', '.join(CONFIG_CLASSES)}")
    return config_class.from_json_file(str(path))
