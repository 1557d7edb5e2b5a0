"""Every refusal of `disco-clip train`, before any work: a UsageError (AccumulationError for accumulation) saying
what to change, identical on every rank; one module per subject (batch, training, data, model, teacher).

`validate` runs them all and returns the checked run (`CheckedRun`): everything it resolved on the way (the model's
and the teacher's configs, the DeepSpeed JSON, the tokenizer, the shard list and sample count, max_steps and the
defaults it filled in), so that no later step reads those again. It changes none of its inputs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from disco_clip_ds.data.hf_io import HFData
from disco_clip_ds.data.mix import Mixture
from disco_clip_ds.distributed.preemption import parse_signals
from disco_clip_ds.train.args import DataArguments, DiscoTrainingArguments, ModelArguments, usage_error
from disco_clip_ds.train.validate import batch, data, model, reinforced, resolution, teacher, training
from disco_clip_ds.train.validate.batch import check_contrastive_accumulation, check_deepspeed_batch, deepspeed_path
from disco_clip_ds.train.validate.data import readers, steps_and_samples
from disco_clip_ds.train.validate.model import naflex_budget

__all__ = [
    "CheckedRun",
    "check_contrastive_accumulation",
    "check_deepspeed_batch",
    "deepspeed_path",
    "naflex_budget",
    "readers",
    "steps_and_samples",
    "validate",
]


@dataclass
class CheckedRun:
    """What `validate` established on the way, for training to use as is."""

    model_args: ModelArguments  # a copy of the arguments with the defaults filled in (distill_weight, max_num_patches)
    config: object  # the model's CLIPConfig, SiglipConfig or Siglip2Config, loaded once
    deepspeed: dict | None  # the DeepSpeed JSON (None: none, or one given inline)
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
    teacher_config: list | None = None  # each --teacher's config, in its order (None: no teacher)
    teacher_store: object | None = None  # the EmbeddingStore of --teacher_embeddings (data/embeddings.py), checked
    # (augmentations per sample to draw from, synthetic caption keys to draw from), with --teacher_embeddings
    reinforced: tuple[int, tuple[str, ...]] | None = None
    mixture: Mixture | None = None  # the weighted mixture of --train_shards' '::' sources (None: concatenated)


def validate(model_args: ModelArguments, data_args: DataArguments, args: DiscoTrainingArguments) -> CheckedRun:
    """Every check of the arguments, before any work.

    Reads the shard lists (or loads and checks the `datasets` dataset), the tokenizer and the model's config (not
    its weights), so that a tokenizer or image size that does not fit the model is refused before the model is
    built. Identical on every rank."""
    deepspeed = batch.deepspeed_json(args)
    batch.check_contrastive_accumulation(args, model_args.loss_impl)
    batch.check_deepspeed_batch(args, deepspeed)
    batch.check_max_steps(args)
    batch.check_batch_size(args)
    training.check_save_steps(args)
    training.check_learning_rates(args, deepspeed)
    training.check_own_optimizer(args, deepspeed)
    training.check_patch_dropout(args)
    training.check_torch_compile(args)
    training.check_peak_tflops(args)
    training.check_ema(args, data_args.zeroshot_steps)
    written = model.check_model_source(model_args)
    data.check_zeroshot(data_args)
    hub_model_id = training.check_push_to_hub(args)
    stop_signals = parse_signals(args.stop_signals)
    data.check_max_image_pixels(data_args)
    hf, urls = data.check_source(data_args, args), []
    with usage_error():  # unreadable shard lists and counts: the messages name the fix
        if hf is None:
            urls = data.checked_shards(data_args.train_shards)
        max_steps, num_samples = steps_and_samples(data_args, args, urls, hf)
        mixture = data.check_mixture(data_args, args)
        if hf is None and mixture is None:
            data.check_readers(args, urls, data_args.dataset_resampled)
    model.check_positive_sizes(model_args)
    config = model.load_student_config(model_args)
    model.check_fits_host(config, deepspeed)
    tokenizer, image_size, max_length, naflex = model.check_tokenizer_and_sizes(model_args, config, written, args)
    model.check_tower_locks(model_args, config)
    image_size, naflex = resolution.check_resolution_schedule(args, model_args, config, image_size, naflex)
    distill_weight, teacher_config = teacher.check_teacher(model_args, config)
    reinforced.check_reinforced_flags(model_args, naflex is not None)
    store = teacher.check_teacher_embeddings(model_args, urls, teacher_config)
    pool = None if store is None else reinforced.check_store(model_args, store)
    resolved = dataclasses.replace(
        model_args,
        distill_weight=distill_weight,
        max_num_patches=model_args.max_num_patches if naflex is None else naflex[1],
    )
    return CheckedRun(
        resolved,
        config,
        deepspeed,
        urls,
        num_samples,
        max_steps,
        stop_signals,
        hub_model_id,
        tokenizer,
        image_size,
        max_length,
        hf,
        naflex,
        teacher_config,
        store,
        pool,
        mixture,
    )
