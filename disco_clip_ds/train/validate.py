"""Every refusal of `disco-clip train`, before any work: a UsageError (AccumulationError for accumulation) saying
what to change, identical on every rank. Grouped by the argument each check is about; `validate` runs them all."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from disco_clip_ds.checkpoint.resume import TOWER_FLAGS
from disco_clip_ds.data.hf_io import HFData, load_training_dataset
from disco_clip_ds.data.naflex import DEFAULT_MAX_NUM_PATCHES
from disco_clip_ds.data.shards import count_samples, empty_reader, expand_shards, is_url, shards_for_reader
from disco_clip_ds.distributed.preemption import parse_signals
from disco_clip_ds.errors import AccumulationError, ExportError, UsageError
from disco_clip_ds.models.build import MODEL_CLASSES, load_config
from disco_clip_ds.plan.checks import batch_contradictions, expected_batch
from disco_clip_ds.plan.trainable import lock_problem
from disco_clip_ds.train.args import (
    DataArguments,
    DiscoTrainingArguments,
    ModelArguments,
    read_deepspeed_json,
    read_json,
    usage_error,
)

logger = logging.getLogger("disco_clip_ds.train")

# transformers' zero-shot-image-classification pipeline pads a SigLIP model's texts to this many tokens
SIGLIP_PIPELINE_TOKENS = 64


@dataclass
class CheckedRun:
    """What `validate` established on the way, for training to use as is."""

    urls: list[str]
    num_samples: int
    max_steps: int
    stop_signals: tuple[int, ...]
    hub_model_id: str | None
    tokenizer: object
    image_size: int | None  # None for SigLIP 2, whose images keep their aspect ratio (`max_num_patches`)
    max_length: int
    hf: HFData | None = None  # the `datasets` dataset to train from, when the source is one
    naflex: tuple[int, int] | None = None  # SigLIP 2's (patch size, patch budget per image); None: square images


def validate(model_args: ModelArguments, data_args: DataArguments, args: DiscoTrainingArguments) -> CheckedRun:
    """Every check of the arguments, before any work.

    Reads the shard lists (or loads and checks the `datasets` dataset), the tokenizer and the model's config (not
    its weights), so that a tokenizer or image size that does not fit the model is refused before the model is
    built. Identical on every rank."""
    check_contrastive_accumulation(args, model_args.loss_impl)
    check_deepspeed_batch(args)
    _check_max_steps(args)
    _check_batch_size(args)
    _check_save_steps(args)
    _check_learning_rate_and_weight_decay(args)
    _check_patch_dropout(args)
    _check_torch_compile(args)
    _check_model_source(model_args)
    _check_zeroshot(data_args)
    hub_model_id = _check_push_to_hub(args)
    stop_signals = parse_signals(args.stop_signals)
    _check_max_image_pixels(data_args)
    hf, urls = _check_source(data_args, args), []
    with usage_error():  # unreadable shard lists and counts: the messages name the fix
        if hf is None:
            urls = expand_shards(data_args.train_shards)
            _check_shards_exist(data_args.train_shards, urls)
        max_steps, num_samples = steps_and_samples(data_args, args, urls, hf)
        if hf is None:
            _check_readers(args, urls)
    _check_positive_sizes(model_args)
    tokenizer, image_size, max_length, naflex = _check_tokenizer_and_sizes(model_args, args)
    _check_tower_locks(model_args)
    _check_teacher(model_args, args)
    _check_teacher_embeddings(model_args, urls)
    return CheckedRun(
        urls, num_samples, max_steps, stop_signals, hub_model_id, tokenizer, image_size, max_length, hf, naflex
    )


def readers(args: DiscoTrainingArguments) -> int:
    """The data readers of a run: ranks x DataLoader workers (one rank reads for all under dispatch_batches)."""
    ranks = 1 if args.accelerator_config.dispatch_batches else args.world_size
    return ranks * max(1, args.dataloader_num_workers)


# --- --gradient_accumulation_steps, --contrastive_accumulation -------------------------------------------------------
def check_contrastive_accumulation(args, loss_impl: str) -> None:
    """Refuse, before training and identically on every rank, settings under which accumulation cannot work.

    `args`: TrainingArguments with `contrastive_accumulation`; `loss_impl`: the model's loss ("tiled", "disco",
    "local")."""
    steps = args.gradient_accumulation_steps
    if not isinstance(steps, int) or steps < 1:
        raise AccumulationError(
            f"--gradient_accumulation_steps must be an integer >= 1 (micro-batches per optimizer step), got {steps!r}"
        )
    if not getattr(args, "contrastive_accumulation", False) or steps == 1:
        return
    if loss_impl == "local":
        raise AccumulationError(
            "--loss_impl local computes each micro-batch's loss on its own, so it cannot be accumulated contrastively: "
            "use --loss_impl tiled (or disco) for a contrastive batch of micro x world x K, or pass "
            "--contrastive_accumulation false to keep independent micro-batch losses"
        )
    if getattr(args, "n_gpu", 1) > 1:
        raise AccumulationError(
            f"one process drives {args.n_gpu} GPUs (torch.nn.DataParallel); the distributed loss needs one process per "
            "GPU: launch with torchrun, deepspeed or accelerate launch"
        )
    parallel = getattr(args, "parallelism_config", None)
    if parallel is not None and any(getattr(parallel, f"{kind}_size", 1) > 1 for kind in ("tp", "cp", "sp")):
        raise AccumulationError(
            "contrastive accumulation supports data parallelism only (DeepSpeed ZeRO, FSDP, DDP); "
            "drop the tensor/context/sequence parallel sizes from parallelism_config"
        )


# --- --deepspeed ------------------------------------------------------------------------------------------------------
def deepspeed_path(args) -> str | None:
    """The DeepSpeed JSON file of the run: --deepspeed, or the one accelerate launch's config names."""
    path = args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return path if isinstance(path, str) and not path.lstrip().startswith("{") else None


