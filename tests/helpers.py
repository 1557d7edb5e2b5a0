"""What several test modules need: paths, gloo ranks in spawned processes, image bytes, shard writers, the training
launch command and its environment. Test modules import from here, never from each other."""

from __future__ import annotations

import io
import json
import os
import pickle
import queue
import random
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "recipes" / "models" / "tiny.json"
TOKENIZER_DIR = REPO / "recipes" / "tokenizer"
VENV_BIN = Path(sys.executable).parent
DIGITS = "zero one two three four five six seven eight nine".split()


# --- gloo ranks ------------------------------------------------------------------------------------------------


_PORTS: set[int] = set()  # handed out since the last release_shm_buffers()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _PORTS.add(port)
    return port


def release_shm_buffers() -> None:
    """Unlink the /dev/shm buffers (66 MiB per rank) that DeepSpeed's CPU comm op (0.19.8) leaves behind after a
    multi-rank run, for the runs started on a port from free_port() since the last call; call it once they ended.

    Their names carry the master port (deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK): another test session on the
    same machine keeps its own, which its live runs need (a rank waits, forever, for its peers' buffers to appear)."""
    for port in list(_PORTS):
        for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            buffer.unlink(missing_ok=True)
        _PORTS.discard(port)


def _rank_entry(fn, rank, world_size, port, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Pickled to bytes here: a queued tensor would travel as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # report every failure with its rank, the parent decides
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo ranks; return results in rank order.

    `fn` must be a module-level function. Raises RuntimeError listing each rank's exception, and
    TimeoutError (after killing the ranks) when any rank does not finish within `timeout` seconds.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s (hang?)") from None
            outcomes[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise RuntimeError("\n".join(f"[rank {r}] {msg}" for r, msg in sorted(errors.items())))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


# --- images and shards -------------------------------------------------------------------------------------------


def image_bytes(fmt: str = "JPEG", mode: str = "RGB", size: tuple[int, int] = (40, 40), color=0) -> bytes:
    """One flat-colour image encoded as `fmt`: its pixels identify it."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt)
    return buf.getvalue()


def noise_image_bytes(rng, fmt: str = "PNG", size: int = 40) -> bytes:
    """A size x size RGB image of uniform noise from the numpy Generator `rng`."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def write_shards(folder: Path, num_shards: int, per_shard: int, seed: int = 0, bad: dict | None = None) -> list[str]:
    """img2dataset-layout training shards (key.jpg/.txt/.json) plus sizes.json; `bad` = {sample index: kind} with
    kinds 'corrupt' (truncated JPEG bytes), 'no_text', 'gray', 'rgba'. Returns the shard paths."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    rng, bad, sizes, index = random.Random(seed), bad or {}, {}, 0

    def random_image(mode, fmt="JPEG"):
        size = (rng.randint(40, 90), rng.randint(40, 90))
        color = tuple(rng.randrange(256) for _ in range(len(mode)))
        return image_bytes(fmt, mode, size, color if len(mode) > 1 else color[0])

    for s in range(num_shards):
        name = f"{s:05d}.tar"
        with wds.TarWriter(str(folder / name)) as sink:
            for _ in range(per_shard):
                kind = bad.get(index)
                key = f"{s:05d}{index:04d}"
                sample = {"__key__": key, "json": json.dumps({"key": key}).encode()}
                if kind == "rgba":
                    sample["png"] = random_image("RGBA", "PNG")
                else:
                    sample["jpg"] = random_image("L" if kind == "gray" else "RGB")
                if kind == "corrupt":
                    sample["jpg"] = sample["jpg"][: len(sample["jpg"]) // 3]
                if kind != "no_text":
                    sample["txt"] = f"a photo of the digit {DIGITS[index % 10]}".encode()
                sink.write(sample)
                index += 1
        sizes[name] = per_shard
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return [str(folder / f"{s:05d}.tar") for s in range(num_shards)]


def write_samples(folder: Path, samples: list[dict], per_shard: int) -> None:
    """Write `samples` (dicts of webdataset fields, e.g. {"png": bytes, "cls": "3"}) as NNNNN.tar shards with keys
    s00000, s00001, ... (CLIP_benchmark's layout)."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(samples), per_shard)):
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as sink:
            for i, sample in enumerate(samples[start : start + per_shard], start):
                sink.write({"__key__": f"s{i:05d}", **sample})


# --- launching disco_clip_ds.train ---------------------------------------------------------------------------------


def train_env(**extra: str) -> dict:
    """The environment of a training launch on CPU: one thread per rank, offline, this checkout importable."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        **extra,
    }


def train_command(launcher: str, nproc: int, config: str | None = None) -> list[str]:
    """The command that starts `disco_clip_ds.train` on `nproc` CPU ranks: deepspeed | torchrun | accelerate
    (`config`: its --config_file). One process without a launcher: launch_in_one_process."""
    port, module = str(free_port()), "disco_clip_ds.train"
    if launcher == "deepspeed":
        cmd = [VENV_BIN / "deepspeed", "--num_gpus", str(nproc), "--master_port", port, "--module", module]
    elif launcher == "torchrun":
        cmd = [VENV_BIN / "torchrun", "--nproc_per_node", str(nproc), "--master_port", port, "-m", module]
    elif launcher == "accelerate":
        cmd = [
            VENV_BIN / "accelerate",
            "launch",
            "--config_file",
            config,
            "--num_processes",
            str(nproc),
            "--main_process_port",
            port,
            "-m",
            "disco_clip_ds.train",
        ]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return [str(c) for c in cmd]


def run_training(cmd: list, log: Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run a training command to its end (output also saved to `log`); fails the test with the log's tail."""
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=REPO, env=train_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{cmd[0]} run failed:\n" + (proc.stdout + proc.stderr)[-4000:]
    return proc


LAUNCH_SEED = 7
LAUNCH_COMMON = [
    "--tokenizer_name",
    str(TOKENIZER_DIR),
    "--logging_steps",
    "1",
    "--save_steps",
    "3",
    "--save_total_limit",
    "5",
    "--dataloader_num_workers",
    "1",
    "--shuffle_buffer",
    "8",
    "--disable_tqdm",
    "true",
    "--report_to",
    "none",
    "--seed",
    str(LAUNCH_SEED),
]
# Plain SGD without clipping: the update is linear in the gradient, so a gradient off by any factor (the
# published DisCo code's 1/N) shows in the weights; Adam would normalise such a factor away.
SGD = [
    "--optim",
    "sgd",
    "--learning_rate",
    "0.5",
    "--lr_scheduler_type",
    "constant",
    "--warmup_steps",
    "0",
    "--max_grad_norm",
    "0",
    "--weight_decay",
    "0",
]


def launch(launcher: str, nproc: int, output: Path, *args: str, ds_config: str | None = "cpu_zero2.json", timeout=300):
    """Run `disco_clip_ds.train` with LAUNCH_COMMON on `nproc` CPU ranks with `launcher`; log in OUTPUT.log.

    launcher: deepspeed | torchrun | accelerate (ds_config picks recipes/accelerate/deepspeed_zeroN.yaml, None
    fsdp.yaml)."""
    train_args = [*LAUNCH_COMMON, "--output_dir", str(output), *args]
    if ds_config and launcher != "accelerate":
        train_args += ["--deepspeed", str(REPO / "ds_configs" / ds_config)]
    yaml = None
    if launcher == "accelerate":
        name = ds_config.replace("cpu_", "deepspeed_").replace(".json", ".yaml") if ds_config else "fsdp.yaml"
        yaml = REPO / "recipes/accelerate" / name
    return run_training(
        train_command(launcher, nproc, yaml) + train_args, log=output.parent / f"{output.name}.log", timeout=timeout
    )


def launch_in_one_process(runs: list[tuple[Path, list[str]]], timeout: float = 600) -> None:
    """Run single-process trainings (`python -m disco_clip_ds.train` with LAUNCH_COMMON, --output_dir OUTPUT and
    the run's args) one after another in ONE fresh interpreter, each logging to OUTPUT.log; fails the test with the
    failed run's log.

    A training run spends ~10 s importing and ~1 s training the tiny model; here the imports are paid once. Each
    `main()` seeds itself and loads its weights from disk, so a run does not depend on the one before it; pass each
    reference before the runs compared with it (the first one runs in an untouched interpreter). test_accumulate's
    runs logged bit-identical losses and saved bit-identical weights this way and with one process per run."""
    plan = [(str(output), [*LAUNCH_COMMON, "--output_dir", str(output), *map(str, args)]) for output, args in runs]
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS, json.dumps(plan)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        started = proc.stdout.split()  # the driver names each run before starting it
        log = Path(started[-1] + ".log") if started else None
        tail = log.read_text()[-4000:] if log and log.exists() else ""
        raise AssertionError(f"single-process runs failed ({log}):\n{tail}\n{proc.stderr[-2000:]}")


# Each run's stdout and stderr (the logging handler writes to fd 2 too) go to its own OUTPUT.log, as a launch's do.
_ONE_PROCESS = """
import json, os, sys
from disco_clip_ds.train import main
for output, argv in json.loads(sys.argv[1]):
    print(output, flush=True)
    saved = os.dup(1), os.dup(2)
    with open(output + ".log", "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            code = main(argv)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    if code:
        sys.exit(f"exit code {code}")
"""


def save_initial_model(folder: Path, seed: int) -> Path:
    """Save the tiny CLIP drawn with `seed` to FOLDER: the weights that every run of an equivalence test starts from
    (under ZeRO-3, deepspeed.zero.Init draws initial weights in its own order, so no run may draw its own)."""
    import torch

    from disco_clip_ds.modeling import build_model

    torch.manual_seed(seed)
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(folder)
    return folder


def step_losses(output: Path) -> list[float]:
    """The training loss of each logged step, from the Trainer's trainer_state.json."""
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def weights(output: Path) -> dict:
    """The saved model's tensors (float32) from OUTPUT/model.safetensors."""
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(output / "model.safetensors").items()}


def assert_same_training(a: Path, b: Path, w0: dict, steps: int, loss_rtol=1e-5, update_rtol=1e-4):
    """Runs A and B logged the same `steps` per-step losses and the same weight updates, up to fp32 reduction-order
    noise."""
    import pytest
    import torch

    la, lb = step_losses(a), step_losses(b)
    assert len(la) == len(lb) == steps
    assert la == pytest.approx(lb, rel=loss_rtol)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() == w0.keys()
    update = torch.cat([(wa[k] - w0[k]).reshape(-1) for k in w0])
    gap = torch.cat([(wa[k] - wb[k]).reshape(-1) for k in w0])
    assert update.norm() > 1e-2 * torch.cat([w.reshape(-1) for w in w0.values()]).norm()  # training moved the weights
    assert gap.norm() <= update_rtol * update.norm(), f"updates differ by {gap.norm() / update.norm():.2e} (relative)"
