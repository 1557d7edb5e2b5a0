"""The model types this package trains, and the one loader of their configs.

`MODEL_TYPES` maps a config's model_type to the transformers config and model classes (named, imported on first use:
`disco-clip plan` answers bad arguments before importing transformers). The model builder (models/build.py), the
planner (plan/memory.py) and training's argument checks (train/validate/) all read it.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type -> (the transformers config class, the plain transformers model class)
MODEL_TYPES = {
    "clip": ("CLIPConfig", "CLIPModel"),
    "siglip": ("SiglipConfig", "SiglipModel"),
    "siglip2": ("Siglip2Config", "Siglip2Model"),
}


def config_class(model_type: str):
    """The transformers config class of `model_type` (a ValueError naming the types for any other)."""
    return _transformers_class(model_type, 0)


def plain_model_class(model_type: str):
    """The transformers model class of `model_type` (CLIPModel, SiglipModel, Siglip2Model)."""
    return _transformers_class(model_type, 1)


def _transformers_class(model_type: str, which: int):
    import transformers

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    return getattr(transformers, MODEL_TYPES[model_type][which])


def load_config(model_name_or_path: str | None = None, model_config: str | None = None):
    """The CLIPConfig, SiglipConfig or Siglip2Config of pretrained weights (hub id or folder: AutoConfig, whatever
    its model_type) or of a config JSON file (one of MODEL_TYPES; a CLIPConfig JSON may omit its model_type)."""
    if model_name_or_path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_name_or_path)
    path = Path(model_config)
    if not path.is_file():
        raise FileNotFoundError(f"model config {path} not found (e.g. recipes/models/tiny.json)")
    model_type = json.loads(path.read_text()).get("model_type", "clip")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    return config_class(model_type).from_json_file(str(path))