def check_deepspeed_batch(args: DiscoTrainingArguments) -> None:
    """Fail early, with what to change, when a DeepSpeed JSON's fixed batch sizes contradict the arguments.

    DeepSpeed would also refuse them, but only after the model is built, in an assertion on each rank. The JSON is
    the one `parse_args` read (`args.deepspeed_json`; read now for arguments made without it); the arithmetic is
    the planner's (`batch_contradictions`)."""
    if args.deepspeed_json is None:
        args.deepspeed_json = read_deepspeed_json(args.deepspeed)
    config = args.deepspeed_json
    if not isinstance(config, dict):
        return
    micro, accum, world = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
    wrong = batch_contradictions(config, micro, accum, world)
    if wrong:
        expected = expected_batch(micro, accum, world)
        raise UsageError(
            f"{deepspeed_path(args)}: {wrong} contradicts --per_device_train_batch_size {micro} x "
            f'--gradient_accumulation_steps {accum} x {world} ranks (= {expected}); set those values to "auto" or '
            "change the arguments to match"
        )


# --- --max_steps, --num_train_epochs, --train_num_samples ---------------------------------------------------------
def _check_max_steps(args: DiscoTrainingArguments) -> None:
    if args.max_steps == 0:  # the Trainer would read 0 as "not set" and train --num_train_epochs
        raise UsageError(
            "--max_steps 0 trains nothing: give a positive number, or leave it out to train --num_train_epochs"
        )


def steps_and_samples(
    data_args: DataArguments, args: DiscoTrainingArguments, urls: list[str], hf: HFData | None = None
) -> tuple[int, int]:
    """(optimizer steps to train, samples per epoch): --max_steps, else the epochs over the counted samples."""
    if hf is not None and not (data_args.train_num_samples or hf.num_rows):
        raise UsageError(f"{hf.description}: its number of rows is not known: pass --train_num_samples")
    num_samples = data_args.train_num_samples or (hf.num_rows if hf is not None else count_samples(urls))
    if num_samples <= 0:
        source = data_args.train_shards if hf is None else hf.description
        raise UsageError(f"no training samples in {source} (count {num_samples})")
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if args.max_steps > 0:
        return args.max_steps, num_samples
    # The stream has no length, so the Trainer needs max_steps: epochs over the counted samples.
    return max(1, math.ceil(args.num_train_epochs * num_samples / global_batch)), num_samples


# --- --per_device_train_batch_size, --save_steps, --learning_rate, --weight_decay ------------------------------------
def _check_batch_size(args: DiscoTrainingArguments) -> None:
    if args.per_device_train_batch_size < 1:
        raise UsageError(f"--per_device_train_batch_size {args.per_device_train_batch_size}: must be at least 1")


