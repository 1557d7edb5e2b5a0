"""The planner's input checks: a DeepSpeed config read and validated for a world size, every problem reported at
once with its fix, and the batch arithmetic (train = micro x accumulation x world)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan.memory import PRECISION_BYTES, Settings
from disco_clip_ds.texts import read_text

# Top-level keys DeepSpeed 0.16-0.19 reads (its config docs and deepspeed/runtime/config.py). DeepSpeed itself
# silently ignores any other key, so a typo such as "train_micro_batch_size" would go unnoticed until OOM.
KNOWN_TOP_LEVEL_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "amp",
    "torch_autocast",
    "zero_optimization",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "monitor_config",
    "autotuning",
    "elasticity",
    "checkpoint",
    "data_types",
    "aio",
    "sparse_attention",
    "sparse_gradients",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "pipeline",
    "memory_breakdown",
    "dataloader_drop_last",
    "disable_allgather",
    "gradient_allreduce_op",
    "seq_parallel_communication_data_type",
    "sequence_parallel_size",
    "timers",
    "nebula",
    "weight_quantization",
    "hybrid_engine",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "use_data_before_expert_parallelism",
    "graph_harvesting",
    "compile",
    "use_node_local_storage",
    "load_universal",
    "tensor_parallel",
    "zenflow",
    "disable_python_gc",
    "fp8",
}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def read_deepspeed_json(path, flag: str = "--deepspeed") -> dict:
    """A DeepSpeed JSON file, read with errors that name the flag, the file and the line: the one reader of it, for
    `disco-clip plan` and `disco-clip train` (train/args.py reads it once, at parsing) alike. `flag`: the argument
    that named the file."""
    path = Path(path)
    if not path.is_file():
        raise PlanConfigError(f"{flag} {path}: no such file")
    text = read_text(path, flag, PlanConfigError)  # the one reader of the user's text: one line naming the line
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanConfigError(f"{flag} {path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise PlanConfigError(f"{flag} {path}: the top level must be a JSON object, got {type(config).__name__}")
    return config


def _batch_numbers(config: dict, world: int, per_device_batch: int | None, problems: list, auto: list) -> dict | None:
    """The batch sizes as Settings fields (train_batch, micro_batch, grad_accum), or None when there is no per-GPU
    batch; a problem is appended for each value or product that does not add up."""
    values = {}
    for key in BATCH_KEYS:
        value = config.get(key)
        if _is_auto(value):
            auto.append(f'{key}: "auto" (filled by the HF Trainer from TrainingArguments)')
            value = None
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"{key} must be a positive integer, got {value!r}")
            value = None
        values[key] = value
    train, micro, accum = (values[k] for k in BATCH_KEYS)
    if per_device_batch is not None and per_device_batch < 1:
        problems.append(f"--per_device_batch must be a positive integer, got {per_device_batch}")
        per_device_batch = None
    configured = {k: v for k, v in values.items() if v is not None}
    micro = per_device_batch if per_device_batch is not None else micro
    if micro is None and train is not None:
        micro = train // (world * (accum or 1)) or None
    if micro is None:
        problems.append("no per-GPU batch: set train_micro_batch_size_per_gpu to an integer or pass --per_device_batch")
        return None
    accum = accum or (train // (micro * world) if train else 1) or 1
    wrong = batch_contradictions(configured, micro, accum, world)
    if "train_micro_batch_size_per_gpu" in wrong:
        problems.append(
            f"--per_device_batch {per_device_batch} contradicts train_micro_batch_size_per_gpu "
            f"{wrong['train_micro_batch_size_per_gpu']} in the config: drop the flag or change the config"
        )
    train = train if train is not None else micro * accum * world
    if "train_batch_size" in wrong:
        fixes = [f"train_batch_size to {micro * accum * world}"]
        if train % (accum * world) == 0:
            fixes.append(f"train_micro_batch_size_per_gpu to {train // (accum * world)}")
        if train % (micro * accum) == 0:
            fixes.append(f"--gpus to {train // (micro * accum)}")
        problems.append(
            f"batch arithmetic does not add up: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} "
            f"x gradient_accumulation_steps {accum} x world size {world} = {micro * accum * world}; "
            f"for this world size set " + " or ".join(fixes)
        )
    return {"train_batch": train, "micro_batch": micro, "grad_accum": accum}


def batch_contradictions(config: dict, micro: int, accum: int, world: int) -> dict:
    """The batch sizes a DeepSpeed config fixes that contradict `micro` per rank x `accum` micro-steps x `world`
    ranks, as {key: the configured value}; "auto" (the HF Trainer fills it in) contradicts nothing.

    The one check of a config's batch arithmetic: the planner (`validate_config`) and training's argument checks
    (`disco_clip_ds.train.validate`) both ask it."""
    expected = expected_batch(micro, accum, world)
    return {k: v for k, v in config.items() if k in expected and not _is_auto(v) and v != expected[k]}


def expected_batch(micro: int, accum: int, world: int) -> dict:
    """The batch keys of a DeepSpeed config as `micro` per rank x `accum` micro-steps x `world` ranks make them."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
    }


