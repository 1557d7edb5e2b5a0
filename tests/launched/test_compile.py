"""--torch_compile end to end: a run with both towers compiled by inductor (on this machine's C++ compiler) trains
to the eager run's weights (fp32, 20 steps, ZeRO-2, contrastive accumulation over K=2 micro-batches, so that the
towers run compiled without grad and then with it), and saves the same keys as the eager run. (The in-process
checks and the fallback: tests/unit/train/test_compile.py.)"""

import json

import pytest
import torch

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO, SGD, launch_in_one_process
from disco_clip_ds.testing.ranks import free_port
from disco_clip_ds.testing.runs import assert_same_training, save_initial_model, weights

STEPS, MICRO, K, SEED = 20, 4, 2, 13
# SGD's update is linear in the gradient, so a tower whose gradient the compiled graph got wrong shows in the weights;
# lr 0.1: 20 steps at the launches' usual 0.5 drive the tiny model's logit scale to its clamp
COMPILE_SGD = [*SGD[:2], "--learning_rate", "0.1", *SGD[4:]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The eager reference and the compiled run, one interpreter (the imports paid once) as a one-rank launch:
    DeepSpeed finds the rendezvous a launcher would set in the environment. Inductor's cache is its default one
    (/tmp/torchinductor_$USER), so a second session loads the kernels the first one compiled."""
    root = tmp_path_factory.mktemp("compile")
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    monkeypatch = pytest.MonkeyPatch()
    for name, value in {**rank, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    write_shards(root / "data", num_shards=2, per_shard=32, seed=3)
    save_initial_model(root / "init", SEED)
    common = [
        "--model_name_or_path",
        str(root / "init"),
        "--train_shards",
        f"{root}/data/{{00000..00001}}.tar",
        *COMPILE_SGD,
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "10",
        "--per_device_train_batch_size",
        str(MICRO),
        "--gradient_accumulation_steps",
        str(K),
        "--deepspeed",
        str(REPO / "ds_configs" / "cpu_zero2.json"),
    ]
    try:
        launch_in_one_process([(root / "eager", common), (root / "compiled", [*common, "--torch_compile", "true"])])
    finally:
        monkeypatch.undo()
    return root


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_compiled_towers_train_to_the_eager_weights(runs):
    log = (runs / "compiled.log").read_text()
    assert "the vision tower and text tower compiled (backend inductor" in log, log[-3000:]
    assert "tower runs eager" not in log and "Traceback" not in log, log[-3000:]  # no tower fell back
    assert "compiled" not in (runs / "eager.log").read_text()
    # fp32 reduction-order noise of inductor's fused kernels against eager's, over 20 steps: within 1e-4 relative
    assert_same_training(runs / "compiled", runs / "eager", weights(runs / "init"), steps=STEPS, update_rtol=1e-4)


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_compiled_run_saves_the_eager_keys(runs):
    """The final model, the checkpoint's DeepSpeed model states and its config: no `_orig_mod.` or other prefix."""
    for folder in (runs / "compiled", runs / "compiled" / "checkpoint-10"):
        assert weights(folder).keys() == weights(runs / "eager").keys(), folder
    states = torch.load(
        runs / "compiled" / "checkpoint-10" / "global_step10" / "mp_rank_00_model_states.pt", weights_only=False
    )
    reference = torch.load(
        runs / "eager" / "checkpoint-10" / "global_step10" / "mp_rank_00_model_states.pt", weights_only=False
    )
    assert list(states["module"]) == list(reference["module"])
    assert not [key for key in states["module"] if "_orig_mod" in key]
    config = json.loads((runs / "compiled" / "config.json").read_text())
    assert config["architectures"] == ["CLIPModel"]