def _check_save_steps(args: DiscoTrainingArguments) -> None:
    if args.save_strategy == "steps" and args.save_steps <= 0:
        raise UsageError(f"--save_steps {args.save_steps:g}: give a positive number, or --save_strategy no")


def _check_learning_rate_and_weight_decay(args: DiscoTrainingArguments) -> None:
    # A non-finite or absurd rate trains on to exit 0 with NaN weights; refuse it before any work.
    if not (math.isfinite(args.learning_rate) and 0 < args.learning_rate <= 1):
        raise UsageError(
            f"--learning_rate {args.learning_rate:g}: give a finite number in (0, 1]; CLIP trains at 1e-4 to 1e-3"
        )
    if not (math.isfinite(args.weight_decay) and 0 <= args.weight_decay * args.learning_rate < 1):
        raise UsageError(
            f"--weight_decay {args.weight_decay:g}: give a finite number of at least 0 and below 1 / --learning_rate "
            "(AdamW scales the weights by 1 - lr x wd every step); CLIP uses 0.1 to 0.2"
        )
    for tower in ("vision", "text"):
        lr, wd, decay = (getattr(args, f"{tower}_{what}") for what in ("lr", "weight_decay", "layer_decay"))
        if lr is not None and not (math.isfinite(lr) and 0 < lr <= 1):
            raise UsageError(f"--{tower}_lr {lr:g}: give a finite number in (0, 1], or leave it to --learning_rate")
        if wd is not None and not (math.isfinite(wd) and 0 <= wd * (lr or args.learning_rate) < 1):
            raise UsageError(
                f"--{tower}_weight_decay {wd:g}: give a finite number of at least 0 and below 1 / the tower's "
                "learning rate, or leave it to --weight_decay"
            )
        if not (math.isfinite(decay) and 0 < decay <= 1):
            raise UsageError(
                f"--{tower}_layer_decay {decay:g}: give a number in (0, 1] (1: no decay; EVA-CLIP 0.75-0.85)"
            )
    towers = [f"--{flag}" for flag, default in TOWER_FLAGS.items() if getattr(args, flag) != default]
    if towers and "optimizer" in (args.deepspeed_json or {}):
        raise UsageError(
            f'{" ".join(towers)}: the --deepspeed config\'s "optimizer" block makes DeepSpeed build the optimizer '
            "over one parameter group; remove that block so that the Trainer builds it with the per-tower groups"
        )


# --- --patch_dropout, --patch_dropout_until_step ----------------------------------------------------------------------
def _check_patch_dropout(args: DiscoTrainingArguments) -> None:
    if not (math.isfinite(args.patch_dropout) and 0 <= args.patch_dropout < 1):
        raise UsageError(
            f"--patch_dropout {args.patch_dropout:g}: give the fraction of patches to drop, at least 0 and below 1 "
            "(FLIP: 0.5 or 0.75; 0: off)"
        )
    until = args.patch_dropout_until_step
    if until is not None and args.patch_dropout == 0:
        raise UsageError(f"--patch_dropout_until_step {until} without --patch_dropout: give a rate, e.g. 0.5")
    if until is not None and until < 1:
        raise UsageError(
            f"--patch_dropout_until_step {until}: give the step from which every patch is seen, at least 1"
        )


# --- --torch_compile, --torch_compile_backend, --torch_compile_mode ---------------------------------------------------
def _check_torch_compile(args: DiscoTrainingArguments) -> None:
    """A backend or mode that torch.compile does not know would fail at the first step (train/compile.py)."""
    if not args.torch_compile:
        return
    import torch._dynamo
    import torch._inductor

    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.torch_compile_backend not in backends:
        raise UsageError(
            f"--torch_compile_backend {args.torch_compile_backend}: not a torch.compile backend here; one of "
            f"{', '.join(backends)} (default inductor)"
        )
    modes = list(torch._inductor.list_mode_options())
    if args.torch_compile_mode is not None and args.torch_compile_backend != "inductor":
        raise UsageError(
            f"--torch_compile_mode is inductor's: leave it out with --torch_compile_backend "
            f"{args.torch_compile_backend}"
        )
    if args.torch_compile_mode is not None and args.torch_compile_mode not in modes:
        raise UsageError(f"--torch_compile_mode {args.torch_compile_mode}: one of {', '.join(modes)}")


