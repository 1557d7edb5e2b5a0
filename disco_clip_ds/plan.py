"""Plan a run before launch: validate a DeepSpeed config, estimate per-GPU memory and per-rank traffic.

    disco-clip plan --deepspeed ds_configs/vit_b32_32k_8gpu.json --model recipes/models/vit_b32.json \
        --gpus 8 --gpu_memory 40GB [--per_device_batch B --precision bf16 --activation_checkpointing --loss_impl tiled]

Memory per GPU = model states (DeepSpeed's own ZeRO-2/3 estimators where they apply, the same accounting
written out for stages 0/1 and fp32) + ZeRO communication buffers + activations (per-sample coefficients
fitted on measured CPU peaks of real CLIPModels, activation_fit.json, made by bench/act_fit.py) + the loss's
working set per implementation + the largest parameter's transient gradient + a fixed framework overhead.
With gradient_accumulation_steps K > 1 and contrastive accumulation (the trainer's default,
disco_clip_ds/accumulate.py) the contrastive batch is micro x world x K: activations stay those of one
micro-batch, the loss runs over all micro x world x K pairs, and each rank caches its K x micro embeddings and
their gradients.
Traffic per rank = ZeRO gradient/parameter collectives + the loss's: disco all-gathers both modalities'
features and reduce-scatters their gradient in backward (the DisCo paper all-reduces there: twice the bytes);
tiled moves the texts only, plus two all-reduces of B fp32 column values. Ring collectives: a rank sends (and
receives) (N-1)/N of the buffer for all-gather and reduce-scatter, 2(N-1)/N for all-reduce.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import BENCH_LOSS_IMPLS
from .errors import UsageError

FIT_FILE = Path(__file__).with_name("activation_fit.json")
LOSS_IMPLS = tuple(impl for impl in BENCH_LOSS_IMPLS if impl != "twoblock")  # planned by default
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30
# Not measurable without a GPU here: CUDA context (~0.5-1 GiB), NCCL buffers and cuBLAS workspaces, allocator
# slack. A round figure, stated in every report; override with --overhead_gb.
DEFAULT_OVERHEAD_GB = 2.0
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


class PlanConfigError(UsageError):
    """The DeepSpeed config (or the plan's arguments) cannot be used; the message lists every problem and its fix."""


# ----------------------------------------------------------------------------------------------------- model


@dataclass
class ModelShape:
    """What the memory model needs from a CLIPConfig: tower shapes, inputs and parameter counts."""

    towers: dict  # name -> {"layers", "tokens", "hidden", "mlp"}
    image: tuple  # (channels, height, width)
    text_tokens: int
    projection_dim: int
    params: int
    largest_param: int

    @classmethod
    def from_json(cls, path) -> "ModelShape":
        """Read a CLIPConfig JSON; count parameters exactly on the meta device (no memory, no weights)."""
        import torch
        from transformers import CLIPConfig, CLIPModel

        path = Path(path)
        if not path.is_file():
            raise PlanConfigError(
                f"--model {path}: no such file; pass a CLIPConfig JSON such as recipes/models/vit_b32.json"
            )
        try:
            config = CLIPConfig.from_json_file(str(path))
        except (OSError, ValueError) as e:
            raise PlanConfigError(f"--model {path}: not a readable CLIPConfig JSON ({e})") from None
        with torch.device("meta"):
            model = CLIPModel(config)
        numels = [p.numel() for p in model.parameters()]
        v, t = config.vision_config, config.text_config
        towers = {
            "vision": {
                "layers": v.num_hidden_layers,
                "tokens": (v.image_size // v.patch_size) ** 2 + 1,
                "hidden": v.hidden_size,
                "mlp": v.intermediate_size,
            },
            "text": {
                "layers": t.num_hidden_layers,
                "tokens": t.max_position_embeddings,
                "hidden": t.hidden_size,
                "mlp": t.intermediate_size,
            },
        }
        return cls(
            towers,
            (v.num_channels, v.image_size, v.image_size),
            t.max_position_embeddings,
            config.projection_dim,
            sum(numels),
            max(numels),
        )

    def features(self) -> dict:
        """Shape sums the activation fit is linear in (see bench/act_fit.py)."""
        ts = self.towers.values()
        return {
            "layer_sh": sum(t["layers"] * t["tokens"] * t["hidden"] for t in ts),
            "layer_sm": sum(t["layers"] * t["tokens"] * t["mlp"] for t in ts),
            "embed_sh": sum(t["tokens"] * t["hidden"] for t in ts),
            "tower_layer_sh_sm": [(t["tokens"] * t["hidden"], t["tokens"] * t["mlp"]) for t in ts],
        }

    def input_bytes(self, pixel_bytes: int) -> int:
        """One sample's inputs: pixels in the compute dtype, int64 token ids."""
        return math.prod(self.image) * pixel_bytes + self.text_tokens * 8

    @staticmethod
    def activation_elements_from(features: dict, fit: dict, checkpointing: bool) -> float:
        """Activation elements per sample from the shape sums and the fitted coefficients."""
        embed = fit["eps"] * features["embed_sh"]
        if not checkpointing:
            return fit["alpha"] * features["layer_sh"] + fit["beta"] * features["layer_sm"] + embed
        one_layer = max(fit["alpha"] * sh + fit["beta"] * sm for sh, sm in features["tower_layer_sh_sm"])
        return fit["delta"] * features["layer_sh"] + embed + one_layer

    def activation_bytes_per_sample(self, fit: dict, checkpointing: bool, elem_bytes: int) -> float:
        return self.activation_elements_from(self.features(), fit, checkpointing) * elem_bytes + self.input_bytes(
            elem_bytes
        )


def load_fit(path=FIT_FILE) -> dict:
    """The fitted activation coefficients (alpha, beta, eps, delta)."""
    try:
        return json.loads(Path(path).read_text())["coefficients"]
    except (OSError, KeyError, ValueError) as e:
        raise PlanConfigError(
            f"activation fit {path} unreadable ({e}); regenerate it with: python bench/act_fit.py"
        ) from None


# ---------------------------------------------------------------------------------------------- validation


@dataclass
class Settings:
    """The validated numbers of a DeepSpeed config for one world size."""

    world: int
    micro_batch: int
    grad_accum: int
    train_batch: int
    stage: int
    precision: str
    comm_bytes: int
    reduce_bucket: int = 500_000_000
    allgather_bucket: int = 500_000_000
    overlap_comm: bool = False
    prefetch_bucket: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    offload_optimizer: bool = False
    offload_param: bool = False
    trainer_auto: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    contrastive_accumulation: bool = True  # the trainer's --contrastive_accumulation

    @property
    def contrastive_steps(self) -> int:
        """Micro-steps whose pairs one contrastive loss spans: K under contrastive accumulation, else 1."""
        return self.grad_accum if self.contrastive_accumulation else 1

    @property
    def contrastive_batch(self) -> int:
        return self.micro_batch * self.world * self.contrastive_steps


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def load_config(path) -> dict:
    """Read a DeepSpeed JSON with errors that point at the file and line."""
    path = Path(path)
    if not path.is_file():
        raise PlanConfigError(f"--deepspeed {path}: no such file")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanConfigError(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise PlanConfigError(f"{path}: the top level must be a JSON object, got {type(config).__name__}")
    return config


def _batch_numbers(config: dict, world: int, per_device_batch: int | None, problems: list, auto: list):
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
    if per_device_batch is not None:
        if micro is not None and micro != per_device_batch:
            problems.append(
                f"--per_device_batch {per_device_batch} contradicts train_micro_batch_size_per_gpu "
                f"{micro} in the config: drop the flag or change the config"
            )
        micro = per_device_batch
    if micro is None and train is not None:
        micro = train // (world * (accum or 1)) or None
    if micro is None:
        problems.append("no per-GPU batch: set train_micro_batch_size_per_gpu to an integer or pass --per_device_batch")
        return None
    accum = accum or (train // (micro * world) if train else 1) or 1
    train = train if train is not None else micro * accum * world
    if train != micro * accum * world:
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
    return train, micro, accum


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
    for key in config:
        if key not in KNOWN_TOP_LEVEL_KEYS:
            problems.append(
                f'unknown top-level key "{key}"{_suggest(key, KNOWN_TOP_LEVEL_KEYS)}; '
                "DeepSpeed would silently ignore it"
            )
    batch = _batch_numbers(config, world, per_device_batch, problems, auto)
    chosen = _precision(config, precision, problems, auto)
    kwargs = {"stage": 0}
    _zero_section(config, kwargs, problems, warnings, auto)
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
        _deepspeed_check(config, batch[1], batch[2], problems)
    if problems:
        raise PlanConfigError("DeepSpeed config problems:\n  - " + "\n  - ".join(problems))
    train, micro, accum = batch
    return Settings(
        world=world,
        micro_batch=micro,
        grad_accum=accum,
        train_batch=train,
        precision=chosen,
        comm_bytes=comm_bytes,
        trainer_auto=auto,
        warnings=warnings,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------- memory


def model_state_bytes(
    params: int,
    largest: int,
    stage: int,
    precision: str,
    world: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> dict:
    """Parameters, gradients and optimizer (Adam) states per GPU.

    Mixed precision (bf16/fp16), per parameter: 2 B 16-bit weights, 2 B 16-bit gradients, 4 B fp32 gradient
    partition, 12 B fp32 master weights + Adam m and v. ZeRO-1 partitions the fp32 parts, ZeRO-2 also the
    16-bit gradients, ZeRO-3 also the 16-bit weights (plus the largest layer gathered). For stages 2 and 3 the
    total is DeepSpeed's own estimate_zero{2,3}_model_states_mem_needs (2P + 18P/N; 4*largest + 18P/N, less
    what CPU offload moves off the GPU). fp32 training: 4 B weights, 4 B gradients, 8 B Adam states,
    partitioned the same way.
    """
    n, p = world, params
    if precision == "fp32":
        weights = 4 * p / n + 4 * largest if stage == 3 else 4 * p
        grads = 4 * p / n if stage >= 2 else 4 * p
        optim = 0.0 if offload_optimizer else (8 * p / n if stage >= 1 else 8 * p)
        return {"params": weights, "grads": grads, "optimizer": optim}
    weights = (2 * p / n + 4 * largest if stage == 3 else 2 * p) if not offload_param else 4 * largest
    optim = 0.0 if offload_optimizer else (12 * p / n if stage >= 1 else 12 * p)
    if stage in (2, 3):  # DeepSpeed's estimator is the reference total; gradients are what remains of it
        total = _deepspeed_estimate(p, largest, stage, n, offload_optimizer, offload_param)
        return {"params": weights, "grads": max(0.0, total - weights - optim), "optimizer": optim}
    grads = 2 * p + (0.0 if offload_optimizer else (4 * p / n if stage == 1 else 4 * p))
    return {"params": weights, "grads": grads, "optimizer": optim}


def _deepspeed_estimate(
    params: int, largest: int, stage: int, world: int, offload_optimizer: bool, offload_param: bool
) -> int:
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=offload_optimizer)[1]
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=world, cpu_offload=offload_optimizer, cpu_offload_params=offload_param
    )[1]


def zero_buffer_bytes(settings: Settings) -> float:
    """ZeRO's communication buckets. DeepSpeed allocates them at their configured size whatever the model's
    (ZeRO-1/2 reduce buffers, doubled with overlap_comm); its docs budget 4.5x the allgather_bucket_size and
    reduce_bucket_size values with overlap_comm, which is what is counted here. ZeRO-3: the prefetch and
    reduce buckets."""
    e = PRECISION_BYTES[settings.precision]
    if settings.stage == 0:
        return 0.0
    if settings.stage == 3:
        return settings.prefetch_bucket * e + settings.reduce_bucket * settings.comm_bytes
    buckets = settings.reduce_bucket * settings.comm_bytes + settings.allgather_bucket * e
    return buckets * (4.5 if settings.overlap_comm else 1.0)


def loss_bytes(impl: str, batch: int, world: int, dim: int, elem: int, chunk_size: int | None = None) -> float:
    """Peak working set of the CLIP loss on one rank: global batch `batch`, local rows b = batch/world.

    Counted from the code (bench/loss_bench.py's naive and twoblock, disco_clip_ds/loss.py's disco and tiled)
    and checked against the loss benchmark's measured peaks (tests/test_plan.py). G = one modality's gathered
    features, B x d x elem; rows = chunk_size or the loss's own default_chunk_size, at most b.
    naive (open_clip default): fp32 B x B logits, the two log-softmax outputs autograd keeps and their
      gradients: 4 B^2 fp32 at peak, plus 2 G.
    disco: per direction a b x B similarity block and its scaled logits (both kept by autograd), in backward
      their gradients and the softmax: 7 b x B fp32, plus 2 G, their gradients (2 G) and fp32 copies of bf16 keys.
    tiled (one block): G (texts only), their fp32 gradient (B x d) built in backward, an fp32 copy of bf16
      texts, four tile-sized fp32 buffers of rows x B (as measured: the logits, their exponentials and the
      temporaries of the reductions and gradient matmuls; with the default keep_bytes a kept block is one
      tile), the fp32 image gradient (b x d) and both local modalities' gradients (2 x b x d).
    twoblock (the earlier tiled loss, a benchmark baseline): 2 G, each direction's fp32 key gradient
      accumulated in the forward pass (2 x B x d fp32), one fp32 copy of bf16 keys at a time, two tiles, and
      the local rows' gradients that the reduce-scatter returns (2 x b x d).
    """
    from disco_clip_ds.loss import default_chunk_size

    b = batch / world
    gathered = batch * dim * elem
    fp32_keys = batch * dim * 4 if elem != 4 else 0
    rows = min(chunk_size or default_chunk_size(batch), b)
    if impl == "naive":
        return 2 * gathered + 4 * batch * batch * 4
    if impl == "disco":
        return 4 * gathered + 2 * fp32_keys + 7 * b * batch * 4
    if impl == "tiled":
        return gathered + batch * dim * 4 + fp32_keys + 4 * rows * batch * 4 + b * dim * (4 + 2 * elem)
    if impl == "twoblock":
        return 2 * gathered + 2 * batch * dim * 4 + fp32_keys + 2 * rows * batch * 4 + 2 * b * dim * elem
    raise PlanConfigError(f"--loss_impl must be one of {LOSS_IMPLS}, got {impl!r}")


@dataclass
class MemoryPlan:
    terms: dict  # name -> bytes per GPU
    total: float
    capacity: float

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def memory_plan(
    shape: ModelShape,
    settings: Settings,
    fit: dict,
    impl: str,
    checkpointing: bool,
    capacity: float,
    overhead: float = DEFAULT_OVERHEAD_GB * GiB,
    micro_batch: int | None = None,
    chunk_size: int | None = None,
) -> MemoryPlan:
    """Per-GPU memory of one training step (bytes), term by term."""
    micro = settings.micro_batch if micro_batch is None else micro_batch
    elem = PRECISION_BYTES[settings.precision]
    k = settings.contrastive_steps
    terms = model_state_bytes(
        shape.params,
        shape.largest_param,
        settings.stage,
        settings.precision,
        settings.world,
        settings.offload_optimizer,
        settings.offload_param,
    )
    terms["zero buffers"] = zero_buffer_bytes(settings)
    terms["activations"] = shape.activation_bytes_per_sample(fit, checkpointing, elem) * micro
    if k == 1:
        terms[f"loss ({impl})"] = loss_bytes(
            impl, micro * settings.world, settings.world, shape.projection_dim, elem, chunk_size
        )
    else:
        # The loss over all micro x world x K pairs runs on the cached embeddings in fp32, between the no-grad and
        # the grad passes (counted on top of the activations all the same: an upper bound). The cache: K x micro
        # image and text embeddings per rank in the training dtype plus their fp32 gradients, kept until replay.
        terms[f"loss ({impl})"] = loss_bytes(
            impl, micro * settings.world * k, settings.world, shape.projection_dim, 4, chunk_size
        )
        terms["cached embeddings"] = 2 * k * micro * shape.projection_dim * (elem + 4)
    # A parameter's gradient is produced whole before it is added to its buffer (the token embedding's is dense).
    terms["transient grad"] = shape.largest_param * elem
    terms["framework"] = overhead
    return MemoryPlan(terms, sum(terms.values()), capacity)


def max_micro_batch(shape, settings, fit, impl, checkpointing, capacity, overhead, chunk_size=None) -> int:
    """Largest per-GPU batch whose plan fits (0 if even 1 does not); memory grows monotonically with batch."""
    fits = lambda b: memory_plan(shape, settings, fit, impl, checkpointing, capacity, overhead, b, chunk_size).fits
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_contrastive_steps(
    shape, settings, fit, impl, checkpointing, capacity, overhead, chunk_size=None, limit: int = 1 << 20
) -> int:
    """Largest K whose plan fits at the config's micro batch under contrastive accumulation (0 if K=1 does not):
    the largest contrastive batch for this GPU count is micro x world x K."""
    fits = lambda k: (
        memory_plan(
            shape,
            replace(settings, grad_accum=k, contrastive_accumulation=True),
            fit,
            impl,
            checkpointing,
            capacity,
            overhead,
            None,
            chunk_size,
        ).fits
    )
    return _largest(fits, limit)


def _largest(fits, limit: int) -> int:
    """Largest n in [1, limit] with fits(n), for monotone fits; 0 if none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ------------------------------------------------------------------------------------------------ traffic


def traffic_bytes(shape: ModelShape, settings: Settings, loss_impls=("disco", "tiled")) -> dict:
    """Bytes one rank sends per optimizer step (ring collectives), by collective; the loss's per impl."""
    n, p, accum = settings.world, shape.params, settings.grad_accum
    ring = (n - 1) / n
    e = PRECISION_BYTES[settings.precision]
    g = settings.comm_bytes
    if settings.stage == 0:
        grads = {"gradient all-reduce": 2 * ring * p * g}
    elif settings.stage == 1:  # reduce-scatter at the accumulation boundary, then all-gather updated weights
        grads = {"gradient reduce-scatter": ring * p * g, "parameter all-gather": ring * p * e}
    elif settings.stage == 2:  # gradients reduced in every micro-step's backward
        grads = {"gradient reduce-scatter": accum * ring * p * g, "parameter all-gather": ring * p * e}
    else:  # weights gathered for forward and again for backward in every micro-step (and for the no-grad pass)
        gathers = 3 if settings.contrastive_steps > 1 else 2
        grads = {
            "gradient reduce-scatter": accum * ring * p * g,
            "parameter all-gather": accum * gathers * ring * p * e,
        }
    # contrastive accumulation gathers all K micro-batches' fp32 embeddings at once: the same rows, fp32 bytes
    feature_bytes = 4 if settings.contrastive_steps > 1 else e
    batch = settings.micro_batch * n
    modality = accum * ring * batch * shape.projection_dim * feature_bytes  # one modality's rows
    loss = {
        "naive": {"naive loss: feature all-gather (forward)": 2 * modality},
        "disco": {
            "disco loss: feature all-gather (forward)": 2 * modality,
            "disco loss: feature reduce-scatter (backward)": 2 * modality,
            "(paper: feature all-reduce in backward)": 4 * modality,
        },
        "tiled": {
            "tiled loss: text all-gather (forward)": modality,
            "tiled loss: column lse all-reduces (forward)": accum * 2 * 2 * ring * batch * 4,
            "tiled loss: text reduce-scatter (backward)": modality,
        },
    }
    return {**grads, **{k: v for impl in loss_impls for k, v in loss[impl].items()}}


# --------------------------------------------------------------------------------------------------- report


def parse_memory(text: str) -> float:
    """'40GB', '40GiB', '80 GB', '40' (GiB) -> bytes. GPU vendors' 'GB' is GiB in practice (A100 40GB = 40 GiB)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(G|GB|GiB|M|MB|MiB|T|TB|TiB)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise PlanConfigError(f"--gpu_memory {text!r}: write it as e.g. 40GB or 80GiB")
    unit = (match.group(2) or "G")[0].upper()
    return float(match.group(1)) * {"M": 2**20, "G": GiB, "T": 2**40}[unit]


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:8.2f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / 2**20:8.1f} MiB"


def plan(
    config_path,
    model_path,
    gpus: int,
    gpu_memory: str,
    per_device_batch=None,
    precision=None,
    activation_checkpointing=False,
    loss_impls=LOSS_IMPLS,
    chunk_size=None,
    overhead_gb: float = DEFAULT_OVERHEAD_GB,
    contrastive_accumulation: bool = True,
) -> dict:
    """Validate and plan; returns a JSON-able dict (what `disco-clip plan --json` writes)."""
    settings = validate_config(load_config(config_path), gpus, per_device_batch, precision)
    settings.contrastive_accumulation = contrastive_accumulation
    shape = ModelShape.from_json(model_path)
    fit, capacity, overhead = load_fit(), parse_memory(gpu_memory), overhead_gb * GiB
    out = {
        "settings": asdict(settings),
        "model": {"params": shape.params, "largest_param": shape.largest_param},
        "global_batch": settings.contrastive_batch,
        "contrastive_steps": settings.contrastive_steps,
        "capacity_bytes": capacity,
        "overhead_bytes": overhead,
        "activation_checkpointing": activation_checkpointing,
        "memory": {},
        "max_micro_batch": {},
        "max_contrastive_steps": {},
        "traffic": traffic_bytes(shape, settings, loss_impls),
    }
    for impl in loss_impls:
        mem = memory_plan(shape, settings, fit, impl, activation_checkpointing, capacity, overhead, None, chunk_size)
        out["memory"][impl] = {"terms": mem.terms, "total": mem.total, "fits": mem.fits}
        out["max_micro_batch"][impl] = max_micro_batch(
            shape, settings, fit, impl, activation_checkpointing, capacity, overhead, chunk_size
        )
        if contrastive_accumulation:
            out["max_contrastive_steps"][impl] = max_contrastive_steps(
                shape, settings, fit, impl, activation_checkpointing, capacity, overhead, chunk_size
            )
    return out


def format_report(result: dict, config_path, model_path) -> str:
    s, impls = result["settings"], list(result["memory"])
    lines = [
        f"config {config_path}: OK for {s['world']} GPUs: micro batch {s['micro_batch']} x grad accum "
        f"{s['grad_accum']} x {s['world']} = train batch {s['train_batch']}; contrastive batch "
        f"{result['global_batch']} "
        + (
            f"(micro x world x {result['contrastive_steps']}: contrastive accumulation)"
            if result["contrastive_steps"] > 1
            else "per micro-step"
        )
        + f"; ZeRO-{s['stage']}, {s['precision']}",
        f"model {model_path}: {result['model']['params'] / 1e6:.1f} M parameters; activation checkpointing "
        f"{'on' if result['activation_checkpointing'] else 'off'}; Adam states; framework overhead "
        f"{result['overhead_bytes'] / GiB:.1f} GiB assumed (CUDA context, NCCL, allocator; --overhead_gb)",
    ]
    lines += [f"note: {w}" for w in s["warnings"]] + [f"needs the HF Trainer: {a}" for a in s["trainer_auto"]]
    lines += [
        "",
        f"per-GPU memory (of {result['capacity_bytes'] / GiB:.0f} GiB)".ljust(30) + "".join(f"{i:>14}" for i in impls),
    ]
    names = [n for n in result["memory"][impls[0]]["terms"] if not n.startswith("loss")] + ["loss"]
    for name in names:
        cells = []
        for impl in impls:
            terms = result["memory"][impl]["terms"]
            cells.append(_fmt(terms[f"loss ({impl})"] if name == "loss" else terms[name]))
        lines.append(f"  {name:<28}" + "".join(f"{c:>14}" for c in cells))
    lines.append(f"  {'total':<28}" + "".join(f"{_fmt(result['memory'][i]['total']):>14}" for i in impls))
    lines.append(
        f"  {'verdict':<28}" + "".join(f"{'fits' if result['memory'][i]['fits'] else 'OOM':>14}" for i in impls)
    )
    lines.append(f"  {'largest per-GPU batch':<28}" + "".join(f"{result['max_micro_batch'][i]:>14}" for i in impls))
    k = result["contrastive_steps"]
    lines.append(
        f"  {'  = contrastive batch':<28}"
        + "".join(f"{result['max_micro_batch'][i] * s['world'] * k:>14}" for i in impls)
    )
    if result["max_contrastive_steps"]:
        steps = result["max_contrastive_steps"]
        lines.append(f"  {'largest K at this micro':<28}" + "".join(f"{steps[i]:>14}" for i in impls))
        lines.append(
            f"  {'  = contrastive batch':<28}"
            + "".join(f"{steps[i] * s['micro_batch'] * s['world']:>14}" for i in impls)
        )
    lines += ["", f"bytes sent per rank per optimizer step ({s['world']} ranks, ring collectives):"]
    lines += [f"  {name:<46}{_fmt(v)}" for name, v in result["traffic"].items()]
    return "\n".join(lines)


def _parse(argv):
    import argparse

    # argparse rather than HfArgumentParser: nothing here is a TrainingArguments field, and `plan` must
    # answer bad arguments before importing transformers.
    p = argparse.ArgumentParser(prog="disco-clip plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config")
    p.add_argument("--model", required=True, help="CLIPConfig JSON, e.g. recipes/models/vit_b32.json")
    p.add_argument("--gpus", type=int, required=True, help="data-parallel world size")
    p.add_argument("--gpu_memory", default="40GB", help="memory per GPU, e.g. 40GB, 80GB")
    p.add_argument("--per_device_batch", type=int, help='per-GPU micro batch (when the config says "auto")')
    p.add_argument("--precision", choices=sorted(PRECISION_BYTES), help='must match the config (fills "auto")')
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument(
        "--loss_impl", choices=BENCH_LOSS_IMPLS, action="append", help=f"repeatable; default: {', '.join(LOSS_IMPLS)}"
    )
    p.add_argument("--chunk_size", type=int, help="tiled loss rows per tile (default: the loss's own)")
    p.add_argument("--overhead_gb", type=float, default=DEFAULT_OVERHEAD_GB, help="framework overhead per GPU")
    p.add_argument(
        "--no_contrastive_accumulation",
        dest="contrastive_accumulation",
        action="store_false",
        help="plan for `train --contrastive_accumulation false`: the contrastive batch is micro x world",
    )
    p.add_argument("--json", help="also write the plan as JSON to this path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """`disco-clip plan`: exit 0 when every requested loss fits, 1 when one does not, 2 on a bad config."""
    args = _parse(argv)
    try:
        result = plan(
            args.deepspeed,
            args.model,
            args.gpus,
            args.gpu_memory,
            args.per_device_batch,
            args.precision,
            args.activation_checkpointing,
            tuple(args.loss_impl or LOSS_IMPLS),
            args.chunk_size,
            args.overhead_gb,
            args.contrastive_accumulation,
        )
    except PlanConfigError as e:
        print(f"disco-clip plan: {e}", file=sys.stderr)
        return 2
    print(format_report(result, args.deepspeed, args.model))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(m["fits"] for m in result["memory"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
