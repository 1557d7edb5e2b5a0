"""Plan a run before launch: validate a DeepSpeed config, estimate per-GPU memory and per-rank traffic.

`disco-clip plan` (and `python -m disco_clip_ds.plan`): the arguments of plan.report.plan, its table printed, and
the plan as JSON on request; exit 0 when every requested loss fits (at every stage of a schedule), 1 when one does
not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from disco_clip_ds import LOSS_IMPLS
from disco_clip_ds.cli import ArgumentParser, DefaultsOnce
from disco_clip_ds.errors import UsageError
from disco_clip_ds.plan.host import DEFAULT_SAMPLE_BYTES, HostOptions
from disco_clip_ds.plan.memory import DEFAULT_OVERHEAD_GB, PRECISION_BYTES
from disco_clip_ds.plan.report import OPTIMIZER_MOMENTS, format_report, plan
from disco_clip_ds.plan.trainable import LOCK_ARGUMENTS


def _parse(argv):

    # argparse rather than HfArgumentParser: nothing here is a TrainingArguments field, and `plan` must
    # answer bad arguments before importing transformers.
    p = ArgumentParser(formatter_class=DefaultsOnce, prog="disco-clip plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config")
    p.add_argument("--model", required=True, help="CLIPConfig or SiglipConfig JSON, e.g. recipes/models/vit_b32.json")
    p.add_argument("--gpus", type=int, required=True, help="data-parallel world size")
    p.add_argument("--gpu_memory", default="40GB", help="memory per GPU, e.g. 40GB, 80GB")
    p.add_argument("--per_device_batch", type=int, help='per-GPU micro batch (when the config says "auto")')
    p.add_argument("--precision", choices=sorted(PRECISION_BYTES), help='must match the config (fills "auto")')
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument(
        "--loss_impl",
        choices=LOSS_IMPLS,
        action="append",
        help="repeatable; default: every one the model's loss has (CLIP: tiled, disco, local; SigLIP: tiled, local)",
    )
    p.add_argument(
        "--optim",
        choices=sorted(OPTIMIZER_MOMENTS),
        default="adamw_torch",
        help="as `disco-clip train --optim`: AdamW and LAMB both keep two fp32 moments per trained parameter",
    )
    p.add_argument("--chunk_size", type=int, help="tiled loss rows per tile (default: the loss's own)")
    p.add_argument("--overhead_gb", type=float, default=DEFAULT_OVERHEAD_GB, help="framework overhead per GPU")
    p.add_argument(
        "--no_contrastive_accumulation",
        dest="contrastive_accumulation",
        action="store_false",
        help="plan for `train --contrastive_accumulation false`: the contrastive batch is micro x world",
    )
    p.add_argument(
        "--patch_dropout",
        type=float,
        default=0.0,
        help="fraction of image patches dropped in training (as `disco-clip train --patch_dropout`)",
    )
    p.add_argument(
        "--max_num_patches",
        type=int,
        help="SigLIP 2 (NaFlex): patches per image, as `disco-clip train --max_num_patches` (default: the grid)",
    )
    p.add_argument(
        "--resolution_schedule",
        help="progressive resolution, as `disco-clip train --resolution_schedule` (e.g. 0:98,0.35:154,0.7:224): "
        "each stage's memory and FLOPs, and the schedule's FLOPs against the last size throughout",
    )
    p.add_argument(
        "--stage_micro_batch_sizes",
        help="each stage's micro-batch per GPU, as `disco-clip train --stage_micro_batch_sizes` (e.g. 256,128,64): "
        "each stage's memory planned at it, with micro x accumulation steps kept",
    )
    p.add_argument(
        "--teacher",
        help="a distillation teacher's config JSON (as `disco-clip train --teacher`): its frozen weights (sharded "
        "under ZeRO-3), forward and embeddings are counted",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="plan for `disco-clip train --ema_decay D`: an fp32 EMA of the trainable weights, sharded like them",
    )
    _lock_arguments(p)
    _host_arguments(p)
    p.add_argument("--json", help="also write the plan as JSON to this path")
    return p.parse_args(argv)


def _lock_arguments(p) -> None:
    """`disco-clip train`'s locking flags: frozen parameters have weights but no gradients and no optimizer state."""
    for flag, tower in (("lock_image_tower", "vision"), ("lock_text_tower", "text")):
        p.add_argument(f"--{flag}", action="store_true", help=f"plan with the {tower} tower locked (frozen)")
        p.add_argument(
            f"--{flag}_unlocked_layers",
            type=int,
            metavar="N",
            help=f"with --{flag}: its last N encoder layers, post-norm, head and projection train, as in training",
        )
    p.add_argument(
        "--lock_image_tower_freeze_norm",
        action="store_true",
        help="with --lock_image_tower_unlocked_layers: the vision tower's LayerNorms stay frozen, as in training",
    )