# --- --model_name_or_path, --model_config, --tokenizer_name ----------------------------------------------------------
def _check_model_source(model_args: ModelArguments) -> None:
    if not (model_args.tokenizer_name or model_args.model_name_or_path):
        raise UsageError(
            "training from --model_config needs --tokenizer_name (e.g. recipes/tokenizer or "
            "openai/clip-vit-base-patch32)"
        )
    if bool(model_args.model_name_or_path) == bool(model_args.model_config):
        raise UsageError(
            "give exactly one of --model_name_or_path (pretrained weights) or --model_config (a config JSON)"
        )
    if model_args.model_config:
        config = read_json("--model_config", model_args.model_config)
        if not isinstance(config, dict):  # e.g. a list of configs: transformers would fail on it with a traceback
            raise UsageError(
                f"--model_config {model_args.model_config} holds a JSON {type(config).__name__}, not a config object "
                '({"model_type": "clip", "text_config": {...}, "vision_config": {...}}, e.g. recipes/models/tiny.json)'
            )
    for flag, value in (
        ("--tokenizer_name", model_args.tokenizer_name),
        ("--model_name_or_path", model_args.model_name_or_path),
    ):
        if value and _is_path(value) and not Path(value).expanduser().exists():
            raise UsageError(f"{flag} {value}: no such folder")


# --- --zeroshot_data, --zeroshot_steps --------------------------------------------------------------------------------
def _check_zeroshot(data_args: DataArguments) -> None:
    if (data_args.zeroshot_steps > 0) != bool(data_args.zeroshot_data):
        raise UsageError("zero-shot eval during training needs both --zeroshot_data DIR and --zeroshot_steps N")
    data = data_args.zeroshot_data
    # a path (a hub id or brace pattern aside) must be there: the eval set is otherwise opened after the model is built
    if data and _is_path(data) and "{" not in data and "::" not in data and not Path(data).expanduser().exists():
        raise UsageError(f"--zeroshot_data {data}: no such file or folder")


def _is_path(value: str) -> bool:
    """Spelled as a local path (/, ./, ../, ~), not as a hub id."""
    return value.startswith(("/", "./", "../", "~"))


# --- --push_to_hub, --hub_model_id ----------------------------------------------------------------------------------
def _check_push_to_hub(args: DiscoTrainingArguments) -> str | None:
    """The hub repo to push to at the end (None: no push), once a token is known to be there."""
    if not args.push_to_hub:
        return None
    if not args.hub_model_id:
        raise UsageError("--push_to_hub needs --hub_model_id USER/NAME")
    from disco_clip_ds.export.hub import require_hub_token

    try:
        require_hub_token()  # now, not after hours of training
    except ExportError as error:
        raise UsageError(str(error)) from error
    return args.hub_model_id


# --- --max_image_pixels ---------------------------------------------------------------------------------------------
def _check_max_image_pixels(data_args: DataArguments) -> None:
    if data_args.max_image_pixels < 1:
        raise UsageError(f"--max_image_pixels {data_args.max_image_pixels}: give a positive number of pixels")


# --- --train_shards, --dataset_name, --train_file; ranks x --dataloader_num_workers ---------------------------------
def _check_source(data_args: DataArguments, args: DiscoTrainingArguments) -> HFData | None:
    """Exactly one training source: shards (None returned), or a `datasets` dataset, loaded and checked."""
    hf_flags = [f for f, v in (("--dataset_name", data_args.dataset_name), ("--train_file", data_args.train_file)) if v]
    if bool(data_args.train_shards) == bool(hf_flags) or len(hf_flags) > 1:
        given = (["--train_shards"] if data_args.train_shards else []) + hf_flags
        raise UsageError(
            f"give exactly one training source: --train_shards, --dataset_name or --train_file (got "
            f"{' and '.join(given) or 'none'})"
        )
    if not hf_flags:
        return None
    return load_training_dataset(data_args, readers(args))


def _check_shards_exist(spec: str, urls: list[str]) -> None:
    """Local shards that are missing: all of them is a mistake in the spec (one line); some of them is what an
    img2dataset run leaves where a shard failed to download, so, as webdataset's and open_clip's readers do, those are
    skipped and counted while training, and said once here."""
    missing = [url for url in urls if not is_url(url) and not Path(url).is_file()]
    if missing and len(missing) == len(urls):
        raise UsageError(
            f"--train_shards {spec}: no such file or folder"
            if len(urls) == 1
            else f"--train_shards {spec}: none of the {len(urls)} shards exists, e.g. '{missing[0]}': give a folder of "
            ".tar shards or a brace pattern"
        )
    if missing:
        logger.warning(
            "--train_shards: %d of %d shards not found, e.g. '%s': they are skipped and counted as bad samples",
            len(missing),
            len(urls),
            missing[0],
        )


