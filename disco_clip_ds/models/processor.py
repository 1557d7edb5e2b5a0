"""The tokenizer and processor saved with a model, written so that transformers' Auto classes load back what the run
trained with: `AutoTokenizer`, `AutoProcessor` and the zero-shot pipeline on a saved or exported folder give the
training tokenizer's ids, and a SigLIP 2 processor's call gives the run's patch size and budget.

Two rules of transformers (5.x) stand in the way, each written into the folder's tokenizer_config.json:

- AutoTokenizer ignores tokenizer_config.json's `tokenizer_class` for the model types it lists in
  `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` (siglip2 among them) and loads the model type's own tokenizer: a
  SigLIP 2 trained with a CLIP-style BPE reloads as Siglip2Tokenizer (Gemma's rules, other ids). For those types, and
  only when the class differs, the file also names the class in `auto_map`. AutoTokenizer then skips the model
  type's override and, as the entry is not remote code it may run (no `trust_remote_code`), loads the class
  `tokenizer_class` names. The gate reads transformers' own list, so a release that drops siglip2 from it gets no
  `auto_map`; tests/unit/models/test_processor.py shows that the installed release still needs it.
- Siglip2Processor's call fills `max_num_patches` 256 and `patch_size` 16 from class defaults, over its image
  processor's own settings. The processor's documented order lets a tokenizer's init kwargs (tokenizer_config.json)
  override those defaults: the run's budget and patch size are written there.
"""

from __future__ import annotations

import json
from pathlib import Path

NAFLEX_KEYS = ("max_num_patches", "patch_size")  # Siglip2Processor's image defaults that hide the image processor's
# how the tokenizer was loaded, which transformers 5 keeps in its init kwargs and so writes to tokenizer_config.json:
# facts of the machine that saved it, which a copy elsewhere (or on the hub) would load with as settings
LOAD_KEYS = ("is_local", "local_files_only")


def _auto_overrides(model_type: str, class_name: str) -> bool:
    """Whether AutoTokenizer on a `model_type` folder loads another class than `class_name` whatever
    tokenizer_config.json says (transformers' list of model types whose hub tokenizer class it distrusts)."""
    from transformers.models.auto import tokenization_auto as auto

    registered = (auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast")
    distrusted = getattr(auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", ())
    return model_type in distrusted and bool(registered) and registered != class_name.removesuffix("Fast")


def pin_tokenizer(tokenizer, model_type: str, image_processor=None):
    """`tokenizer`, its init kwargs (what `save_pretrained` writes to tokenizer_config.json) set so that the Auto
    classes load it back as it is (module docstring); for SigLIP 2, with `image_processor`'s patch size and budget;
    without the LOAD_KEYS of the load it came from. Tokenizing is unchanged."""
    name = type(tokenizer).__name__
    for key in LOAD_KEYS:
        tokenizer.init_kwargs.pop(key, None)
    if _auto_overrides(model_type, name):
        tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": [None, name]}
    if model_type == "siglip2" and image_processor is not None:
        tokenizer.init_kwargs.update({key: getattr(image_processor, key) for key in NAFLEX_KEYS})
    return tokenizer


def pin_processor(processor, model_type: str):
    """`processor` with its tokenizer pinned (`pin_tokenizer`) to its image processor."""
    pin_tokenizer(processor.tokenizer, model_type, getattr(processor, "image_processor", None))
    return processor


def declared_tokenizer_class(folder: str | Path) -> str | None:
    """The class a saved folder's tokenizer_config.json names (None: none, or no such file)."""
    try:
        return json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_saved_tokenizer(folder: str | Path):
    """The tokenizer saved in `folder`, as the class its tokenizer_config.json names (a folder saved before the pin
    reloads through AutoTokenizer as another class), else as AutoTokenizer loads it."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = declared_tokenizer_class(folder)
    cls = tokenizer_class_from_name(name) if name else None
    return (cls or AutoTokenizer).from_pretrained(folder)


def at_image_size(image_processor, side: int | None):
    """A pretrained model's image processor set to resize and crop to `side` (the run's last side), as its saved
    model takes it; unchanged when `side` is None or it already does. Its other settings (mean, std, resample) stay."""
    crop = getattr(image_processor, "crop_size", None) or {}
    size = getattr(image_processor, "size", None) or {}
    if side is None or (crop.get("height", side) == side and side in (size.get("shortest_edge"), size.get("height"))):
        return image_processor
    if "shortest_edge" in size:
        image_processor.size = {"shortest_edge": side}
    else:
        image_processor.size = {"height": side, "width": side}
    if crop:
        image_processor.crop_size = {"height": side, "width": side}
    return image_processor
