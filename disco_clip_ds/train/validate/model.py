"""The model: its source (--model_name_or_path or --model_config), its config loaded once (`load_student_config`),
the tokenizer and the sizes against that config (--max_text_length, --image_size, SigLIP 2's --max_num_patches),
the towers' embedding sizes, and the locking flags."""

from __future__ import annotations

import logging
import os

from transformers import AutoTokenizer

from disco_clip_ds.checkpoint.layout import verify_model_folder
from disco_clip_ds.data.naflex import DEFAULT_MAX_NUM_PATCHES
from disco_clip_ds.errors import UsageError
from disco_clip_ds.models import source as model_source
from disco_clip_ds.models.configs import MODEL_TYPES, load_config
from disco_clip_ds.plan.trainable import lock_problem
from disco_clip_ds.train.args import DiscoTrainingArguments, ModelArguments, read_json, usage_error

logger = logging.getLogger("disco_clip_ds.train")

# transformers' zero-shot-image-classification pipeline pads a SigLIP model's texts to this many tokens
SIGLIP_PIPELINE_TOKENS = 64


def is_path(value: str) -> bool:
    """Spelled as a local path, not as a hub id (models/source.py)."""
    return model_source.looks_like_path(value)


def config_flag(model_args: ModelArguments) -> str:
    """The flag and value that name the model's config, as the messages name it: "--model_config FILE" or
    "--model_name_or_path SOURCE"."""
    if model_args.model_config:
        return f"--model_config {model_args.model_config}"
    return f"--model_name_or_path {model_args.model_name_or_path}"


def check_model_source(model_args: ModelArguments) -> dict | None:
    """One source of weights or config, and a tokenizer; the --model_config JSON as written (None: pretrained
    weights), once it is a config object."""
    if not (model_args.tokenizer_name or model_args.model_name_or_path):
        raise UsageError(
            "training from --model_config needs --tokenizer_name (e.g. recipes/tokenizer or "
            "openai/clip-vit-base-patch32)"
        )
    if bool(model_args.model_name_or_path) == bool(model_args.model_config):
        raise UsageError(
            "give exactly one of --model_name_or_path (pretrained weights) or --model_config (a config JSON)"
        )
    written = read_json("--model_config", model_args.model_config) if model_args.model_config else None
    if model_args.model_config and not isinstance(written, dict):  # e.g. a list of configs: transformers would fail
        raise UsageError(  # on it with a traceback
            f"--model_config {model_args.model_config} holds a JSON {type(written).__name__}, not a config object "
            '({"model_type": "clip", "text_config": {...}, "vision_config": {...}}, e.g. recipes/models/tiny.json)'
        )
    for flag, value in (
        ("--tokenizer_name", model_args.tokenizer_name),
        ("--model_name_or_path", model_args.model_name_or_path),
    ):
        if value:  # a mistyped folder at once, by its full path; a hub id while the hub cannot be reached
            model_source.check_model_source(value, flag)
    if model_args.model_name_or_path:  # weights read as `disco-clip export` reads them: verified first
        verify_model_folder(model_args.model_name_or_path, "--model_name_or_path")
    return written


def load_student_config(model_args: ModelArguments):
    """The model's config (CLIPConfig, SiglipConfig or Siglip2Config), loaded once for the whole run: the checks,
    the model builder, the node facts and the resume checks read this one."""
    named = config_flag(model_args)
    with usage_error(f"{named}: "):
        config = load_config(model_args.model_name_or_path, model_args.model_config)
    if config.model_type not in MODEL_TYPES:
        raise UsageError(f"{named}: a {config.model_type} model; train CLIP or SigLIP ({sorted(MODEL_TYPES)})")
    return config


