"""Training step time with the towers compiled (`--torch_compile`, disco_clip_ds/train/compile.py) against eager.

One process (world size 1: gloo on CPU, NCCL on a GPU) builds DiscoCLIPModel twice from one seed, compiles the
towers of one of them as a run with --torch_compile does (the loss stays eager), wraps each in its own DeepSpeed
ZeRO-2 engine (AdamW), and times full optimizer steps (forward, global-batch loss, backward, step) on one in-memory
random batch: first the compiled model's first step (the compile itself, `first_compiled_step_s`), then `--rounds`
interleaved rounds of one eager and one compiled step, the order swapped every round so that drift in the machine's
speed hits both alike. `compiled_vs_eager` is the median over rounds of each round's compiled / eager step-time
ratio. Both models train the same batch, so their losses are compared too (`loss_rel`, after the last round).

    .venv/bin/python bench/train/compile_step.py                       # CPU: tiny and small, results/compile_step.csv
    python bench/train/compile_step.py --device cuda --models vit_b32 --per_device 256 --precision bf16 \\
        --out bench/gpu/results/gpu/compile.csv                        # the GPU check's row (bench/gpu/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from disco_clip_ds.testing.bench_record import write_rows
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import free_port

OUT = Path(__file__).parent / "results" / "compile_step.csv"


def _batch(config, per_device: int, dtype, device) -> dict:
    from disco_clip_ds.testing.images import random_clip_batch

    batch = random_clip_batch(config, per_device, seed=0)
    batch["pixel_values"] = batch["pixel_values"].to(dtype)
    return {**{k: v.to(device) for k, v in batch.items()}, "return_loss": True}


def _engine(model_name: str, per_device: int, precision: str, compiled: bool, backend: str, mode: str | None):
    import deepspeed
    import torch

    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.compile import CompileSettings, compile_towers

    torch.manual_seed(0)
    model = build_model(model_config=str(REPO / "recipes" / "models" / f"{model_name}.json"))
    if compiled:
        assert compile_towers(model, CompileSettings(backend, mode)) == ["vision tower", "text tower"]
    config = {
        "train_micro_batch_size_per_gpu": per_device,
        "gradient_accumulation_steps": 1,
        "train_batch_size": per_device,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step(engine, batch, cuda: bool) -> tuple[float, float]:
    """One optimizer step: (seconds, loss)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def measure(args, model_name: str) -> dict:
    """One model's row."""
    import torch

    cuda = args.device == "cuda"
    engines = {
        kind: _engine(model_name, args.per_device, args.precision, kind == "compiled", args.backend, args.mode)
        for kind in ("eager", "compiled")
    }
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    batch = _batch(engines["eager"].module.config, args.per_device, dtype, engines["eager"].device)
    _step(engines["eager"], batch, cuda)  # warm-up: allocator, DeepSpeed's first-step set-up
    first_compiled, _ = _step(engines["compiled"], batch, cuda)  # the compile, forward and backward
    times, ratios, losses = {"eager": [], "compiled": []}, [], {}
    for round_ in range(args.rounds):
        order = ("eager", "compiled") if round_ % 2 == 0 else ("compiled", "eager")
        this = {}
        for kind in order:
            this[kind], losses[kind] = _step(engines[kind], batch, cuda)
            times[kind].append(this[kind])
        ratios.append(this["compiled"] / this["eager"])
    eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {
        "model": model_name,
        "device": args.device,
        "precision": args.precision,
        "threads": torch.get_num_threads() if not cuda else "",
        "per_device": args.per_device,
        "backend": args.backend,
        "mode": args.mode or "default",
        "rounds": args.rounds,
        "eager_step_s": round(eager, 4),
        "compiled_step_s": round(compiled, 4),
        "compiled_vs_eager": round(statistics.median(ratios), 3),
        "first_compiled_step_s": round(first_compiled, 1),
        "loss_rel": f"{abs(losses['compiled'] - losses['eager']) / abs(losses['eager']):.1e}",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"], help="names in recipes/models/")
    p.add_argument("--per_device", type=int, default=128)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (one rank per core, as the tests)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds of one eager and one compiled step")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", default=None, help="torch.compile's mode (default: its default)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.device == "cpu" and args.precision == "bf16":
        p.error("--device cpu runs fp32 (DeepSpeed's CPU accelerator is the tests' setting)")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo", verbose=False)
    rows = [measure(args, name) for name in args.models]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_rows(out, rows, rounds=args.rounds)
    print(" | ".join(rows[0]))
    for row in rows:
        print(" | ".join(str(v) for v in row.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
