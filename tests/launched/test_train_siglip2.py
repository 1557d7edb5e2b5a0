"""`disco-clip train` on SigLIP 2 with NaFlex (recipes/models/siglip2_tiny.json, a budget of 64 patches): 2 ranks x
16 under ZeRO-2 (torchrun), stopped by a signal at step 2 and resumed, train exactly like 1 rank with 2
contrastively accumulated micro-batches of 16 (within 1e-4 of the update), from one saved initialisation: the
global sigmoid loss, the sample-keyed crops and the padded budget are the same whatever the split and however
interrupted. A budget outside the position grid stops both ranks with one line and exit 2. (The loss against
Siglip2Model in float64: tests/unit/models/test_siglip2.py; the pipeline against Siglip2ImageProcessor:
tests/unit/data/test_naflex.py.)"""

import subprocess
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD, TOKENIZER_DIR, launch, train_command, train_env
from disco_clip_ds.testing.runs import assert_same_training, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS, PER_RANK, BUDGET = 4, 16, "64"
SIGLIP2_TINY = REPO / "recipes/models/siglip2_tiny.json"


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory) -> Path:
    import torch

    from disco_clip_ds.models.build import build_model

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("init") / "siglip2"
    build_model(model_config=str(SIGLIP2_TINY)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial_model):
    root = tmp_path_factory.mktemp("siglip2_runs")
    write_shards(root / "shards", num_shards=2, per_shard=64, seed=4)
    common = [
        "--model_name_or_path", str(initial_model), "--train_shards", f"{root}/shards/{{00000..00001}}.tar",
        "--train_num_samples", "128", "--max_steps", str(STEPS), *SGD, "--max_num_patches", BUDGET,
        "--per_device_train_batch_size", str(PER_RANK),
        "--accelerator_config", '{"dispatch_batches": true}',  # step t sees one global batch at any world size
    ]  # fmt: skip
    launch("torchrun", 1, root / "n1_k2", *common, "--gradient_accumulation_steps", "2")
    stopped = ["--save_steps", "2", *common]
    command = train_command("torchrun", 2) + ["--output_dir", str(root / "resumed"), *LAUNCH_COMMON, *stopped]
    command += ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]  # as launch() passes it
    stop = subprocess.run(command, cwd=REPO, env=train_env(DISCO_FAULT="signal_at_step=SIGUSR1:step=2,rank=1"))
    assert stop.returncode != 0 and (root / "resumed" / "checkpoint-2").is_dir()  # stopped there with a checkpoint
    launch("torchrun", 2, root / "resumed", *stopped, "--resume_from_checkpoint", "latest")
    return root


def test_two_ranks_stopped_and_resumed_train_like_one_rank_with_two_accumulated_micro_batches(runs, initial_model):
    assert_same_training(runs / "resumed", runs / "n1_k2", weights(initial_model), steps=STEPS)


def test_the_result_is_a_plain_siglip2model_with_its_processor_at_the_budget(runs):
    import json

    from transformers import AutoProcessor, Siglip2Model

    out = runs / "n1_k2"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Siglip2Model"]
    assert type(Siglip2Model.from_pretrained(out)) is Siglip2Model
    processor = AutoProcessor.from_pretrained(out)
    assert processor.image_processor.max_num_patches == int(BUDGET) and processor.image_processor.patch_size == 4
    assert json.loads((out / "run.json").read_text())["max_num_patches"] == int(BUDGET)


def test_a_budget_above_the_position_grid_stops_every_rank_with_one_line(tmp_path):
    write_shards(tmp_path / "data", num_shards=4, per_shard=4)  # one a reader: the budget is the only fault
    cmd = [
        *train_command("torchrun", 2), "--output_dir", str(tmp_path / "out"), "--report_to", "none",
        "--train_shards", str(tmp_path / "data"), "--model_config", str(SIGLIP2_TINY),
        "--tokenizer_name", str(TOKENIZER_DIR), "--max_num_patches", "300",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    line = "--max_num_patches 300: above the 16 x 16 = 256 position grid; give at most 256"
    assert proc.returncode != 0 and log.count(line) == 2 and "(exitcode: 2)" in log, log[-3000:]
    assert not (tmp_path / "out" / "model.safetensors").exists()
