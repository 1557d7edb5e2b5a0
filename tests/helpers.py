"""Test-only helpers: reading and comparing the results of training runs. The harness the tests share with the
benchmarks (ranks, images, the image server, launches) is disco_clip_ds.testing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO, TINY_CONFIG, train_command, train_env


def save_initial_model(folder: Path, seed: int) -> Path:
    """Save the tiny CLIP drawn with `seed` to FOLDER: the weights that every run of an equivalence test starts from
    (under ZeRO-3, deepspeed.zero.Init draws initial weights in its own order, so no run may draw its own)."""
    import torch

    from disco_clip_ds.models.build import build_model

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


def two_shards_and_init(root: Path) -> dict:
    """The launched tests' usual data: 2 shards of 32 samples and a saved tiny model, as a fixture's dict
    ("root", "shards", "model") for `run_and_data`."""
    write_shards(root / "shards", num_shards=2, per_shard=32, seed=3)
    return {
        "root": root,
        "shards": f"{root}/shards/{{00000..00001}}.tar",
        "model": save_initial_model(root / "init", 5),
    }


def run_and_data(output: Path, data: dict) -> list[str]:
    """The arguments naming a launched run's folder, its initial weights and its shards (`data`: a test's fixture
    with "model" and "shards")."""
    return ["--output_dir", str(output), "--model_name_or_path", str(data["model"]), "--train_shards", data["shards"]]


# --- launched runs: a 2-rank training in its own session, its log in OUTPUT.log beside the run folder ---


def start_run(output: Path, train_args: list[str], launcher="deepspeed", fault: str = "", nproc=2, **env):
    """Start `disco-clip train TRAIN_ARGS` under LAUNCHER in its own session (process group = the launcher's pid),
    stdout+stderr appended to OUTPUT.log. Under accelerate the ZeRO-2 yaml is the DeepSpeed config."""
    yaml = REPO / "recipes/accelerate/deepspeed_zero2.yaml" if launcher == "accelerate" else None
    log = open(output.parent / f"{output.name}.log", "a")
    return subprocess.Popen(
        train_command(launcher, nproc, yaml) + train_args,
        cwd=REPO,
        env=train_env(DISCO_FAULT=fault, **env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_to_end(output: Path, train_args: list[str], launcher="deepspeed", fault="", timeout=400, **kw):
    """Run `start_run` to its end: (exit code, this launch's part of the log); no process it started is left."""
    logfile = output.parent / f"{output.name}.log"
    before = logfile.stat().st_size if logfile.exists() else 0
    proc = start_run(output, train_args, launcher=launcher, fault=fault, **kw)
    try:
        proc.wait(timeout=timeout)
        wait_group(proc.pid, timeout=120)  # ranks may outlive a launcher killed by the signal: let them save
    finally:
        kill_group(proc.pid)
    return proc.returncode, logfile.read_text()[before:]


def wait_group(pgid: int, timeout: float) -> None:
    """Wait until no live process is left in process group PGID (or TIMEOUT s)."""
    import psutil

    def members():
        found = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p.pid)
            except (ProcessLookupError, psutil.Error):
                pass
        return found

    deadline = time.monotonic() + timeout
    while members() and time.monotonic() < deadline:
        time.sleep(0.2)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ranks_of(launcher_pid: int) -> list[int]:
    """pids of the training ranks under a launcher (children of any depth running disco_clip_ds.train)."""
    import psutil

    def facts(p) -> tuple[list[str], int]:  # a child may exit (or be a zombie) between listing and reading it
        try:
            return p.cmdline(), p.ppid()
        except psutil.Error:
            return [], -1

    children = {p.pid: facts(p) for p in psutil.Process(launcher_pid).children(recursive=True)}
    train = {
        pid: parent
        for pid, (command, parent) in children.items()
        if "disco_clip_ds.train" in " ".join(command) and "launch" not in " ".join(command[:4])
    }
    return [pid for pid, parent in train.items() if parent not in train]  # not their (forked) DataLoader workers


def alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def complete_checkpoints(output: Path) -> list[str]:
    """The checkpoint-N folders of OUTPUT that checkpoint_problem finds complete, oldest first."""
    from disco_clip_ds.checkpoint.layout import checkpoint_problem

    found = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return [p.name for p in found if checkpoint_problem(p) is None]


def assert_trained_under_fsdp(output: Path) -> None:
    """Every checkpoint of OUTPUT holds the model state accelerate saves for an FSDP model (pytorch_model_fsdp*),
    which a run that fell back to DDP (accelerate ignoring the FSDP config on CPU) or DeepSpeed never writes."""
    saved = complete_checkpoints(output)
    assert saved, f"{output}: no checkpoint"
    assert [name for name in saved if any((output / name).glob("pytorch_model_fsdp*"))] == saved, saved


def same_weights(a: Path, b: Path) -> float:
    """The largest absolute difference between the saved weights of runs A and B (same keys asserted)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)
