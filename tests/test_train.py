"""Training end to end on 2 CPU ranks: N=1 x 2b == N=2 x b (losses and weights), ZeRO-3 == ZeRO-2, tiled ==
disco; the deepspeed, torchrun and accelerate launchers; corrupt shards; bad arguments; the saved model loads as a
plain CLIPModel in a fresh process. (Resume, and ranks reading their own shards, are in test_checkpoints.py.)

A launch costs most of its time in imports, so each run serves several checks (module-scoped fixtures).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_SEED, REPO, SGD, launch

from helpers import assert_same_training, assert_trained_under_fsdp, save_initial_model, weights

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
    return f"{folder}/{{00000..00003}}.tar::{folder}/missing.tar"


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
    launch("deepspeed", 1, root / "n1_zero2_tiled", *common, "--per_device_train_batch_size", str(2 * PER_RANK))
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
def test_bad_samples_are_skipped_counted_and_reported(runs):
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


# --- bad input: clear errors before any rank starts work (in-process, no launcher) ---


def _train_main(tmp_path, *args):
    """`disco-clip train` in this process: its exit code, its messages on stderr."""
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.train.run import main

    return run_main(main, ["--output_dir", str(tmp_path / "out"), "--report_to", "none", *args], "disco-clip train")


MODEL = ["--model_config", str(REPO / "recipes/models/tiny.json")]
TOK = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]
# (arguments after --train_shards; "{data}", "{tmp}" and "{wrong_eos}" are filled in per test; the message to expect)
BAD_ARGUMENTS = {
    "missing shards": (["{tmp}/nowhere", *MODEL, *TOK], "nowhere"),
    "no tokenizer": (["{data}", *MODEL], "needs --tokenizer_name"),
    "tokenizer mismatch": (["{data}", "--model_config", "{wrong_eos}", *TOK], "does not match the model's text config"),
    "image size": (["{data}", *MODEL, *TOK, "--image_size", "224"], "differs from the model's 64"),
    "zeroshot half set": (["{data}", *MODEL, *TOK, "--zeroshot_steps", "10"], "needs both --zeroshot_data"),
    "remote shards uncounted": (["https://host/{{0..3}}.tar", *MODEL, *TOK], "--train_num_samples"),
    "too few shards": (["{data}", *MODEL, *TOK, "--dataloader_num_workers", "3"], "lower --dataloader_num_workers"),
    "no hub token": (["{data}", *MODEL, *TOK, "--push_to_hub", "--hub_model_id", "u/n"], "no Hugging Face token"),
    "deepspeed not json": (["{data}", *MODEL, *TOK, "--deepspeed", "{not_json}"], "is not a readable JSON file"),
    "learning rate inf": (["{data}", *MODEL, *TOK, "--learning_rate", "inf"], "--learning_rate inf: give a finite"),
    "learning rate 1e30": (["{data}", *MODEL, *TOK, "--learning_rate", "1e30"], "--learning_rate 1e+30: give a"),
    "weight decay nan": (["{data}", *MODEL, *TOK, "--weight_decay", "nan"], "--weight_decay nan: give a finite"),
    "weight decay negative": (["{data}", *MODEL, *TOK, "--weight_decay", "-0.1"], "--weight_decay -0.1: give a"),
    "save steps 0": (["{data}", *MODEL, *TOK, "--save_steps", "0"], "--save_steps 0: give a positive number"),
    "text length 0": (["{data}", *MODEL, *TOK, "--max_text_length", "0"], "--max_text_length 0: give a positive"),
    "image size 0": (["{data}", *MODEL, *TOK, "--image_size", "0"], "--image_size 0: give a positive"),
    "chunk size 0": (["{data}", *MODEL, *TOK, "--chunk_size", "0"], "--chunk_size 0: give a positive"),
}


@pytest.fixture
def bad_arguments_setup(tmp_path, monkeypatch):
    """Tiny shards, a model config whose eos disagrees with the tokenizer, and no Hugging Face token anywhere."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))  # nor a cached one
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    config = json.loads((REPO / "recipes/models/tiny.json").read_text())
    config["text_config"]["eos_token_id"] = 49407
    (tmp_path / "wrong_eos.json").write_text(json.dumps(config))
    (tmp_path / "not.json").write_text('{"zero_optimization": {"stage": 2,')  # cut short
    return {
        "data": str(tmp_path / "data"),
        "tmp": str(tmp_path),
        "wrong_eos": str(tmp_path / "wrong_eos.json"),
        "not_json": str(tmp_path / "not.json"),
    }


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_get_a_message_saying_what_to_fix(case, bad_arguments_setup, tmp_path, capsys):
    argv, message = BAD_ARGUMENTS[case]
    argv = [arg.format(**bad_arguments_setup) for arg in argv]
    assert _train_main(tmp_path, "--train_shards", *argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow  # a fresh interpreter
def test_python_m_train_exits_with_the_errors_code_and_one_line(bad_arguments_setup, tmp_path):
    """`python -m disco_clip_ds.train`, as every launcher runs it, maps errors as `disco-clip train` does."""
    argv = ["--output_dir", str(tmp_path / "out"), "--train_shards", bad_arguments_setup["data"], *MODEL]
    result = subprocess.run(
        [sys.executable, "-m", "disco_clip_ds.train", *argv], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 2
    assert "disco-clip train: training from --model_config needs --tokenizer_name" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_earlier_runs_checkpoints_are_never_silently_overwritten(bad_arguments_setup, tmp_path, capsys):
    (tmp_path / "out" / "checkpoint-7").mkdir(parents=True)
    assert _train_main(tmp_path, "--train_shards", bad_arguments_setup["data"], *MODEL, *TOK) == 2
    assert "--resume_from_checkpoint latest" in capsys.readouterr().err


def test_deepspeed_batch_arithmetic_is_checked_against_the_arguments(tmp_path):
    from types import SimpleNamespace

    from disco_clip_ds.errors import UsageError
    from disco_clip_ds.train.run import check_deepspeed_batch

    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": "auto"}
        )
    )
    args = lambda micro, accum, world: SimpleNamespace(
        deepspeed=str(config),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        world_size=world,
    )
    check_deepspeed_batch(args(16, 2, 2))  # 16 x 2 x 2 = 64
    check_deepspeed_batch(args(16, 1, 4))
    with pytest.raises(UsageError, match="train_batch_size.*= .*'train_batch_size': 32"):
        check_deepspeed_batch(args(16, 1, 2))
    with pytest.raises(UsageError, match="train_micro_batch_size_per_gpu"):
        check_deepspeed_batch(args(8, 2, 4))
    config.write_text("{not json")
    with pytest.raises(UsageError, match="cannot read DeepSpeed config"):
        check_deepspeed_batch(args(16, 2, 2))
    for shipped in ("cpu_zero2.json", "cpu_zero3.json"):  # all "auto": any arguments fit
        check_deepspeed_batch(
            SimpleNamespace(
                deepspeed=str(REPO / "ds_configs" / shipped),
                per_device_train_batch_size=3,
                gradient_accumulation_steps=5,
                world_size=7,
            )
        )