def _check_readers(args: DiscoTrainingArguments, urls: list[str]) -> None:
    """Every reader (rank x DataLoader worker) gets a shard, and, where the shards' counts are recorded, a sample:
    a reader with none would fail only once training has started."""
    num_readers, workers = readers(args), max(1, args.dataloader_num_workers)
    shards_for_reader(urls, 0, num_readers)  # a shard for every reader
    empty = empty_reader(urls, num_readers)
    if empty:
        reader, shards = empty
        raise UsageError(
            f"reader {reader} of {num_readers} (rank {reader // workers}, DataLoader worker {reader % workers}) "
            f"would read only shards without samples ({', '.join(shards[:3])}{' ...' if len(shards) > 3 else ''}: "
            "0 samples in their sizes.json / *_stats.json): leave empty shards out of --train_shards, or use fewer "
            "ranks x --dataloader_num_workers"
        )


# --- --max_text_length, --image_size, --chunk_size; the tokenizer against the model's config -----------------------
def _check_positive_sizes(model_args: ModelArguments) -> None:
    for flag, value in (
        ("--max_text_length", model_args.max_text_length),
        ("--image_size", model_args.image_size),
        ("--chunk_size", model_args.chunk_size),
        ("--max_num_patches", model_args.max_num_patches),
    ):
        if value is not None and value < 1:  # 0 would silently mean "the default"
            raise UsageError(f"{flag} {value}: give a positive number, or leave it out for the default")


def _check_tokenizer_and_sizes(model_args: ModelArguments, args: DiscoTrainingArguments | None = None):
    """(tokenizer, image size, max text length, NaFlex's (patch size, budget)), once they fit the model's config
    (the image size None and NaFlex's set for SigLIP 2, the other way round for the square-image models)."""
    tokenizer_name = model_args.tokenizer_name or model_args.model_name_or_path
    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    with usage_error(f"{flag} {tokenizer_name}: "):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    flag, source = (
        ("--model_config", model_args.model_config)
        if model_args.model_config
        else ("--model_name_or_path", model_args.model_name_or_path)
    )
    with usage_error(f"{flag} {source}: "):
        config = load_config(model_args.model_name_or_path, model_args.model_config)
    if config.model_type not in MODEL_CLASSES:
        raise UsageError(
            f"{flag} {source}: a {config.model_type} model; train CLIP or SigLIP ({sorted(MODEL_CLASSES)})"
        )
    text, vision = config.text_config, config.vision_config
    written = read_json(flag, source) if model_args.model_config else None
    _check_embedding_sizes(config, f"{flag} {source}", written)
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
            "%s %s: max_position_embeddings %d in text_config: the model trains, but transformers' "
            "zero-shot-image-classification pipeline pads SigLIP texts to %d tokens, so the exported model will not "
            "run in that pipeline (disco-clip eval is not affected); use at least %d positions to make it",
            flag,
            source,
            text.max_position_embeddings,
            SIGLIP_PIPELINE_TOKENS,
            SIGLIP_PIPELINE_TOKENS,
        )
    naflex = None if budget is None else (vision.patch_size, budget)
    return tokenizer, image_size, max_length, naflex


def naflex_budget(config, max_num_patches: int | None, image_size: int | None, args=None) -> int | None:
    """SigLIP 2's patch budget per image (NaFlex; default 256), once it fits the position-embedding grid: at least
    one of its rows (fewer patches than a row cannot hold the grid's aspect ratios) and at most all of it (more
    would stretch the learned grid beyond what it was trained to cover). None for the square-image models."""
    if config.model_type != "siglip2":
        if max_num_patches is not None:
            raise UsageError(f"--max_num_patches is SigLIP 2's (NaFlex); this is a {config.model_type} model")
        return None
    if image_size is not None:
        raise UsageError("--image_size: SigLIP 2 keeps each image's aspect ratio; set its patch budget instead")
    if args is not None and args.patch_dropout:
        raise UsageError("--patch_dropout: not supported for SigLIP 2; its patch budget bounds the image tokens")
    budget = DEFAULT_MAX_NUM_PATCHES if max_num_patches is None else max_num_patches
    grid = config.vision_config.num_patches
    row = math.isqrt(grid)
    if budget < row:
        raise UsageError(f"--max_num_patches {budget}: below one row of the {row} x {row} position grid; give {row}+")
    if budget > grid:
        raise UsageError(
            f"--max_num_patches {budget}: above the {row} x {row} = {grid} position grid; give at most {grid}, or "
            "raise num_patches in vision_config"
        )
    return budget


