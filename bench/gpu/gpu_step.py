"""DeepSpeed training steps of DiscoCLIPModel on one device: samples/s and peak memory against `disco-clip plan`.

For each per-device batch, a fresh process (world size 1: NCCL on one GPU, gloo on CPU) builds the model from a
CLIPConfig JSON, wraps it in the DeepSpeed engine with a copy of --deepspeed whose batch numbers are set to that
batch (world 1, no accumulation), runs --warmup steps, then times --steps full optimizer steps on in-memory random
batches. The same config file goes to the planner (`disco_clip_ds.plan.plan`, what `disco-clip plan` prints), so
the two numbers describe one setting. Peak memory: torch.cuda.max_memory_allocated over the whole process on GPU
(what the planner's terms count; the planner adds --overhead_gb for the CUDA context and allocator, shown apart),
peak RSS growth from before the model was built on CPU.

    python bench/gpu/gpu_step.py --model recipes/models/vit_b32.json --per_device 1024 4096 --device cuda \
        --deepspeed ds_configs/vit_b32_32k_8gpu.json --activation_checkpointing --out bench/gpu/results/gpu/step.csv
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.memory import mmap_threshold_env, reset_peak_rss, rss_mib
from disco_clip_ds.testing.ranks import free_port


def _batch(config, per_device: int, dtype, device) -> dict:
    import torch

    text, vision = config.text_config, config.vision_config
    ids = torch.randint(2, text.vocab_size, (per_device, text.max_position_embeddings), device=device)
    ids[:, 0], ids[:, -1] = text.bos_token_id, text.eos_token_id
    pixels = torch.randn(per_device, 3, vision.image_size, vision.image_size, device=device, dtype=dtype)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "return_loss": True}


def point(args, per_device: int, ds_path: Path) -> dict:
    """One measured point, in this (fresh) process."""
    import torch

    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from disco_clip_ds.models.build import build_model

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    base = reset_peak_rss() if not cuda else rss_mib("VmRSS")  # on CPU the peak counts from here, after the imports
    torch.manual_seed(0)
    model = build_model(model_config=args.model, loss_impl=args.loss_impl)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = json.loads(ds_path.read_text())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # what the HF Trainer builds from TrainingArguments
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") is True else torch.float32
    batch = _batch(model.config, per_device, dtype, engine.device)
    times = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.backward(engine(**batch).loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20
    else:
        alloc, reserved = rss_mib("VmHWM") - base, float("nan")
    step_s = statistics.median(times)
    return {
        "step_s": round(step_s, 4),
        "samples_per_s": round(per_device / step_s, 1),
        "peak_alloc_mib": round(alloc),
        "peak_reserved_mib": round(reserved) if reserved == reserved else "",
    }


def _ds_config(args, per_device: int) -> Path:
    """--deepspeed with its batch numbers set for one device and no accumulation, written beside the CSV."""
    config = json.loads(Path(args.deepspeed).read_text())
    config.update(
        train_micro_batch_size_per_gpu=per_device,
        train_batch_size=per_device,
        gradient_accumulation_steps=1,
        steps_per_print=10**9,
    )
    if args.precision == "fp32":
        config.pop("bf16", None)
    path = Path(args.out).with_name(f"{Path(args.out).stem}_ds_{per_device}.json")
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def _plan(args, ds_path: Path) -> dict:
    """The planner's per-device total for this config (and, apart, the framework overhead it assumes)."""
    from disco_clip_ds import plan as P

    result = P.plan(
        ds_path,
        args.model,
        1,
        args.gpu_memory,
        activation_checkpointing=args.activation_checkpointing,
        loss_impls=(args.loss_impl,),
        overhead_gb=args.overhead_gb,
        contrastive_accumulation=False,
    )
    # the terms, to see which one is off
    ds_path.with_name(ds_path.name.replace("_ds_", "_plan_")).write_text(json.dumps(result, indent=1) + "\n")
    return {
        "plan_mib": round(result["memory"][args.loss_impl]["total"] / 2**20),
        "plan_overhead_mib": round(result["overhead_bytes"] / 2**20),
        "zero_stage": result["settings"]["stage"],
        "precision": result["settings"]["precision"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "recipes/models/vit_b32.json"), help="CLIPConfig JSON")
    p.add_argument(
        "--deepspeed",
        default=str(REPO / "ds_configs/vit_b32_32k_8gpu.json"),
        help="DeepSpeed JSON (its batch keys are overridden)",
    )
    p.add_argument("--per_device", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="fp32 drops the config's bf16 block")
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--loss_impl", default="tiled", choices=["tiled", "disco", "local"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpu_memory", default="139GB", help="device memory the planner is told")
    p.add_argument("--overhead_gb", type=float, default=2.0, help="the planner's overhead (CUDA context...)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per point (a fresh process each)")
    p.add_argument("--out", default="bench/gpu/results/gpu/step.csv")
    p.add_argument("--_point", type=int, help=argparse.SUPPRESS)  # internal: measure one point, print JSON
    args = p.parse_args(argv)
    if args.device == "cpu" and args.precision == "bf16":
        p.error("--device cpu runs fp32 (DeepSpeed's CPU accelerator is the tests' setting); use --precision fp32")
    if args._point is not None:
        print(json.dumps(point(args, args._point, _ds_config(args, args._point))), flush=True)
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **mmap_threshold_env(1 << 20)}  # freed large blocks go back: RSS tracks tensors
    rows = []
    for per_device in args.per_device:
        row = {
            "model": Path(args.model).stem,
            "device": args.device,
            "per_device": per_device,
            "steps": args.steps,
            "act_ckpt": args.activation_checkpointing,
            "loss_impl": args.loss_impl,
            **_plan(args, _ds_config(args, per_device)),
        }
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--_point", str(per_device)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            if done.returncode == 0:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]), status="ok")
                row["measured_vs_plan"] = round(row["peak_alloc_mib"] / (row["plan_mib"] - row["plan_overhead_mib"]), 3)
            else:
                tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
                row["status"] = ("OOM: " if "out of memory" in done.stderr.lower() else "error: ") + tail[0][:200]
        except subprocess.TimeoutExpired:
            row["status"] = f"timeout ({args.timeout:.0f} s)"
        rows.append(row)
        print(row, flush=True)
        write_rows(args.out, rows, rounds=args.steps)  # rewritten after every point: a later failure keeps these
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
