"""Launching `disco_clip_ds.train` on CPU ranks from a source checkout: paths, the launcher command, its
environment, and the arguments every test launch shares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from disco_clip_ds.testing.ranks import free_port

REPO = Path(__file__).resolve().parents[2]  # the checkout this package is installed from (pip install -e .)
TINY_CONFIG = REPO / "recipes" / "models" / "tiny.json"
TOKENIZER_DIR = REPO / "recipes" / "tokenizer"
VENV_BIN = Path(sys.executable).parent


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


def train_command(launcher: str, nproc: int, config: str | None = None, launcher_args=()) -> list[str]:
    """The command that starts `disco_clip_ds.train` on `nproc` CPU ranks: deepspeed | torchrun | accelerate
    (`config`: its --config_file), on a free master port, `launcher_args` given to the launcher. One process without
    a launcher: launch_in_one_process."""
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
            *launcher_args,
            "-m",
            module,
        ]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return [str(c) for c in cmd]


def run_training(cmd: list, log: Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run a training command to its end (output also saved to `log`); raises AssertionError with the log's tail
    when it fails, so that a test shows why."""
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=REPO, env=train_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd[0]} run failed:\n" + (proc.stdout + proc.stderr)[-4000:])
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


def launch(
    launcher: str,
    nproc: int,
    output: Path,
    *args: str,
    ds_config: str | None = "cpu_zero2.json",
    timeout=300,
    launcher_args=(),
):
    """Run `disco_clip_ds.train` with LAUNCH_COMMON on `nproc` CPU ranks with `launcher` (given `launcher_args`); log
    in OUTPUT.log.

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
        train_command(launcher, nproc, yaml, launcher_args) + train_args,
        log=output.parent / f"{output.name}.log",
        timeout=timeout,
    )


def launch_in_one_process(runs: list[tuple[Path, list[str]]], timeout: float = 600) -> None:
    """Run single-process trainings (`python -m disco_clip_ds.train` with LAUNCH_COMMON, --output_dir OUTPUT and
    the run's args) one after another in ONE fresh interpreter, each logging to OUTPUT.log; raises AssertionError
    with the failed run's log.

    A training run spends most of its time importing when the model is tiny; here the imports are paid once.
    Each `main()` seeds itself and loads its weights from disk, so a run does not depend on the one before it;
    pass each reference before the runs compared with it (the first one runs in an untouched interpreter)."""
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
from disco_clip_ds.commands.train import main
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
