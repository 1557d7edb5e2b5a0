"""The start-up check of host memory: the run's own facts (ranks on this node, DataLoader workers, shuffle buffers,
mixed sources, the stored embeddings' rows, the model's parameters, the DeepSpeed stage and offload) put through the
planner's formula (plan/host.py), logged on rank 0, with a warning when it passes this node's memory (MemTotal)."""

from __future__ import annotations

import logging
import os

from disco_clip_ds.data.embeddings import read_metadata, sidecar_path
from disco_clip_ds.data.shards import is_url
from disco_clip_ds.distributed.ranks import ranks_per_node
from disco_clip_ds.plan.host import (
    DEFAULT_SAMPLE_BYTES,
    HostSettings,
    format_host,
    host_memory_plan,
    model_state_host_bytes,
    node_memory_bytes,
)
from disco_clip_ds.plan.memory import embedding_width

logger = logging.getLogger(__name__)


def host_settings(args, data_args, checked, on_device: bool, image_elements: int) -> HostSettings:
    """The run's HostSettings: this node's ranks (the launcher's LOCAL_WORLD_SIZE), its DataLoader settings, the
    mean bytes of a sample in its local shards, and the stored embeddings' row (with --teacher_embeddings)."""
    ranks = ranks_per_node()
    row, width = stored_row(checked)
    return HostSettings(
        ranks_per_node=ranks,
        workers=args.dataloader_num_workers,
        micro_batch=args.per_device_train_batch_size,
        image_elements=image_elements,
        text_length=checked.max_length,
        pixel_bytes=1 if on_device else 4,
        prefetch_factor=args.dataloader_prefetch_factor or 2,  # torch's default with workers
        pin_memory=bool(args.dataloader_pin_memory) and args.device.type == "cuda",
        shuffle_buffer=data_args.shuffle_buffer,
        sources=len(checked.mixture.sources) if checked.mixture is not None else 1,
        sample_bytes=sample_bytes(checked.urls, checked.num_samples),
        stored_row_bytes=row,
        target_width=width,
    )


def sample_bytes(urls: list[str], samples: int) -> int:
    """A raw sample's mean bytes: the local shards' size over their samples (else the planner's default)."""
    if not urls or samples < 1 or any(is_url(u) for u in urls):
        return DEFAULT_SAMPLE_BYTES
    try:
        return max(1, sum(os.path.getsize(u) for u in urls) // samples)
    except OSError:
        return DEFAULT_SAMPLE_BYTES


def stored_row(checked) -> tuple[int, int]:
    """(bytes of one sample's stored row, summed teacher widths) of --teacher_embeddings; (0, 0) without."""
    store = checked.teacher_store
    if store is None:
        return 0, 0
    from disco_clip_ds.data.embeddings import stored_row_bytes

    widths = [embedding_width(config) for config in checked.teacher_config]
    dtype = read_metadata(sidecar_path(store.folder, checked.urls[0])).get("dtype", "float32")
    return stored_row_bytes(widths, store.augmentations, len(store.caption_keys), dtype), sum(widths)


def log_host_memory(args, data_args, checked, model, teacher, on_device: bool) -> dict:
    """Log the host memory per node of this run on rank 0, and warn when it passes this node's memory; returns
    plan/host.py's dict ({"settings", "plan"}) on every rank."""
    from dataclasses import asdict

    v = model.config.vision_config
    if checked.naflex is not None:  # SigLIP 2: a grid of `budget` patches per image
        patch, budget = checked.naflex
        image = v.num_channels * patch * patch * budget
    else:
        image = v.num_channels * checked.image_size**2
    host = host_settings(args, data_args, checked, on_device, image)
    params = list(model.parameters())
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions: the whole tensor's count
    zero = (checked.deepspeed or {}).get("zero_optimization", {})
    states = model_state_host_bytes(
        sum(map(numel, params)),
        max(map(numel, params)),
        int(zero.get("stage", 0)),
        args.world_size,
        host.ranks_per_node,
        (zero.get("offload_optimizer") or {}).get("device") == "cpu",
        (zero.get("offload_param") or {}).get("device") == "cpu",
    )
    live = sum(map(numel, teacher.parameters())) if hasattr(teacher, "parameters") else 0
    plan = host_memory_plan(host, states, live, node_memory_bytes()).as_dict()
    result = {"settings": asdict(host), "plan": plan}
    if args.process_index == 0:
        lines = format_host(result)
        logger.info("\n".join(line for line in lines if not line.startswith("warning: ")))
        if not plan["fits"]:
            logger.warning(lines[-1].removeprefix("warning: "))
    return result
