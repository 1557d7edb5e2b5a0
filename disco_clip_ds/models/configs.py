"""The model types this package trains, and the one loader of their configs.

`MODEL_TYPES` maps a config's model_type to the transformers config and model classes (named, imported on first use:
`disco-clip plan` answers bad arguments before importing transformers). The model builder (models/build.py), the
planner (plan/memory.py) and training's argument checks (train/validate/) all read it.
"""

from __future__ import annotations

import json
from pathlib import Path

from disco_clip_ds.texts import read_text

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

        config = AutoConfig.from_pretrained(model_name_or_path)
    else:
        path = Path(model_config)
        if not path.is_file():
            raise FileNotFoundError(f"model config {path} not found (e.g. recipes/models/tiny.json)")
        model_type = json.loads(read_text(path, "model config")).get("model_type", "clip")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{path}: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        try:
            config = config_class(model_type).from_json_file(str(path))
        except ValueError:
            raise
        except Exception as error:  # transformers' strict dataclass validation (not a ValueError): on one line
            raise ValueError(f"{path}: {' '.join(str(error).split())}") from error
    problem = config_problem(config) if config.model_type in MODEL_TYPES else None
    if problem:
        raise ValueError(problem)
    return config


# The sizes a tower needs positive (whole numbers): a 0 or negative one builds a model that fails inside its first
# forward, or allocates nothing where the planner counts something.
TOWER_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_problem(config) -> str | None:
    """What makes a CLIP/SigLIP/SigLIP 2 config unbuildable or untrainable, in one clause naming the field and a
    fix, or None: sizes that are not positive whole numbers, heads that do not divide the width, a patch of 0 or
    larger than the image, a projection of 0, a logit scale or bias that is not finite. For `plan` and `train`
    alike (both load configs here), before any model is built."""
    import math

    for name in ("text_config", "vision_config"):
        tower = getattr(config, name)
        for field in TOWER_SIZES + (("vocab_size", "max_position_embeddings") if name == "text_config" else ()):
            value = getattr(tower, field, 1)  # a field the config class has not is not checked
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"{name}.{field} {value!r}: give a positive whole number"
        if tower.hidden_size % tower.num_attention_heads:
            return (
                f"{name}.num_attention_heads {tower.num_attention_heads} does not divide hidden_size "
                f"{tower.hidden_size}: choose heads that divide the width (e.g. hidden_size / 64)"
            )
    vision = config.vision_config
    patch, image = getattr(vision, "patch_size", None), getattr(vision, "image_size", None)
    if not isinstance(patch, int) or isinstance(patch, bool) or patch < 1:
        return f"vision_config.patch_size {patch!r}: give a positive whole number"
    if config.model_type != "siglip2" and (not isinstance(image, int) or image < patch):
        return f"vision_config.image_size {image!r}: give a whole number at least the patch size {patch}"
    projection = getattr(config, "projection_dim", 1)
    if isinstance(projection, bool) or not isinstance(projection, int) or projection < 1:
        return f"projection_dim {projection!r}: give a positive whole number"
    for field in ("logit_scale_init_value", "logit_scale", "logit_bias"):
        value = getattr(config, field, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{field} {value!r}: give a finite number"
    return None
