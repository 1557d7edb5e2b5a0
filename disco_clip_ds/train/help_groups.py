"""`disco-clip train --help` in groups a user can scan: HfArgumentParser lists every field of the three dataclasses
(TrainingArguments' 150 among them) under one "options" heading. `group_arguments` moves each option, after the
parser is built, into the group its name belongs to; parsing is untouched (the parser's actions stay as they are:
argparse groups only order the help)."""

from __future__ import annotations

import argparse
import re

# (group, what it holds, the option names it takes: a full match of one of the patterns), in the order --help prints
GROUPS = (
    (
        "model",
        "the model, its tokenizer and input sizes, locked towers, patch dropout, compilation",
        (
            "model_name_or_path",
            "model_config",
            "tokenizer_name",
            "image_size",
            "max_num_patches",
            "resolution_schedule",
            "stage_micro_batch_sizes",
            "max_text_length",
            "lock_.*",
            "patch_dropout.*",
            "(activation|gradient)_checkpointing.*",
            "torch_compile.*",
            "use_liger_kernel",
            "liger_kernel_config",
            "use_cache",
            "neftune_noise_alpha",
        ),
    ),
    (
        "data",
        "what is trained on and how it is read",
        (
            "train_shards",
            "dataset_.*",
            "train_split",
            "train_file",
            "image_column",
            "caption_column",
            "streaming",
            "train_data_.*",
            "train_num_samples",
            "shuffle_buffer",
            "max_image_pixels",
            "normalize_on_device",
            "dataloader_.*",
            "remove_unused_columns",
            "label_names",
            "train_sampling_strategy",
            "length_column_name",
        ),
    ),
    ("loss", "the distributed contrastive loss", ("loss_impl", "chunk_size", "contrastive_accumulation")),
    (
        "optimisation",
        "steps, batch, optimizer, schedule, precision, EMA, seeds",
        (
            "per_device_train_batch_size",
            "num_train_epochs",
            "max_steps",
            "learning_rate",
            "lr_scheduler_.*",
            "warmup_.*",
            "optim.*",
            "(vision|text)_(lr|weight_decay|layer_decay)",
            "weight_decay",
            "adam_.*",
            "gradient_accumulation_steps",
            "average_tokens_across_devices",
            "max_grad_norm",
            "label_smoothing_factor",
            "bf16.*",
            "fp16.*",
            "tf32",
            "ema_.*",
            "drop_ema",
            "seed",
            "data_seed",
            "full_determinism",
            "auto_find_batch_size",
            "torch_empty_cache_steps",
        ),
    ),
    (
        "distillation",
        "a teacher's logits, live or stored",
        (
            "teacher",
            "distill_.*",
            "teacher_embeddings",
            "augmentation_pool.*",
            "synthetic_caption_ratio",
            "live_teacher",
            "verify_teacher_weights",
        ),
    ),
    (
        "evaluation",
        "zero-shot eval and task suites during training",
        (
            "zeroshot_.*",
            "eval_.*",
            "per_device_eval_batch_size",
            "prediction_loss_only",
            "include_for_metrics",
            "batch_eval_metrics",
            "load_best_model_at_end",
            "metric_for_best_model",
            "greater_is_better",
            "do_eval",
            "do_predict",
        ),
    ),
    (
        "checkpointing",
        "the output folder, saves, resume, the hub",
        (
            "output_dir",
            "save_.*",
            "enable_jit_checkpoint",
            "resume_from_checkpoint",
            "ignore_data_skip",
            "restore_callback_states_from_checkpoint",
            "push_to_hub",
            "hub_.*",
            "stop_signals",
        ),
    ),
    (
        "launch",
        "devices, ranks and their backends",
        (
            "deepspeed",
            "local_rank",
            "ddp_.*",
            "fsdp.*",
            "accelerator_config",
            "parallelism_config",
            "use_cpu",
        ),
    ),
    (
        "logging",
        "what is logged, where and how often",
        (
            "logging_.*",
            "log_.*",
            "include_num_input_tokens_seen",
            "report_to",
            "run_name",
            "project",
            "trackio_.*",
            "disable_tqdm",
            "peak_tflops",
            "debug",
            "skip_memory_metrics",
            "do_train",
        ),
    ),
)
OTHER = ("other", "the rest of transformers' TrainingArguments")


def group_of(flag: str) -> str:
    """The help group of the option `flag` (its name without dashes; a `no_X` flag goes where X goes)."""
    flag = flag.removeprefix("no_")
    for name, _, patterns in GROUPS:
        if any(re.fullmatch(pattern, flag) for pattern in patterns):
            return name
    return OTHER[0]


def group_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Move every option of `parser` out of its untitled groups into GROUPS (help order only); returns `parser`."""
    groups = {name: parser.add_argument_group(name, about) for name, about, _ in (*GROUPS, (*OTHER, ()))}
    for holder in list(parser._action_groups):
        if holder in groups.values():
            continue
        for action in list(holder._group_actions):
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            holder._group_actions.remove(action)
            groups[group_of(_flag_name(action))]._group_actions.append(action)
    for group in groups.values():
        if not group._group_actions:  # e.g. "other" while every TrainingArguments field has its group
            parser._action_groups.remove(group)
    return parser


def _flag_name(action: argparse.Action) -> str:
    """The option's name as typed, without dashes (`--no_ema_warmup` -> no_ema_warmup): its dest is ema_warmup."""
    return max(action.option_strings, key=len).lstrip("-").replace("-", "_")