def check_fits_host(config, deepspeed: dict | None, host_bytes: int | None = None) -> None:
    """Refuse, before any weight is allocated, a model whose fp32 weights alone exceed this node's memory: every rank
    builds the whole model before DeepSpeed partitions it (ZeRO-3 builds its 1/world share: zero.Init). The planner's
    parameter count (plan.memory.ModelShape, counted on the meta device); `host_bytes`: the node's (default: the
    machine's physical memory)."""
    from disco_clip_ds.distributed.ranks import ranks_per_node
    from disco_clip_ds.plan.host import node_memory_bytes
    from disco_clip_ds.plan.memory import ModelShape

    host = host_bytes or node_memory_bytes()
    params = ModelShape.from_config(config).params
    zero3 = ((deepspeed or {}).get("zero_optimization") or {}).get("stage") == 3
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = ranks_per_node()
    per_rank = 4 * params / (world if zero3 else 1)
    if per_rank * local > host:
        raise UsageError(
            f"the model has {params / 1e9:,.1f} billion parameters: its fp32 weights take {per_rank / GiB:,.1f} GiB "
            f"per rank{' (ZeRO-3: 1/world each)' if zero3 else ''}, {per_rank * local / GiB:,.1f} GiB for this "
            f"node's {local} rank(s), more than its {host / GiB:,.1f} GiB of memory: `disco-clip plan` sizes it; "
            "use a smaller model config, or more nodes under ZeRO-3"
        )


GiB = 1024**3


def check_positive_sizes(model_args: ModelArguments) -> None:
    for flag, value in (
        ("--max_text_length", model_args.max_text_length),
        ("--image_size", model_args.image_size),
        ("--chunk_size", model_args.chunk_size),
        ("--max_num_patches", model_args.max_num_patches),
    ):
        if value is not None and value < 1:  # 0 would silently mean "the default"
            raise UsageError(f"{flag} {value}: give a positive number, or leave it out for the default")


def check_tokenizer_and_sizes(
    model_args: ModelArguments, config, written: dict | None, args: DiscoTrainingArguments | None = None
):
    """(tokenizer, image size, max text length, NaFlex's (patch size, budget)), once they fit the model's `config`
    (the image size None and NaFlex's set for SigLIP 2, the other way round for the square-image models).
    `written`: the --model_config JSON as the user wrote it (None: pretrained weights)."""
    tokenizer_name = model_args.tokenizer_name or model_args.model_name_or_path
    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    # the model's own tokenizer gets its config as loaded: AutoTokenizer would otherwise load it again to find the
    # tokenizer's class when tokenizer_config.json does not name it
    own = {} if model_args.tokenizer_name else {"config": config}
    with usage_error(f"{flag} {tokenizer_name}: "):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, **own)
    named = config_flag(model_args)
    text, vision = config.text_config, config.vision_config
    check_embedding_sizes(config, named, written)
    budget = naflex_budget(config, model_args.max_num_patches, model_args.image_size, args)
    if budget is not None and model_args.teacher:
        raise UsageError("--teacher: distillation into SigLIP 2 is not supported (a teacher would need NaFlex)")
    image_size = None if budget else model_args.image_size or vision.image_size
    if budget is None and image_size != vision.image_size:
        raise UsageError(
            f"--image_size {image_size} differs from the model's {vision.image_size}: set image_size in the "
            "model config instead"
        )
    max_length = model_args.max_text_length or text.max_position_embeddings
    if max_length > text.max_position_embeddings:
        raise UsageError(
            f"--max_text_length {max_length} exceeds the model's max_position_embeddings {text.max_position_embeddings}"
        )
    # CLIP pools the text at the eos position: a mismatch trains on the wrong token without any error. (SigLIP pools
    # the last position of text padded to max_length, whatever its tokens.)
    clip_tokens = (text.eos_token_id, text.bos_token_id) == (tokenizer.eos_token_id, tokenizer.bos_token_id)
    if (config.model_type == "clip" and not clip_tokens) or len(tokenizer) > text.vocab_size:
        raise UsageError(
            f"tokenizer {tokenizer_name} (bos {tokenizer.bos_token_id}, eos {tokenizer.eos_token_id}, "
            f"{len(tokenizer)} tokens) does not "
            f"match the model's text config (bos {text.bos_token_id}, eos {text.eos_token_id}, vocab {text.vocab_size})"
        )
    if config.model_type in ("siglip", "siglip2") and text.max_position_embeddings < SIGLIP_PIPELINE_TOKENS:
        logger.warning(
            "%s: max_position_embeddings %d in text_config: the model trains, but transformers' "
            "zero-shot-image-classification pipeline pads SigLIP texts to %d tokens, so the exported model will not "
            "run in that pipeline (disco-clip eval is not affected); use at least %d positions to make it",
            named,
            text.max_position_embeddings,
            SIGLIP_PIPELINE_TOKENS,
            SIGLIP_PIPELINE_TOKENS,
        )
    naflex = None if budget is None else (vision.patch_size, budget)
    return tokenizer, image_size, max_length, naflex


