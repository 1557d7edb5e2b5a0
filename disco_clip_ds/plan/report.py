"""Plan a run before launch: validate a DeepSpeed config, estimate per-GPU memory and per-rank traffic.

`plan()` gathers the checks, memory and traffic of each loss into one JSON-able dict; `format_report` prints it as a
table. The command is commands/plan.py (`disco-clip plan`); bad inputs raise `PlanConfigError` (exit 2 through
`disco_clip_ds.errors.run_main`).
"""

from __future__ import annotations

import re
from dataclasses import asdict

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan.checks import read_deepspeed_json, validate_config
from disco_clip_ds.plan.fixes import fitting_changes
from disco_clip_ds.plan.flops import at_size
from disco_clip_ds.plan.host import HostOptions, format_host, plan_host
from disco_clip_ds.plan.memory import (
    DEFAULT_OVERHEAD_GB,
    FAMILY_IMPLS,
    GiB,
    ModelShape,
    load_fit,
    max_contrastive_steps,
    max_micro_batch,
    memory_plan,
)
from disco_clip_ds.plan.stages import format_stages, plan_stages, schedule_stages, stage_micro_batches
from disco_clip_ds.plan.traffic import traffic_bytes


def parse_memory(text: str) -> float:
    """'40GB', '40GiB', '80 GB', '40' (GiB) -> bytes. GPU vendors' 'GB' is GiB in practice (A100 40GB = 40 GiB)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(G|GB|GiB|M|MB|MiB|T|TB|TiB)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise PlanConfigError(f"--gpu_memory {text!r}: write it as e.g. 40GB or 80GiB")
    unit = (match.group(2) or "G")[0].upper()
    nbytes = float(match.group(1)) * {"M": 2**20, "G": GiB, "T": 2**40}[unit]
    if nbytes <= 0:
        raise PlanConfigError(f"--gpu_memory {text!r}: a GPU's memory is more than 0, e.g. 40GB or 80GiB")
    return nbytes


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:8.2f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / 2**20:8.1f} MiB"


# The fp32 moments each trained parameter keeps, by `disco-clip train --optim`: what memory.model_state_bytes counts
# (m and v, 8 bytes). LAMB (train/lamb.py) keeps Adam's two; its trust ratios are computed from them at each step and
# never stored.
OPTIMIZER_MOMENTS = {"adamw_torch": 2, "adamw_torch_fused": 2, "lamb": 2}


def optimizer_states(name: str) -> str:
    """How the report names the optimizer states it counts."""
    kind = "LAMB" if name == "lamb" else "AdamW"
    return f"{kind} states ({OPTIMIZER_MOMENTS[name]} fp32 moments per trained parameter" + (
        ", as Adam)" if name == "lamb" else ")"
    )


def plan(
    config_path,
    model_path,
    gpus: int,
    gpu_memory: str,
    per_device_batch=None,
    precision=None,
    activation_checkpointing=False,
    loss_impls=None,
    chunk_size=None,
    overhead_gb: float = DEFAULT_OVERHEAD_GB,
    contrastive_accumulation: bool = True,
    patch_dropout: float = 0.0,
    lock_flags: dict | None = None,
    teacher_path=None,
    max_num_patches: int | None = None,
    ema: bool = False,
    host: HostOptions | None = None,
    optim: str = "adamw_torch",
    resolution_schedule: str | None = None,
    stage_micro_batch_sizes: str | None = None,
) -> dict:
    """Validate and plan; returns a JSON-able dict (what `disco-clip plan --json` writes). `lock_flags`: the locking
    flags of `disco-clip train` ({name: value}, plan.trainable.LOCK_ARGUMENTS), whose frozen parameters get no
    gradients and no optimizer state; `host`: the host-memory options (plan/host.py; default: HostOptions());
    `optim`: `train --optim` (OPTIMIZER_MOMENTS); `resolution_schedule`: as `disco-clip train`'s, the model planned
    at its last size and each stage at its own, with its micro-batch under `stage_micro_batch_sizes`."""
    if stage_micro_batch_sizes and not resolution_schedule:
        raise PlanConfigError("--stage_micro_batch_sizes sets each --resolution_schedule stage's: give the schedule")
    settings = validate_config(read_deepspeed_json(config_path), gpus, per_device_batch, precision)
    settings.contrastive_accumulation = contrastive_accumulation
    settings.ema = ema  # `train --ema_decay`: the EMA's fp32 copy of this rank's partition
    if not 0 <= patch_dropout < 1:
        raise PlanConfigError(f"--patch_dropout {patch_dropout:g}: give a fraction at least 0 and below 1")
    shape = ModelShape.from_json(model_path, lock_flags, max_num_patches).with_patch_dropout(patch_dropout)
    stages = schedule_stages(resolution_schedule, shape) if resolution_schedule else None
    shape = at_size(shape, stages[-1][1]) if stages else shape
    teacher = ModelShape.from_json(teacher_path) if teacher_path else None
    if teacher is not None and teacher.loss != shape.loss:
        raise PlanConfigError(f"--teacher {teacher_path}: a {teacher.loss} model cannot teach a {shape.loss} one")
    # default: every one the model's loss has (but the local loss, which cannot distil the global batch)
    loss_impls = tuple(loss_impls or (i for i in FAMILY_IMPLS[shape.loss] if teacher is None or i != "local"))
    for impl in loss_impls:
        shape.check_impl(impl)
    fit, capacity, overhead = load_fit(), parse_memory(gpu_memory), overhead_gb * GiB
    out = {
        "settings": asdict(settings),
        "model": {
            "params": shape.params,
            "largest_param": shape.largest_param,
            "trainable": shape.trainable,
            "loss": shape.loss,
            "patch_dropout": patch_dropout,
            "vision_layer_tokens": shape.layer_tokens(shape.towers["vision"]),
            "vision_tokens": shape.towers["vision"]["tokens"],
            "patches_per_image": shape.patches,
            "training_flops_per_sample": shape.training_flops_per_sample(),
            "teacher_params": teacher.params if teacher is not None else None,
        },
        "optimizer": {"name": optim, "fp32_moments_per_parameter": OPTIMIZER_MOMENTS[optim]},
        "global_batch": settings.contrastive_batch,
        "contrastive_steps": settings.contrastive_steps,
        "capacity_bytes": capacity,
        "overhead_bytes": overhead,
        "activation_checkpointing": activation_checkpointing,
        "memory": {},
        "max_micro_batch": {},
        "max_contrastive_steps": {},
        "traffic": traffic_bytes(shape, settings, loss_impls),
        "host": plan_host(shape, settings, teacher, host or HostOptions()),
    }
    for impl in loss_impls:
        if teacher is not None and impl == "local":
            raise PlanConfigError("--teacher distils the global batch: plan --loss_impl tiled (or disco)")
        plan_args = (shape, settings, fit, impl, activation_checkpointing, capacity, overhead)
        mem = memory_plan(*plan_args, None, chunk_size, teacher)
        out["memory"][impl] = {"terms": mem.terms, "total": mem.total, "fits": mem.fits}
        if not mem.fits:  # what would make it fit, each change planned again (plan/fixes.py)
            out.setdefault("to_fit", {})[impl] = fitting_changes(*plan_args, chunk_size, teacher)
        out["max_micro_batch"][impl] = max_micro_batch(*plan_args, chunk_size, teacher)
        if contrastive_accumulation and impl != "local":
            out["max_contrastive_steps"][impl] = max_contrastive_steps(*plan_args, chunk_size, teacher=teacher)
    if stages:
        rest = (activation_checkpointing, capacity, overhead, None, chunk_size, teacher)

        def memory(stage, batch) -> dict:
            planned = {i: memory_plan(stage, batch, fit, i, *rest) for i in loss_impls}
            return {i: (m.total, m.fits) for i, m in planned.items()}

        micro = stage_micro_batches(stage_micro_batch_sizes, len(stages), settings)
        out["resolution_stages"] = plan_stages(stages, shape, memory, settings, micro)
    return out


def _parameters(model: dict) -> str:
    """'151.3 M parameters', and how many of them train when towers are locked."""
    counted = f"{model['params'] / 1e6:.1f} M parameters"
    trainable = model.get("trainable", model["params"])
    if trainable == model["params"]:
        return counted
    return f"{counted} ({trainable / 1e6:.1f} M trainable: gradients and Adam states for those only)"


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
        f"model {model_path}: {_parameters(result['model'])}, {result['model']['loss']} loss; "
        "activation checkpointing "
        f"{'on' if result['activation_checkpointing'] else 'off'}; "
        f"{optimizer_states(result['optimizer']['name'])}; framework overhead "
        f"{result['overhead_bytes'] / GiB:.1f} GiB assumed (CUDA context, NCCL, allocator; --overhead_gb)",
    ]
    model, flops = result["model"], result["model"]["training_flops_per_sample"]
    lines.append(
        f"training compute per sample: {sum(flops.values()) / 1e9:.1f} GFLOP (vision {flops['vision'] / 1e9:.1f} at "
        f"{model['vision_layer_tokens']} of {model['vision_tokens']} tokens"
        + (f", patch dropout {model['patch_dropout']:g}" if model["patch_dropout"] else "")
        + f"; text {flops['text'] / 1e9:.1f}); times the contrastive batch per optimizer step"
    )
    lines += [f"note: {w}" for w in s["warnings"]] + [f"needs the HF Trainer: {a}" for a in s["trainer_auto"]]
    if result["contrastive_steps"] > 1 and "local" in impls:
        lines.append("note: local contrasts each micro-batch alone: planned as `--contrastive_accumulation false`")
    lines += [
        "",
        f"per-GPU memory (of {result['capacity_bytes'] / GiB:.0f} GiB)".ljust(30) + "".join(f"{i:>14}" for i in impls),
    ]
    # every impl's terms in order ("cached embeddings" is not the local loss's), its loss last under one name
    names = dict.fromkeys(n for i in impls for n in result["memory"][i]["terms"] if not n.startswith("loss"))
    for name in [*names, "loss"]:
        cells = []
        for impl in impls:
            terms = result["memory"][impl]["terms"]
            name_here = f"loss ({impl})" if name == "loss" else name
            cells.append(_fmt(terms[name_here]) if name_here in terms else "-")
        lines.append(f"  {name:<28}" + "".join(f"{c:>14}" for c in cells))
    lines.append(f"  {'total':<28}" + "".join(f"{_fmt(result['memory'][i]['total']):>14}" for i in impls))
    lines.append(
        f"  {'verdict':<28}" + "".join(f"{'fits' if result['memory'][i]['fits'] else 'OOM':>14}" for i in impls)
    )
    for impl, changes in result.get("to_fit", {}).items():
        lines.append(
            f"  {impl} fits with any one of: {'; '.join(changes)}"
            if changes
            else f"  {impl} fits with none of a higher ZeRO stage, activation checkpointing or a smaller micro-batch "
            "alone: plan more GPUs, CPU offload or a smaller model"
        )
    lines.append(f"  {'largest per-GPU batch':<28}" + "".join(f"{result['max_micro_batch'][i]:>14}" for i in impls))
    # the local loss contrasts each GPU's own micro-batch; the others all ranks' pairs (times K when accumulating)
    contrasted = lambda impl, micro, k: micro if impl == "local" else micro * s["world"] * k
    k = result["contrastive_steps"]
    lines.append(
        f"  {'  = contrastive batch':<28}"
        + "".join(f"{contrasted(i, result['max_micro_batch'][i], k):>14}" for i in impls)
    )
    if result["max_contrastive_steps"]:
        steps = result["max_contrastive_steps"]
        cells = [(steps[i], contrasted(i, s["micro_batch"], steps[i])) if i in steps else ("-", "-") for i in impls]
        lines.append(f"  {'largest K at this micro':<28}" + "".join(f"{k:>14}" for k, _ in cells))
        lines.append(f"  {'  = contrastive batch':<28}" + "".join(f"{batch:>14}" for _, batch in cells))
    lines += ["", f"bytes sent per rank per optimizer step ({s['world']} ranks, ring collectives):"]
    lines += [f"  {name:<46}{_fmt(v)}" for name, v in result["traffic"].items()]
    if "resolution_stages" in result:
        lines += ["", *format_stages(result["resolution_stages"], GiB)]
    if "host" in result:
        lines += ["", *format_host(result["host"])]
    return "\n".join(lines)