def _check_embedding_sizes(config, named: str, written: dict | None) -> None:
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


# --- --lock_image_tower, --lock_text_tower: their unlocked layers and norms against the model's config -------------
def _check_tower_locks(model_args: ModelArguments) -> None:
    """Refuse locking flags that mean nothing (plan/trainable.py `lock_problem`, the planner's refusal too): an
    unlocked-layer count without its tower's lock, below 0 or above the tower's encoder layers, and
    --lock_image_tower_freeze_norm without unlocked layers. The config read fine in _check_tokenizer_and_sizes."""
    problem = lock_problem(model_args, load_config(model_args.model_name_or_path, model_args.model_config))
    if problem:
        raise UsageError(problem)


# --- --teacher, --distill_weight, --distill_temperature ---------------------------------------------------------------
def _check_teacher(model_args: ModelArguments, args: DiscoTrainingArguments) -> None:
    """A teacher of the student's family (CLIP for CLIP, SigLIP for SigLIP: the loss compares the same kind of
    similarities), a weight in (0, 1], a positive temperature, a global-batch loss. Sets the weight's default."""
    teacher, weight, temperature = model_args.teacher, model_args.distill_weight, model_args.distill_temperature
    if teacher is None:
        given = [
            f
            for f, v in (
                ("--distill_weight", weight),
                ("--distill_temperature", temperature),
                ("--teacher_embeddings", model_args.teacher_embeddings),
            )
            if v is not None
        ]
        if given:
            raise UsageError(f"{' and '.join(given)} without --teacher: name the model to distill from")
        return
    if weight is None:
        model_args.distill_weight = weight = 0.5
    if not (math.isfinite(weight) and 0 < weight <= 1):
        raise UsageError(f"--distill_weight {weight:g}: give a number in (0, 1] (1: distillation only)")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise UsageError(f"--distill_temperature {temperature:g}: give a positive number, or leave it out")
    if model_args.loss_impl == "local":
        raise UsageError("--teacher distils the global batch's similarities: use --loss_impl tiled (or disco)")
    if _is_path(teacher) and not Path(teacher).expanduser().exists():
        raise UsageError(f"--teacher {teacher}: no such folder")
    with usage_error(f"--teacher {teacher}: "):
        config = load_config(teacher)
    student = load_config(model_args.model_name_or_path, model_args.model_config)
    if config.model_type != student.model_type:
        raise UsageError(
            f"--teacher {teacher}: a {config.model_type} model cannot teach a {student.model_type} one; give a "
            f"{student.model_type} teacher"
        )


def _check_teacher_embeddings(model_args: ModelArguments, urls: list[str]) -> None:
    """Stored embeddings (data/embeddings.py) for every training shard, made by the --teacher named: checked from the
    sidecars' headers before any work (their checksums are verified as each is read)."""
    folder = model_args.teacher_embeddings
    if folder is None:
        return
    from disco_clip_ds.data.embeddings import read_metadata, sidecar_path, teacher_fingerprint
    from disco_clip_ds.errors import DataError

    if not urls:
        raise UsageError("--teacher_embeddings are stored per shard: train from --train_shards")
    if not Path(folder).is_dir():
        raise UsageError(f"--teacher_embeddings {folder}: no such folder")
    with usage_error(f"--teacher {model_args.teacher}: "):
        fingerprint = teacher_fingerprint(model_args.teacher)
    for url in urls:
        path = sidecar_path(folder, url)
        if not path.is_file():
            raise UsageError(
                f"--teacher_embeddings {folder}: no embeddings of shard {url} ({path.name}): run `disco-clip data "
                f"embed --teacher {model_args.teacher} --shards ... --output {folder}`"
            )
        try:
            made_by = read_metadata(path).get("teacher")
        except DataError as error:
            raise UsageError(str(error)) from error
        if made_by != fingerprint:
            raise UsageError(
                f"--teacher_embeddings {folder}: {path.name} was made by another teacher than --teacher "
                f"{model_args.teacher} (fingerprint {made_by}, not {fingerprint})"
            )