def _host_arguments(p) -> None:
    """Host memory per node (plan/host.py): the ranks, DataLoader workers, shuffle buffers and stored embeddings."""
    p.add_argument("--gpus_per_node", type=int, help="ranks on one node (default: --gpus, at most 8)")
    p.add_argument("--node_memory_gb", type=float, help="a node's memory in GiB, to compare the host memory with")
    p.add_argument("--dataloader_num_workers", type=int, default=2, help="as `disco-clip train`: workers per rank")
    p.add_argument("--dataloader_prefetch_factor", type=int, default=2, help="batches each worker prepares ahead")
    p.add_argument(
        "--no_dataloader_pin_memory",
        dest="pin_memory",
        action="store_false",
        help="plan for `train --dataloader_pin_memory false`: no page-locked copy of the batches in flight",
    )
    p.add_argument("--shuffle_buffer", type=int, default=1000, help="as `disco-clip train`: raw samples per block")
    p.add_argument("--train_sources", type=int, default=1, help="'::' sources of --train_shards (a shuffle each)")
    p.add_argument(
        "--sample_bytes", type=int, default=DEFAULT_SAMPLE_BYTES, help="a raw sample's bytes in the shards (JPEG, text)"
    )
    p.add_argument(
        "--teacher_embeddings",
        action="store_true",
        help="plan for `train --teacher_embeddings DIR`: the stored embeddings are read (each worker's store at its "
        "bound), no teacher weights",
    )
    p.add_argument("--augmentations", type=int, default=0, help="with --teacher_embeddings: K stored per sample")
    p.add_argument("--caption_keys", type=int, default=1, help="with --teacher_embeddings: captions stored per sample")
    p.add_argument("--embedding_dtype", default="float32", help="with --teacher_embeddings: the stored dtype")
    p.add_argument(
        "--teacher_widths",
        type=int,
        nargs="+",
        default=(),
        help="with --teacher_embeddings: each stored teacher's embedding width (default: --teacher's projection)",
    )


def _check_arguments(args) -> None:
    """A one-line UsageError for an --overhead_gb that is not finite or is negative (NaN would print NaN totals),
    and for a --json path that is a folder or lies in a folder that does not exist. (--node_memory_gb is checked
    with the host's other figures, plan/host.py.)"""
    if not (math.isfinite(args.overhead_gb) and args.overhead_gb >= 0):
        raise UsageError(f"--overhead_gb {args.overhead_gb}: give a finite number of GiB, 0 or more")
    if args.json:
        path = Path(args.json)
        if path.is_dir():
            raise UsageError(f"--json {args.json}: a folder; give the path of the JSON file to write, e.g. plan.json")
        if not path.parent.is_dir():
            raise UsageError(f"--json {args.json}: the folder {path.parent} does not exist")


def _host_options(args) -> HostOptions:
    return HostOptions(
        gpus_per_node=args.gpus_per_node,
        node_memory_gb=args.node_memory_gb,
        workers=args.dataloader_num_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
        pin_memory=args.pin_memory,
        shuffle_buffer=args.shuffle_buffer,
        sources=args.train_sources,
        sample_bytes=args.sample_bytes,
        teacher_embeddings=args.teacher_embeddings,
        augmentations=args.augmentations,
        caption_keys=args.caption_keys,
        embedding_dtype=args.embedding_dtype,
        teacher_widths=tuple(args.teacher_widths),
    )


def main(argv: list[str] | None = None) -> int:
    """`disco-clip plan`: 0 when every requested loss fits (at each stage of a schedule), 1 when one does not; a bad
    config raises PlanConfigError, a bad flag a UsageError, before any planning."""
    args = _parse(argv)
    _check_arguments(args)
    result = plan(
        args.deepspeed,
        args.model,
        args.gpus,
        args.gpu_memory,
        args.per_device_batch,
        args.precision,
        args.activation_checkpointing,
        args.loss_impl,
        args.chunk_size,
        args.overhead_gb,
        args.contrastive_accumulation,
        args.patch_dropout,
        {name: getattr(args, name) for name in LOCK_ARGUMENTS},
        args.teacher,
        args.max_num_patches,
        args.ema,
        _host_options(args),
        resolution_schedule=args.resolution_schedule,
        stage_micro_batch_sizes=args.stage_micro_batch_sizes,
        optim=args.optim,
    )
    print(format_report(result, args.deepspeed, args.model))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        except OSError as error:  # the checks above cannot foresee every one (permissions, a full disk)
            raise UsageError(f"--json {args.json}: cannot write the plan there ({error.strerror})") from None
    stages = result.get("resolution_stages", {}).get("stages", [])  # every stage must fit too, at its micro-batch
    fits = [m["fits"] for m in result["memory"].values()] + [f for stage in stages for f in stage["fits"].values()]
    return 0 if all(fits) else 1
