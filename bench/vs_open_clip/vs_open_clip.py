"""Side by side with open_clip 3.3.0: the same tiny CLIP, data and schedule, trained by both stacks in turn.

Both stacks train recipes/models/tiny.json (rebuilt below as an open_clip model config) on the demo shards
(`disco-clip data demo`), 2 CPU ranks x 128 per rank, fp32, 100 steps of AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 0.1), 10 warmup steps then cosine, gradient clipping at 1.0, one seed after the other, ours then theirs.
Ours runs as recipes/quickstart.sh does (DeepSpeed ZeRO-2, tiled loss); open_clip runs its own trainer,
`open_clip_train.main`, under torchrun with `--local-loss --gather-with-grad`. Both final models are scored by
`disco-clip eval` on the demo eval split (open_clip's weights converted to CLIPModel's layout, the conversion checked
against open_clip's own encoders), with the same tokenizer and image processor.

open_clip is a bench-only tool in its own virtualenv (default bench/vs_open_clip/.venv-openclip, OPENCLIP_VENV to
override), never a dependency of the package; this file runs in both (its open_clip side imports nothing of ours).
On CPU open_clip needs two things that this script supplies at run time:
- the registry's torchvision 0.28.0 is a CUDA build whose compiled ops cannot load against the CPU torch, and its
  fake-kernel registrations then fail on missing op schemas: we declare the two schemas (no kernels) before import;
  open_clip only uses torchvision's PIL transforms;
- open_clip_train wraps the model in DDP with `device_ids=[device]`, which DDP refuses for a CPU module: we drop it.

Training speed, the one figure compared: samples/s over steps SKIP+1..N (SKIP = 10), timed the same way for both
stacks. Each stack logs every step on rank 0 once the step's optimizer update is done (ours: the Trainer's log dict,
`--logging_steps 1`; open_clip: its `Train Epoch: ... [n*256/...]` line, `--log-every-n-steps 1`), and this script
reads both processes' merged stdout/stderr unbuffered (PYTHONUNBUFFERED=1) and stamps each line with its own clock as
it arrives. The figure is (N - SKIP) x 256 / (t_N - t_SKIP), t_n the arrival of step n's line: every cost inside the
training loop counts (data loading, forward, backward, collectives, optimizer, per-step logging), while start-up
(imports, DeepSpeed's extension build, the first SKIP steps) and the final save do not. Neither stack's own speed
figure is compared (the Trainer's train_samples_per_second times its whole train() call, start-up included;
open_clip's is rank 0's batch time): the CSV keeps them as stack_reported_samples_per_s, with the process's wall time.
Rounds are interleaved, ours then open_clip for each seed, so load from other work on the machine reaches both.

  .venv/bin/python bench/vs_open_clip/vs_open_clip.py      # writes results/vs_open_clip{,_curves}.csv and .png
  .venv/bin/python bench/vs_open_clip/vs_open_clip.py --seeds 0 --steps 5 --out /tmp/vs --results /tmp/vs  # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPENCLIP_VENV = Path(os.environ.get("OPENCLIP_VENV", Path(__file__).resolve().parent / ".venv-openclip"))
OPENCLIP_VERSION = "3.3.0"
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"  # the release paired with torch 2.13; a CUDA build on the registry (see above)
PER_RANK, NPROC, LR, WD, WARMUP, CLIP_NORM = 128, 2, 1e-3, 0.1, 10, 1.0
FINAL_WINDOW = 10  # the final loss is the mean of the last 10 steps
SKIP = 10  # steps left out of the timed span (start-up costs end in them): the figure covers steps SKIP+1..N
# the per-step log line of each stack on rank 0, one per step: the Trainer's log dict; open_clip's progress line
STEP_LINE = {"ours": re.compile(r"\{'loss': "), "open_clip": re.compile(r"Train Epoch: .*Contrastive_loss")}


# ---------------------------------------------------------------- open_clip side (runs in its own venv)


def _import_open_clip():
    import torch

    try:
        torch.ops.torchvision.nms
    except (AttributeError, RuntimeError):  # torchvision's ops did not load: declare the schemas it registers fakes for
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _import_open_clip.lib = lib  # keep the library (and its schemas) alive
    import open_clip

    return open_clip


def open_clip_model_config(clip_config: dict, tokenizer_dir: str) -> dict:
    """recipes/models/*.json (a CLIPConfig) as an open_clip model config: the same towers, tokenizer and pooling."""
    text, vision = clip_config["text_config"], clip_config["vision_config"]
    for tower in (text, vision):
        assert tower["hidden_act"] == "quick_gelu" and tower["intermediate_size"] == 4 * tower["hidden_size"]
    return {
        "embed_dim": clip_config["projection_dim"],
        "quick_gelu": True,
        "vision_cfg": {
            "image_size": vision["image_size"],
            "patch_size": vision["patch_size"],
            "width": vision["hidden_size"],
            "layers": vision["num_hidden_layers"],
            "head_width": vision["hidden_size"] // vision["num_attention_heads"],
            "mlp_ratio": 4.0,
        },
        "text_cfg": {
            "context_length": text["max_position_embeddings"],
            "vocab_size": text["vocab_size"],
            "width": text["hidden_size"],
            "heads": text["num_attention_heads"],
            "layers": text["num_hidden_layers"],
            "mlp_ratio": 4.0,
            "hf_tokenizer_name": tokenizer_dir,
            # CLIPModel pools the first eos token (eos_token_id != 2); open_clip's 'argmax' would take the largest id
            "pool_type": "eos",
            "eos_id": text["eos_token_id"],
            "pad_id": text["pad_token_id"],
        },
    }


def oc_train(argv: list[str]) -> None:
    """open_clip_train.main under torchrun, with the two CPU workarounds; argv[0] is a JSON list: the model config
    file, then the trainer's arguments."""
    import torch

    open_clip = _import_open_clip()
    argv = json.loads(Path(argv[0]).read_text())
    open_clip.add_model_config(argv[0])

    class CPUDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module, device_ids=None, **kwargs):
            cpu = device_ids and all(torch.device(d).type == "cpu" for d in device_ids)
            super().__init__(module, device_ids=None if cpu else device_ids, **kwargs)

    torch.nn.parallel.DistributedDataParallel = CPUDistributedDataParallel
    from open_clip_train.main import main

    main(argv[1:])


def oc_convert(
    checkpoint: str, model_name: str, model_config: str, clip_config: str, tokenizer_dir: str, out: str
) -> None:
    """open_clip checkpoint -> CLIPModel folder, checked: both encoders agree with open_clip's to fp32 precision."""
    import torch

    open_clip = _import_open_clip()  # first: transformers imports torchvision too
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    open_clip.add_model_config(model_config)
    oc = open_clip.create_model(model_name, precision="fp32").eval()
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    oc.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    hf = CLIPModel(CLIPConfig.from_json_file(clip_config)).eval()
    hf.load_state_dict(open_clip_to_hf(oc.state_dict(), hf.config), strict=True)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = ["a photo of the number 3.", "the digit 7, written by hand", "9"]
    ids = open_clip.get_tokenizer(model_name)(texts)
    hf_ids = tokenizer(texts, padding="max_length", max_length=ids.shape[1], truncation=True, return_tensors="pt")
    assert torch.equal(ids, hf_ids.input_ids), "open_clip's tokenizer wrapper and ours disagree"
    images = torch.randn(
        4,
        3,
        hf.config.vision_config.image_size,
        hf.config.vision_config.image_size,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        pairs = [
            (oc.encode_image(images), hf.get_image_features(pixel_values=images).pooler_output),
            (oc.encode_text(ids), hf.get_text_features(**hf_ids).pooler_output),
        ]
    for theirs, ours in pairs:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert math.isclose(hf.logit_scale.item(), oc.logit_scale.item())
    hf.save_pretrained(out)


def write_tiny_open_clip_config(folder: Path) -> Path:
    """recipes/models/tiny.json rebuilt as an open_clip model config, written as FOLDER/disco-tiny.json."""
    path = folder / "disco-tiny.json"
    tiny = json.loads((REPO / "recipes/models/tiny.json").read_text())
    path.write_text(json.dumps(open_clip_model_config(tiny, str(REPO / "recipes" / "tokenizer")), indent=2))
    return path


def open_clip_to_hf(sd: dict, config) -> dict:
    """open_clip's CLIP state dict in transformers' CLIPModel layout (split in_proj, transposed projections)."""
    out = {"logit_scale": sd["logit_scale"]}

    def blocks(src: str, dst: str, layers: int):
        for i in range(layers):
            s, d = f"{src}.resblocks.{i}.", f"{dst}.encoder.layers.{i}."
            for name, w in zip("qkv", sd[s + "attn.in_proj_weight"].chunk(3)):
                out[d + f"self_attn.{name}_proj.weight"] = w
            for name, b in zip("qkv", sd[s + "attn.in_proj_bias"].chunk(3)):
                out[d + f"self_attn.{name}_proj.bias"] = b
            for a, b in (
                ("attn.out_proj", "self_attn.out_proj"),
                ("ln_1", "layer_norm1"),
                ("ln_2", "layer_norm2"),
                ("mlp.c_fc", "mlp.fc1"),
                ("mlp.c_proj", "mlp.fc2"),
            ):
                out[d + b + ".weight"], out[d + b + ".bias"] = sd[s + a + ".weight"], sd[s + a + ".bias"]

    out["text_model.embeddings.token_embedding.weight"] = sd["token_embedding.weight"]
    out["text_model.embeddings.position_embedding.weight"] = sd["positional_embedding"]
    blocks("transformer", "text_model", config.text_config.num_hidden_layers)
    out["text_model.final_layer_norm.weight"], out["text_model.final_layer_norm.bias"] = (
        sd["ln_final.weight"],
        sd["ln_final.bias"],
    )
    out["text_projection.weight"] = sd["text_projection"].t().contiguous()
    out["vision_model.embeddings.class_embedding"] = sd["visual.class_embedding"]
    out["vision_model.embeddings.patch_embedding.weight"] = sd["visual.conv1.weight"]
    out["vision_model.embeddings.position_embedding.weight"] = sd["visual.positional_embedding"]
    out["vision_model.pre_layrnorm.weight"], out["vision_model.pre_layrnorm.bias"] = (
        sd["visual.ln_pre.weight"],
        sd["visual.ln_pre.bias"],
    )
    blocks("visual.transformer", "vision_model", config.vision_config.num_hidden_layers)
    out["vision_model.post_layernorm.weight"], out["vision_model.post_layernorm.bias"] = (
        sd["visual.ln_post.weight"],
        sd["visual.ln_post.bias"],
    )
    out["visual_projection.weight"] = sd["visual.proj"].t().contiguous()
    return out


# ---------------------------------------------------------------- orchestration (runs in the repo's .venv)


def ensure_openclip_venv(venv: Path) -> Path:
    """Create the bench-only open_clip virtualenv: the CPU torch FIRST, so open_clip cannot pull a CUDA one."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    import transformers

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run(pip + ["--no-deps", f"torchvision=={TORCHVISION_VERSION}"], check=True)
    # open_clip_train 3.3.0 reads the 'fname' key of tar members, which webdataset 1.x no longer yields (0.2.86
    # does); it imports pandas; open_clip's HF tokenizer wrapper needs transformers
    subprocess.run(
        pip
        + [
            f"open_clip_torch=={OPENCLIP_VERSION}",
            "webdataset==0.2.86",
            "pandas",
            f"transformers=={transformers.__version__}",
        ],
        check=True,
    )
    return python


def _env() -> dict:
    """Our launches' environment (one thread per rank, offline), with this checkout importable in open_clip's
    virtualenv too (same_batches.py trains there with disco_clip_ds.train.optim)."""
    from disco_clip_ds.testing.launch import train_env

    env = train_env(NO_ALBUMENTATIONS_UPDATE="1")
    # DeepSpeed JIT-builds its CPU shared-memory comm op into torch's extension cache, one folder for every venv on
    # the machine: another venv's build of it holds the lock (and rebuilds it for its own paths). Use our own.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "outputs" / "torch_extensions"))
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    return env


def _streamed(cmd: list[str], log: Path) -> tuple[list[tuple[float, str]], float]:
    """Run cmd with stdout and stderr merged into one pipe, each line stamped (seconds since launch) as it arrives,
    so that both stacks' step times come from one clock read one way; the log file keeps the stamps. Also returns
    the process's wall time."""
    start, lines = time.perf_counter(), []
    env = {**_env(), "PYTHONUNBUFFERED": "1"}  # every line leaves the child when it is written
    with open(log, "w") as f:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO) as p:
            for line in p.stdout:  # text mode splits at \r too: a progress bar's redraws are lines of their own
                lines.append((time.perf_counter() - start, line.rstrip("\n")))
                f.write(f"{lines[-1][0]:10.3f} {lines[-1][1]}\n")
    if p.returncode:
        sys.exit(f"{cmd[0]} failed ({p.returncode}); see {log}")
    return lines, time.perf_counter() - start


def step_times(stack: str, lines: list[tuple[float, str]], steps: int) -> list[float]:
    """Arrival time of each step's log line, step 1 first."""
    times = [t for t, line in lines if STEP_LINE[stack].search(line)]
    assert len(times) == steps, f"{stack}: {len(times)} per-step log lines for {steps} steps"
    return times


def run_ours(seed: int, steps: int, data: Path, out: Path, patch_dropout: float = 0.0) -> dict:
    from disco_clip_ds.testing.launch import train_command

    lines, wall = _streamed(
        [
            *train_command("deepspeed", NPROC),
            "--deepspeed",
            "ds_configs/cpu_zero2.json",
            "--train_shards",
            str(data / "train"),
            "--model_config",
            "recipes/models/tiny.json",
            "--tokenizer_name",
            "recipes/tokenizer",
            "--loss_impl",
            "tiled",
            "--output_dir",
            str(out),
            "--max_steps",
            str(steps),
            "--per_device_train_batch_size",
            str(PER_RANK),
            "--learning_rate",
            str(LR),
            "--weight_decay",
            str(WD),
            "--warmup_steps",
            str(WARMUP),
            "--lr_scheduler_type",
            "cosine",
            "--adam_beta1",
            "0.9",
            "--adam_beta2",
            "0.999",
            "--adam_epsilon",
            "1e-8",
            "--max_grad_norm",
            str(CLIP_NORM),
            "--logging_steps",
            "1",
            "--save_steps",
            "100000",
            "--dataloader_num_workers",
            "1",
            "--seed",
            str(seed),
            "--report_to",
            "none",
            "--patch_dropout",
            str(patch_dropout),
        ],
        out.with_suffix(".log"),
    )
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    reported = json.loads((out / "train_results.json").read_text())["train_samples_per_second"]
    times = step_times("ours", lines, steps)
    return {"losses": losses, "times": times, "wall_s": wall, "reported_samples_per_s": reported, "model": out}


def run_open_clip(
    python: Path,
    seed: int,
    steps: int,
    data: Path,
    out: Path,
    model_config: Path,
    ours_model: Path,
    patch_dropout: float = 0.0,
) -> dict:
    from disco_clip_ds.testing.ranks import free_port

    shards = sorted((data / "train").glob("*.tar"))
    first, last = shards[0].stem, shards[-1].stem
    name = model_config.stem
    out.mkdir(parents=True)
    # the trainer's arguments travel in a file: torchrun's own parser would take abbreviations such as --logs
    (out / "open_clip_args.json").write_text(
        json.dumps(
            [
                str(model_config),
                "--model",
                name,
                "--train-data",
                str(data / "train" / f"{{{first}..{last}}}.tar"),
                "--dataset-type",
                "webdataset",
                "--dataset-resampled",
                "--train-num-samples",
                str(steps * PER_RANK * NPROC),
                "--epochs",
                "1",
                "--batch-size",
                str(PER_RANK),
                "--workers",
                "1",
                "--precision",
                "fp32",
                "--device",
                "cpu",
                "--lr",
                str(LR),
                "--wd",
                str(WD),
                "--warmup",
                str(WARMUP),
                "--lr-scheduler",
                "cosine",
                "--beta1",
                "0.9",
                "--beta2",
                "0.999",
                "--eps",
                "1e-8",
                "--grad-clip-norm",
                str(CLIP_NORM),
                "--local-loss",
                "--gather-with-grad",
                "--seed",
                str(seed),
                "--log-every-n-steps",
                "1",
                "--save-frequency",
                "1",
                "--zeroshot-frequency",
                "0",
                "--logs",
                str(out),
                "--name",
                "run",
                "--report-to",
                "",
                *(["--force-patch-dropout", str(patch_dropout)] if patch_dropout else []),
            ]
        )
    )
    lines, wall = _streamed(
        [
            str(python.parent / "torchrun"),
            "--nproc_per_node",
            str(NPROC),
            "--master_port",
            str(free_port()),
            __file__,
            "oc-train",
            str(out / "open_clip_args.json"),
        ],
        out.with_suffix(".log"),
    )
    losses, speeds = [], []
    for _, line in lines:
        if m := re.search(r"\[\s*(\d+)/\d+ .*?, ([\d.]+)/s, .*Contrastive_loss: ([\d.]+)", line):
            losses.append((int(m[1]) // (PER_RANK * NPROC), float(m[3])))
            speeds.append(float(m[2]))
    model = out / "hf"
    subprocess.run(
        [
            str(python),
            __file__,
            "oc-convert",
            str(out / "run" / "checkpoints" / "epoch_1.pt"),
            name,
            str(model_config),
            str(REPO / "recipes" / "models" / "tiny.json"),
            str(REPO / "recipes" / "tokenizer"),
            str(model),
        ],
        check=True,
        env=_env(),
        cwd=REPO,
    )
    for f in ours_model.iterdir():  # the same tokenizer and image processor files as ours
        if "token" in f.name or "processor" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, model / f.name)
    times = step_times("open_clip", lines, steps)
    # open_clip's own per-step figure (rank 0's batch time): its median past the first SKIP steps, not compared
    steady = sorted(speeds[SKIP:] or speeds)
    return {
        "losses": losses,
        "times": times,
        "wall_s": wall,
        "reported_samples_per_s": steady[len(steady) // 2],
        "model": model,
    }


def zeroshot(model: Path, data: Path) -> dict:
    out = model / "zeroshot_classification.json"
    subprocess.run(
        [
            str(Path(sys.executable).parent / "disco-clip"),
            "eval",
            "--model",
            str(model),
            "--data",
            str(data / "eval"),
            "--task",
            "zeroshot_classification",
            "--output",
            str(out),
        ],
        check=True,
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    record = json.loads(out.read_text())
    return record.get("metrics", record)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["oc-train"]:
        oc_train(argv[1:])
        return 0
    if argv[:1] == ["oc-convert"]:
        oc_convert(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--data", type=Path, default=REPO / "data" / "demo")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "vs_open_clip")
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument(
        "--patch_dropout",
        type=float,
        default=0.0,
        help="both stacks with FLIP's patch dropout (ours --patch_dropout, open_clip --force-patch-dropout); "
        "results in vs_open_clip_pdP*",
    )
    args = parser.parse_args(argv)

    python = ensure_openclip_venv(OPENCLIP_VENV)
    if not (args.data / "train" / "sizes.json").exists():
        subprocess.run(
            [str(Path(sys.executable).parent / "disco-clip"), "data", "demo", "--output", str(args.data)],
            check=True,
            env=_env(),
        )
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model_config = write_tiny_open_clip_config(args.out)
    skip = min(SKIP, args.steps // 2)  # a smoke run's few steps still leave some timed
    rows, curves = [], []
    for seed in args.seeds:  # one round per seed, ours then open_clip: load from other work reaches both
        ours = run_ours(seed, args.steps, args.data, args.out / f"ours-{seed}", args.patch_dropout)
        theirs = run_open_clip(
            python,
            seed,
            args.steps,
            args.data,
            args.out / f"open_clip-{seed}",
            model_config,
            ours["model"],
            args.patch_dropout,
        )
        for stack, run in (("ours", ours), ("open_clip", theirs)):
            metrics = zeroshot(run["model"], args.data)
            final = [loss for step, loss in run["losses"] if step > args.steps - FINAL_WINDOW]
            timed_s = run["times"][-1] - run["times"][skip - 1]
            rows.append(
                {
                    "stack": stack,
                    "seed": seed,
                    "steps": args.steps,
                    "final_loss": round(sum(final) / len(final), 4),
                    "zeroshot_acc1": round(metrics["acc1"], 4),
                    "zeroshot_acc5": round(metrics["acc5"], 4),
                    # the compared figure: steps skip+1..N between their log lines' arrivals (module docstring)
                    "timed_steps": f"{skip + 1}-{args.steps}",
                    "timed_s": round(timed_s, 2),
                    "train_samples_per_s": round((args.steps - skip) * PER_RANK * NPROC / timed_s, 1),
                    # not compared: each stack's own figure (different definitions) and launch-to-exit wall time
                    "stack_reported_samples_per_s": round(run["reported_samples_per_s"], 1),
                    "process_wall_s": round(run["wall_s"], 1),
                }
            )
            curves += [
                {"stack": stack, "seed": seed, "step": step, "loss": loss, "t_s": round(t, 3)}
                for (step, loss), t in zip(run["losses"], run["times"])
            ]
            print(rows[-1], flush=True)
        name = f"vs_open_clip_pd{args.patch_dropout:g}" if args.patch_dropout else "vs_open_clip"
        # after every round: a long run interrupted keeps what it measured
        write(args.results, rows, curves, skip, name)
    print(summary(rows))
    return 0


def summary(rows: list[dict]) -> str:
    """The README's table: quality as mean (min-max) over seeds; training samples/s as median (min-max) over rounds,
    and ours/open_clip per round (the two runs of one round met the same machine load), median (min-max)."""

    def spread(values, centre, digits):
        return f"{centre(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    by = {stack: {r["seed"]: r for r in rows if r["stack"] == stack} for stack in ("ours", "open_clip")}
    seeds = sorted(set(by["ours"]) & set(by["open_clip"]))

    def col(stack, key):
        return [by[stack][s][key] for s in seeds]

    ratios = [a / b for a, b in zip(col("ours", "train_samples_per_s"), col("open_clip", "train_samples_per_s"))]
    lines = ["| | ours | open_clip 3.3.0 |", "| --- | --- | --- |"]
    for label, key, centre, digits in (
        (
            f"final training loss (mean of the last {FINAL_WINDOW} steps), mean (min-max)",
            "final_loss",
            statistics.mean,
            3,
        ),
        ("zero-shot acc1, demo eval split, mean (min-max)", "zeroshot_acc1", statistics.mean, 3),
        (
            f"training samples/s, steps {rows[0]['timed_steps']}, median (min-max)",
            "train_samples_per_s",
            statistics.median,
            0,
        ),
    ):
        lines.append(
            f"| {label} | {spread(col('ours', key), centre, digits)} "
            f"| {spread(col('open_clip', key), centre, digits)} |"
        )
    lines.append(
        f"\nours / open_clip, training samples/s, per round: median {spread(ratios, statistics.median, 2)}"
        f" over {len(seeds)} rounds"
    )
    return "\n".join(lines)


def write(results: Path, rows: list[dict], curves: list[dict], skip: int, name: str = "vs_open_clip") -> None:
    import matplotlib

    # here, not at the top: bench/data/input_pipeline.py imports this module in open_clip's venv, without the package
    from disco_clip_ds.testing.bench_record import write_rows

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results.mkdir(parents=True, exist_ok=True)
    for file, table in ((f"{name}.csv", rows), (f"{name}_curves.csv", curves)):
        write_rows(results / file, table, rounds=1)
    seeds = sorted({c["seed"] for c in curves})
    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for stack, colour in (("ours", "tab:blue"), ("open_clip", "tab:orange")):
        for seed in seeds:
            steps, losses, times = zip(
                *[(c["step"], c["loss"], c["t_s"]) for c in curves if c["stack"] == stack and c["seed"] == seed]
            )
            label = stack if seed == seeds[0] else None
            loss_ax.plot(steps, losses, color=colour, alpha=0.7, lw=1, label=label)
            # the timed span: seconds after step skip's line; the slope is the time per step
            time_ax.plot(
                steps[skip - 1 :],
                [t - times[skip - 1] for t in times[skip - 1 :]],
                color=colour,
                alpha=0.7,
                lw=1,
                label=label,
            )
    loss_ax.axhline(math.log(PER_RANK * NPROC), color="grey", ls=":", lw=1, label="chance, ln 256")
    loss_ax.set(
        xlabel="step",
        ylabel="training loss (ours: global batch; open_clip: rank 0's local loss)",
        title=f"tiny CLIP, demo data, 2 CPU ranks x 128, fp32, {len(seeds)} seeds each",
    )
    time_ax.set(
        xlabel="step",
        ylabel=f"seconds since step {skip}'s log line arrived",
        title="the timed span: arrival of each step's log line",
    )
    loss_ax.legend()
    time_ax.legend()
    fig.tight_layout()
    fig.savefig(results / f"{name}.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