def _precision(config: dict, requested: str | None, problems: list, auto: list) -> str:
    enabled = {}
    for key in ("fp16", "bf16"):
        section = config.get(key, {})
        if not isinstance(section, dict):
            problems.append(f'"{key}" must be an object such as {{"enabled": true}}, got {section!r}')
            continue
        flag = section.get("enabled", False)
        if _is_auto(flag):
            auto.append(f'{key}.enabled: "auto" (the Trainer sets it from --{key}); plan with --precision')
            flag = requested == key
        enabled[key] = bool(flag)
    on = [k for k, v in enabled.items() if v]
    if len(on) > 1:
        problems.append("fp16.enabled and bf16.enabled are both true: enable one (bf16 on A100/H100)")
    if "amp" in config:  # DeepSpeed 0.19 refuses the section outright; older releases refused it with ZeRO
        problems.append(
            '"amp" (NVIDIA Apex) is not supported with DeepSpeed ZeRO: remove it and enable "bf16" or "fp16"'
        )
    configured = on[0] if on else "fp32"
    if requested is not None and requested != configured:
        problems.append(
            f"--precision {requested} but the config trains in {configured}: "
            f'set "{requested}": {{"enabled": true}} in the config or pass --precision {configured}'
        )
    return configured


def _zero_section(config: dict, settings_kwargs: dict, problems: list, warnings: list, auto: list) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        problems.append(f'"zero_optimization" must be an object, got {zero!r}')
        return
    known = set(DeepSpeedZeroConfig.model_fields)
    known |= {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    for key, value in zero.items():
        if key not in known:
            problems.append(f"unknown key zero_optimization.{key}{_suggest(key, known)}")
        elif _is_auto(value):
            hint = (
                "the Trainer fills it with hidden_size**2 (4096 for a 64-wide model): set it explicitly"
                if key == "reduce_bucket_size"
                else "filled by the HF Trainer"
            )
            auto.append(f'zero_optimization.{key}: "auto" ({hint})')
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        return
    clean = {k: v for k, v in zero.items() if k in known and not _is_auto(v)}
    try:
        parsed = DeepSpeedZeroConfig(**clean)
    except ValidationError as e:
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"])
            problems.append(f"zero_optimization.{where}: {err['msg']} (got {err.get('input')!r})")
        return
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        value = zero.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != int(value):
            problems.append(f"zero_optimization.{key} must be a whole number of elements, got {value}")
    if parsed.allgather_bucket_size % 2:  # DeepSpeed asserts this only when the engine starts
        problems.append(
            f"zero_optimization.allgather_bucket_size must be even (NCCL 4-byte alignment of 16-bit "
            f"values), got {parsed.allgather_bucket_size}"
        )
    if stage < 3 and any(k.startswith("stage3_") for k in zero):
        warnings.append(f"stage3_* keys have no effect at ZeRO stage {stage}")
    if stage == 0 and (zero.get("offload_optimizer") or zero.get("offload_param")):
        problems.append("offload needs ZeRO stage >= 1 (optimizer) or 3 (params): raise zero_optimization.stage")
    if stage < 3 and zero.get("offload_param"):
        problems.append("offload_param needs ZeRO stage 3: remove it or set zero_optimization.stage to 3")
    settings_kwargs.update(
        stage=stage,
        reduce_bucket=int(parsed.reduce_bucket_size),
        allgather_bucket=int(parsed.allgather_bucket_size),
        overlap_comm=bool(parsed.overlap_comm),
        bucket_allreduce=bool(parsed.use_multi_rank_bucket_allreduce),
        prefetch_bucket=int(parsed.prefetch_bucket_size),
        max_live_parameters=int(parsed.max_live_parameters),
        offload_optimizer=parsed.offload_optimizer is not None and str(parsed.offload_optimizer.device) != "none",
        offload_param=parsed.offload_param is not None and str(parsed.offload_param.device) != "none",
    )


def _deepspeed_check(config: dict, micro: int, accum: int, problems: list) -> None:
    """Let DeepSpeed's own parser see the config too. It knows world size 1 only, so it gets the batch rescaled
    to one rank, and it cannot parse "auto", so those keys are dropped (the Trainer replaces them first)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    copy = dict(
        _without_auto(config),
        train_batch_size=micro * accum,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
    )
    try:
        DeepSpeedConfig(copy)
    except Exception as e:  # DeepSpeed raises assert/ValueError/pydantic errors alike; report its words
        problems.append(f"DeepSpeed rejects the config: {type(e).__name__}: {e}")


def _auto_paths(value, prefix: str = ""):
    """Dotted paths of every "auto" value, e.g. optimizer.params.lr."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            if _is_auto(item):
                yield path
            else:
                yield from _auto_paths(item, path)


def _without_auto(value):
    if isinstance(value, dict):
        return {k: _without_auto(v) for k, v in value.items() if not _is_auto(v)}
    return value


def _section_problems(config: dict, precision: str | None, problems: list, warnings: list, auto: list):
    """The problems of a config that no world size changes (keys, precision, the ZeRO section); (the precision it
    trains in, the ZeRO numbers)."""
    for key in config:
        if key not in KNOWN_TOP_LEVEL_KEYS:
            problems.append(
                f'unknown top-level key "{key}"{_suggest(key, KNOWN_TOP_LEVEL_KEYS)}; '
                "DeepSpeed would silently ignore it"
            )
    chosen = _precision(config, precision, problems, auto)
    zero = {"stage": 0}
    _zero_section(config, zero, problems, warnings, auto)
    return chosen, zero


def check_sections(config: dict, source: str) -> None:
    """`disco-clip train`'s check of its DeepSpeed JSON (`source`: the flag and file that named it) before anything
    reads it: the problems `disco-clip plan` names that no world size changes (unknown keys, fp16 with bf16, a ZeRO
    stage or key DeepSpeed refuses), as a PlanConfigError, instead of DeepSpeed's or transformers' traceback."""
    problems: list = []
    _section_problems(config, None, problems, [], [])
    if problems:
        raise PlanConfigError(f"{source}: DeepSpeed config problems:\n  - " + "\n  - ".join(problems))


def validate_config(
    config: dict, world: int, per_device_batch: int | None = None, precision: str | None = None
) -> Settings:
    """Check a DeepSpeed config dict for `world` data-parallel ranks; return its numbers or raise PlanConfigError.

    Every problem is collected and reported at once, each with the fix. "auto" values are listed in
    `Settings.trainer_auto`: they are legal only under the HF Trainer, which fills them from TrainingArguments.
    """
    if not isinstance(world, int) or world < 1:
        raise PlanConfigError(f"--gpus must be a positive integer, got {world!r}")
    problems, warnings, auto = [], [], []
    batch = _batch_numbers(config, world, per_device_batch, problems, auto)
    chosen, zero = _section_problems(config, precision, problems, warnings, auto)
    listed = {a.split(":")[0] for a in auto}
    auto += [
        f'{path}: "auto" (filled by the HF Trainer from TrainingArguments)'
        for path in _auto_paths(config)
        if path not in listed
    ]
    comm = config.get("communication_data_type")
    comm_bytes = {"fp32": 4, "fp16": 2, "bf16": 2, "bfp16": 2, None: PRECISION_BYTES[chosen]}.get(comm)
    if comm_bytes is None:
        problems.append(f"communication_data_type must be fp32, fp16 or bf16, got {comm!r}")
    if batch and not problems:
        _deepspeed_check(config, batch["micro_batch"], batch["grad_accum"], problems)
    if problems:
        raise PlanConfigError("DeepSpeed config problems:\n  - " + "\n  - ".join(problems))
    numbers = dict(batch, **zero, precision=chosen, comm_bytes=comm_bytes)
    return Settings(world, trainer_auto=auto, warnings=warnings, **numbers)
