"""Plan a run before launch: validate a DeepSpeed config, estimate per-GPU memory and per-rank traffic.

    disco-clip plan --deepspeed ds_configs/vit_b32_32k_8gpu.json --model recipes/models/vit_b32.json \
        --gpus 8 --gpu_memory 40GB [--per_device_batch B --precision bf16 --activation_checkpointing --loss_impl tiled]
    (--model recipes/models/siglip_b16.json plans SigLIP's sigmoid loss)

checks.py reads and validates the config for a world size; memory.py counts each GPU's memory term by term and finds
the largest batch that fits; traffic.py counts the bytes each rank sends; storage.py the bytes a reinforced set
(`data embed`) stores per sample; report.py puts them together (`plan`), prints the table and is the command
(`main`). The losses planned are the ones the package ships for the model's
family (FAMILY_IMPLS: CLIP's softmax loss, SigLIP's sigmoid loss).
"""

from disco_clip_ds import LOSS_IMPLS
from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan.checks import KNOWN_TOP_LEVEL_KEYS, read_deepspeed_json, validate_config
from disco_clip_ds.plan.memory import (
    DEFAULT_OVERHEAD_GB,
    FAMILY_IMPLS,
    FIT_FILE,
    PRECISION_BYTES,
    GiB,
    MemoryPlan,
    ModelShape,
    Settings,
    load_fit,
    loss_bytes,
    max_contrastive_steps,
    max_micro_batch,
    memory_plan,
    model_state_bytes,
    zero_buffer_bytes,
)
from disco_clip_ds.plan.report import format_report, parse_memory, plan
from disco_clip_ds.plan.storage import StoragePlan, format_storage, storage_plan
from disco_clip_ds.plan.traffic import traffic_bytes

__all__ = [
    "DEFAULT_OVERHEAD_GB",
    "FAMILY_IMPLS",
    "FIT_FILE",
    "GiB",
    "KNOWN_TOP_LEVEL_KEYS",
    "LOSS_IMPLS",
    "PRECISION_BYTES",
    "MemoryPlan",
    "ModelShape",
    "PlanConfigError",
    "Settings",
    "StoragePlan",
    "format_report",
    "format_storage",
    "read_deepspeed_json",
    "load_fit",
    "loss_bytes",
    "max_contrastive_steps",
    "max_micro_batch",
    "memory_plan",
    "model_state_bytes",
    "parse_memory",
    "plan",
    "storage_plan",
    "traffic_bytes",
    "validate_config",
    "zero_buffer_bytes",
]
