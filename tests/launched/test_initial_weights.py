"""Fresh runs of the tiny CLIP (`--model_config`, one `--seed`) on 1 and 2 CPU ranks, under ZeRO-2 and ZeRO-3 and
each launcher: they start from the same weights, bit for bit, the ones `build_model(seed=...)` draws in this
process; and a one-rank run, under any launcher, leaves nothing in /dev/shm.

Each run takes one step at a learning rate of 1e-30, far below a float32 ulp of any drawn weight, and saves: its
saved model is its initial model, consolidated from whatever partitioning it trained under (only a weight drawn as
exactly 0 can move, by ~1e-30). Each run gets a /dev/shm of its own (`in_private_shm`: root and unshare), so that
what it leaves there is told apart from other processes' files exactly.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, LAUNCH_SEED, REPO, SGD, TINY_CONFIG, run_training, train_command
from disco_clip_ds.testing.ranks import in_private_shm
from disco_clip_ds.testing.runs import weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None, reason="a private /dev/shm needs root and unshare"
    ),
]

# (launcher, ranks, DeepSpeed config): every launcher on one rank (ZeRO-2, and ZeRO-3 in accelerate's yaml)
RUNS = [
    ("deepspeed", 1, "cpu_zero2.json"),
    ("torchrun", 1, "cpu_zero2.json"),
    ("accelerate", 1, "cpu_zero3.json"),
    # two ranks: ZeRO-3 partitions the model as it is built (ZeRO-2 only after it is); torchrun starts sooner, and the
    # launchers are the one-rank runs' subject
    ("torchrun", 2, "cpu_zero3.json"),
]
ONE_RANK = [run for run in RUNS if run[1] == 1]


def _name(launcher: str, nproc: int, ds_config: str) -> str:
    return f"{launcher}_{nproc}_{ds_config.removesuffix('.json')}"


def _launch(root: Path, launcher: str, nproc: int, ds_config: str) -> list[str]:
    """One fresh 1-step run in a private /dev/shm; what it left there."""
    out, shm = root / _name(launcher, nproc, ds_config), root / f"{_name(launcher, nproc, ds_config)}.shm"
    shm.mkdir()
    args = ["--output_dir", str(out), "--model_config", str(TINY_CONFIG), "--train_shards",
            f"{root}/shards/{{00000..00001}}.tar", *LAUNCH_COMMON, "--train_num_samples", "32",
            "--per_device_train_batch_size", "4", *SGD, "--learning_rate", "1e-30", "--max_steps", "1"]  # fmt: skip
    yaml = None
    if launcher == "accelerate":
        yaml = REPO / "recipes/accelerate" / ds_config.replace("cpu_", "deepspeed_").replace(".json", ".yaml")
    else:
        args += ["--deepspeed", str(REPO / "ds_configs" / ds_config)]
    run_training(in_private_shm(shm, train_command(launcher, nproc, yaml) + args), log=root / f"{out.name}.log")
    return sorted(os.listdir(shm))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run: (its saved weights, what it left in its /dev/shm)} for every run in RUNS (all seeded LAUNCH_SEED)."""
    root = tmp_path_factory.mktemp("fresh")
    write_shards(root / "shards", num_shards=2, per_shard=16, seed=1)
    left = {run: _launch(root, *run) for run in RUNS}
    return {run: (weights(root / _name(*run)), left[run]) for run in RUNS}


@pytest.mark.parametrize("run", ONE_RANK, ids=[_name(*run) for run in ONE_RANK])
def test_a_one_rank_run_leaves_nothing_in_dev_shm(runs, run):
    # the deepspeed launcher's one rank creates deepspeed_allreduce_buffer_* (66 MiB) at engine start
    assert runs[run][1] == []


def test_a_fresh_model_starts_from_the_same_weights_under_every_stage_and_world_size(runs):
    """The weights `build_model` draws here for the seed are what every run saved: bit for bit, except a weight
    drawn as exactly 0, which one step at lr 1e-30 may move by at most ~1e-30 x its gradient."""
    from disco_clip_ds.models.build import build_model

    torch.manual_seed(LAUNCH_SEED + 1)  # the global generator's state is no input
    expected = build_model(model_config=str(TINY_CONFIG), seed=LAUNCH_SEED).state_dict()
    for run, (saved, _) in runs.items():
        assert saved.keys() == expected.keys(), run
        for name, value in expected.items():
            drawn_zero = value == 0
            assert torch.equal(saved[name][~drawn_zero], value[~drawn_zero]), f"{_name(*run)}: {name}"
            assert (saved[name][drawn_zero].abs() < 1e-25).all(), f"{_name(*run)}: {name}"