def naflex_budget(config, max_num_patches: int | None, image_size: int | None, args=None) -> int | None:
    """SigLIP 2's patch budget per image (NaFlex; default 256): any number of patches from one, below or above the
    position-embedding grid (Siglip2 interpolates its position embeddings to each image's grid of patches, as the
    SigLIP 2 paper evaluates NaFlex at 64 to 1024 patches). None for the square-image models."""
    if config.model_type != "siglip2":
        if max_num_patches is not None:
            raise UsageError(f"--max_num_patches is SigLIP 2's (NaFlex); this is a {config.model_type} model")
        return None
    if image_size is not None:
        raise UsageError("--image_size: SigLIP 2 keeps each image's aspect ratio; set its patch budget instead")
    if args is not None and args.patch_dropout:
        raise UsageError("--patch_dropout: not supported for SigLIP 2; its patch budget bounds the image tokens")
    budget = DEFAULT_MAX_NUM_PATCHES if max_num_patches is None else max_num_patches
    if budget < 1:
        raise UsageError(f"--max_num_patches {budget}: give at least one patch per image")
    return budget


def check_embedding_sizes(config, named: str, written: dict | None) -> None:
    """The two towers' embeddings are compared with each other, so they must be the same size; otherwise the model
    builds and DeepSpeed starts, and the first forward fails. SigLIP: the text head's projection_size against the
    vision tower's hidden_size (its attention-pooling head keeps that size). CLIP: the top-level projection_dim sizes
    both projections, and the towers' own (what CLIPTextModelWithProjection and CLIPVisionModelWithProjection read)
    must agree with it where the config file the user wrote (`written`; None: pretrained weights) names them."""
    text, vision = config.text_config, config.vision_config
    if config.model_type in ("siglip", "siglip2") and text.projection_size != vision.hidden_size:
        raise UsageError(
            f"{named}: text_config projection_size {text.projection_size} differs from vision_config hidden_size "
            f"{vision.hidden_size} (the image embedding's size): SigLIP compares the two embeddings, make them equal"
        )
    if config.model_type == "clip" and written is not None:
        sizes = {"projection_dim": config.projection_dim}
        for tower in ("text_config", "vision_config"):
            if "projection_dim" in (written.get(tower) or {}):  # an omitted one defaults to 512 and is never used
                sizes[f"{tower} projection_dim"] = getattr(config, tower).projection_dim
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{name} {size}" for name, size in sizes.items())
            raise UsageError(
                f"{named}: the embedding sizes differ ({listed}): CLIP compares the text and image embeddings, "
                "make them equal"
            )


def check_tower_locks(model_args: ModelArguments, config) -> None:
    """Refuse locking flags that mean nothing (plan/trainable.py `lock_problem`, the planner's refusal too): an
    unlocked-layer count without its tower's lock, below 0 or above the tower's encoder layers of `config`, and
    --lock_image_tower_freeze_norm without unlocked layers."""
    problem = lock_problem(model_args, config)
    if problem:
        raise UsageError(problem)
