"""Training end to end on 2 CPU ranks, all against one reference run (2 ranks, ZeRO-2, tiled loss): N=1 x 2b == N=2 x b
(losses and weights), ZeRO-3 == ZeRO-2, FSDP == DeepSpeed, tiled == disco; the deepspeed, torchrun and accelerate
launchers; corrupt shards; the saved model loads as a plain CLIPModel in a fresh process.

A launch costs most of its time in imports, so each run serves several checks (module-scoped fixtures).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_SEED, QUICK, REPO, SGD, launch
from disco_clip_ds.testing.runs import assert_same_training, assert_trained_under_fsdp, save_initial_model, weights

# the module's five launches are the first test's setup: on two shared cores (two test workers), minutes
pytestmark = pytest.mark.timeout(1500)
STEPS, PER_RANK, SEED = 5, 8, LAUNCH_SEED

# accelerate's dispatch_batches: rank 0 reads the stream and hands out consecutive slices, so step t sees the
# same global batch at any world size (by default each rank reads its own shards).
SAME_STREAM = ["--max_steps", str(STEPS), "--accelerator_config", '{"dispatch_batches": true}']

BAD_PER_PASS = 4  # two corrupt images, one sample without text, one missing shard (see `shards`)


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory):
    return save_initial_model(tmp_path_factory.mktemp("init") / "tiny", SEED)


@pytest.fixture(scope="module")
def initial_weights(initial_model):
    return weights(initial_model)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """4 shards x 24 samples; the first sample of three shards is bad, and the list names a missing shard."""
    folder = tmp_path_factory.mktemp("shards")
    write_shards(
        folder,
        num_shards=4,
        per_shard=24,
        seed=1,
        bad={0: "corrupt", 24: "no_text", 48: "corrupt", 72: "gray", 73: "rgba"},
    )
    return f"{folder}/{{00000..00004}}.tar"  # 00004.tar is missing


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards, initial_model):
    """One run per launcher and engine, doubling as the equivalence runs. (Each rank reading its
    own shards, and resuming, are test_checkpoints' runs.)"""
    root = tmp_path_factory.mktemp("runs")
    common = [
        "--model_name_or_path",
        str(initial_model),
        "--train_shards",
        shards,
        "--train_num_samples",
        "96",
        *SGD,
        *SAME_STREAM,
    ]
    launch(QUICK, 1, root / "n1_zero2_tiled", *common, "--per_device_train_batch_size", str(2 * PER_RANK))
    launch("torchrun", 2, root / "n2_zero2_tiled", *common, "--per_device_train_batch_size", str(PER_RANK))
    launch(
        "accelerate",
        2,
        root / "n2_zero3_tiled",
        *common,
        "--per_device_train_batch_size",
        str(PER_RANK),
        ds_config="cpu_zero3.json",
    )
    launch(
        "accelerate", 2, root / "n2_fsdp_tiled", *common, "--per_device_train_batch_size", str(PER_RANK), ds_config=None
    )
    launch(
        "deepspeed",
        2,
        root / "n2_zero2_disco",
        *common,
        "--per_device_train_batch_size",
        str(PER_RANK),
        "--loss_impl",
        "disco",
    )
    return root


EQUIVALENT_RUNS = {  # run: the run it must train exactly like, from the same initial weights
    "n1_zero2_tiled": "n2_zero2_tiled",  # one rank with 2b, two ranks with b
    "n2_zero3_tiled": "n2_zero2_tiled",  # ZeRO-3, ZeRO-2
    "n2_fsdp_tiled": "n2_zero2_tiled",  # FSDP, DeepSpeed
    "n2_zero2_disco": "n2_zero2_tiled",  # the disco loss, the tiled loss
}


@pytest.mark.slow
@pytest.mark.parametrize("run", list(EQUIVALENT_RUNS))
def test_trains_like_its_equivalent_run(runs, initial_weights, run):
    if "fsdp" in run:  # FSDP proper (torch's fully_shard), not DDP: what accelerate alone would train on CPU
        assert_trained_under_fsdp(runs / run)
    assert_same_training(runs / run, runs / EQUIVALENT_RUNS[run], initial_weights, steps=STEPS)


@pytest.mark.slow
def test_bad_samples_are_skipped_counted_and_reported_in_every_launch(runs):
    for name in ("n1_zero2_tiled", "n2_zero2_tiled", "n2_zero3_tiled", "n2_fsdp_tiled", "n2_zero2_disco"):
        skipped = json.loads((runs / name / "train_results.json").read_text())["skipped_samples"]
        assert skipped >= BAD_PER_PASS, name  # every shard was opened at least once in 5 x 16 samples
        assert f"skipped samples: {skipped}" in (runs / f"{name}.log").read_text()


@pytest.mark.slow
def test_logs_carry_the_clip_metrics(runs):
    history = json.loads((runs / "n2_zero3_tiled" / "trainer_state.json").read_text())["log_history"]
    logged = history[0]
    for key in (
        "loss",
        "logit_scale",
        "global_contrastive_batch",
        "samples_per_s",
        "samples_per_s_per_rank",
        "step_time_s",
        "data_time_s",
        "peak_mem_gib_rank0",
        "peak_mem_gib_rank1",
        "skipped_samples",
    ):
        assert key in logged, key
    assert logged["global_contrastive_batch"] == 2 * PER_RANK
    assert logged["logit_scale"] == pytest.approx(1 / 0.07, rel=1e-3)  # CLIP's initial temperature, read under ZeRO-3
    assert logged["samples_per_s_per_rank"] == pytest.approx(logged["samples_per_s"] / 2)
    run = json.loads((runs / "n2_zero3_tiled" / "run.json").read_text())  # for the exported model card
    assert run["global_contrastive_batch"] == 2 * PER_RANK and run["world_size"] == 2 and run["data"]


@pytest.mark.slow
def test_saved_models_load_as_plain_clipmodel_in_a_fresh_process(runs):
    code = (
        "import sys, torch; from transformers import CLIPModel, CLIPProcessor\n"
        "for d in sys.argv[1:]:\n"
        "    m = CLIPModel.from_pretrained(d); p = CLIPProcessor.from_pretrained(d)\n"
        "    assert type(m).__name__ == 'CLIPModel' and m.logit_scale.dim() == 0\n"
        "    assert p.image_processor.crop_size['height'] == 64, p.image_processor.crop_size\n"
        "    print(d, m.logit_scale.item())\n"
    )
    dirs = [str(runs / "n2_zero2_tiled"), str(runs / "n2_zero3_tiled"), str(runs / "n2_fsdp_tiled")]
    out = subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    from transformers import CLIPConfig, CLIPModel

    clip_keys = CLIPModel(CLIPConfig.from_json_file(str(REPO / "recipes/models/tiny.json"))).state_dict().keys()
    for d in dirs:
        assert json.loads((Path(d) / "config.json").read_text())["architectures"] == ["CLIPModel"]
        assert weights(Path(d)).keys() == clip_keys  # CLIP's own checkpoint layout, from every ZeRO stage