def test_epochs_become_max_steps_from_the_counted_samples(tmp_path):
    from types import SimpleNamespace

    from disco_clip_ds.data.shards import expand_shards
    from disco_clip_ds.train.run import DataArguments, _steps_and_samples

    folder = tmp_path / "data"
    write_shards(folder, num_shards=2, per_shard=50)  # sizes.json: 100 samples
    urls = expand_shards(str(folder))
    args = SimpleNamespace(
        per_device_train_batch_size=8, gradient_accumulation_steps=2, world_size=2, max_steps=-1, num_train_epochs=3
    )
    assert _steps_and_samples(DataArguments(train_shards=str(folder)), args, urls) == (10, 100)  # ceil(300 / 32)
    assert _steps_and_samples(DataArguments(train_shards=str(folder), train_num_samples=64), args, urls) == (6, 64)
    args.max_steps = 7
    assert _steps_and_samples(DataArguments(train_shards=str(folder)), args, urls) == (7, 100)


def test_locked_towers_are_frozen_and_the_rest_trains():
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.run import ModelArguments, _lock_towers

    model = build_model(model_config=str(REPO / "recipes/models/tiny.json"))
    _lock_towers(model, ModelArguments(lock_image_tower=True))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("vision_model.", "visual_projection.")) for n in trainable)
    assert {"logit_scale", "text_projection.weight"} <= trainable and any(
        n.startswith("text_model.") for n in trainable
    )
    _lock_towers(model, ModelArguments(lock_text_tower=True))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"logit_scale"}
