"""Every refusal of `disco-clip train` (`disco_clip_ds.train.validate`), before any work: in-process runs of the
command with one bad argument each, the DeepSpeed batch arithmetic against the arguments, accumulation settings,
epochs into steps, readers without samples."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.images import empty_second_shard, write_shards
from disco_clip_ds.testing.launch import REPO

MODEL = ["--model_config", str(REPO / "recipes/models/tiny.json")]
TOK = ["--tokenizer_name", str(REPO / "recipes/tokenizer")]

SIGLIP = REPO / "recipes/models/siglip_tiny.json"
SIGLIP2 = ["--model_config", str(REPO / "recipes/models/siglip2_tiny.json")]
# two stages over steps of 4 micro-batches of 2 per rank: a stage may run 2, 4 or 8 rows a forward
SCHEDULE_K4 = [
    "--resolution_schedule",
    "0:32,0.5:64",
    "--per_device_train_batch_size",
    "2",
    "--gradient_accumulation_steps",
    "4",
]

# (arguments after --train_shards; "{data}", "{tmp}" and the configs of `bad_inputs` are filled in per test; the
# message to expect)
BAD_ARGUMENTS = {
    "missing shards": (["{tmp}/nowhere", *MODEL, *TOK], "nowhere: no such file or folder"),
    "no shard of a pattern": (["{tmp}/{{0..3}}.tar", *MODEL, *TOK], "none of the 4 shards exists, e.g."),
    "a missing source of a mixture": (["{data}::{tmp}/nosuch", *MODEL, *TOK], "--train_shards source 1 (/"),
    "a missing source of a weighted mixture": (
        ["{data}::{tmp}/nosuch", *MODEL, *TOK, "--train_data_weights", "1", "1", "--train_num_samples", "8"],
        "/nosuch): no such file or folder",
    ),
    "no shard of one source": (
        ["{tmp}/{{0..3}}.tar::{data}", *MODEL, *TOK],
        "/{0..3}.tar): none of the 4 shards exists",
    ),
    "a source twice": (["{data}::{data}", *MODEL, *TOK], "names the shard data/00000.tar twice: name each shard once"),
    "a shard in two sources": (["{data}::{data}/00001.tar", *MODEL, *TOK], "data/00001.tar twice: name each"),
    "a weight that underflows": (
        ["{data}/00000.tar::{data}/00001.tar", *MODEL, *TOK, "--train_data_weights", "1e308", "1e-308"],
        "--train_data_weights: data weights 1e+308 1e-308: source 1's share underflows to 0",
    ),
    "config a list": (["{data}", "--model_config", "{list_json}", *TOK], "list.json holds a JSON list, not a config"),
    "siglip sizes differ": (
        ["{data}", "--model_config", "{siglip_32}", *TOK],
        "text_config projection_size 32 differs from vision_config hidden_size 64",
    ),
    "clip sizes differ": (
        ["{data}", "--model_config", "{clip_32}", *TOK],
        "embedding sizes differ (projection_dim 64, text_config projection_dim 32, vision_config projection_dim 64)",
    ),
    "resume missing": (["{data}", *MODEL, *TOK, "--resume_from_checkpoint", "{tmp}/gone"], "gone: no such folder"),
    "no tokenizer": (["{data}", *MODEL], "needs --tokenizer_name"),
    "tokenizer mismatch": (["{data}", "--model_config", "{wrong_eos}", *TOK], "does not match the model's text config"),
    "image size": (["{data}", *MODEL, *TOK, "--image_size", "224"], "differs from the model's 64"),
    "zeroshot data missing": (
        ["{data}", *MODEL, *TOK, "--zeroshot_data", "{tmp}/noeval", "--zeroshot_steps", "5"],
        "noeval: no such file or folder",
    ),
    "zeroshot half set": (["{data}", *MODEL, *TOK, "--zeroshot_steps", "10"], "needs both --zeroshot_data"),
    "remote shards uncounted": (["https://host/{{0..3}}.tar", *MODEL, *TOK], "--train_num_samples"),
    "too few shards": (["{data}", *MODEL, *TOK, "--dataloader_num_workers", "3"], "lower --dataloader_num_workers"),
    "no hub token": (["{data}", *MODEL, *TOK, "--push_to_hub", "--hub_model_id", "u/n"], "no Hugging Face token"),
    "deepspeed not json": (["{data}", *MODEL, *TOK, "--deepspeed", "{not_json}"], "not.json: not valid JSON at line 1"),
    "learning rate inf": (["{data}", *MODEL, *TOK, "--learning_rate", "inf"], "--learning_rate inf: give a finite"),
    "learning rate 1e30": (["{data}", *MODEL, *TOK, "--learning_rate", "1e30"], "--learning_rate 1e+30: give a"),
    "weight decay nan": (["{data}", *MODEL, *TOK, "--weight_decay", "nan"], "--weight_decay nan: give a finite"),
    "weight decay negative": (["{data}", *MODEL, *TOK, "--weight_decay", "-0.1"], "--weight_decay -0.1: give a"),
    "vision lr 0": (["{data}", *MODEL, *TOK, "--vision_lr", "0"], "--vision_lr 0: give a finite number in (0, 1]"),
    "text weight decay nan": (["{data}", *MODEL, *TOK, "--text_weight_decay", "nan"], "--text_weight_decay nan: give"),
    "layer decay above 1": (["{data}", *MODEL, *TOK, "--text_layer_decay", "1.5"], "--text_layer_decay 1.5: give a"),
    "layer decay under a deepspeed optimizer": (
        ["{data}", *MODEL, *TOK, "--vision_layer_decay", "0.85", "--deepspeed", "{ds_optimizer}"],
        '--vision_layer_decay: the --deepspeed config\'s "optimizer" block makes DeepSpeed build the optimizer',
    ),
    "lamb under a deepspeed optimizer": (
        ["{data}", *MODEL, *TOK, "--optim", "lamb", "--deepspeed", "{ds_optimizer}"],
        '--optim lamb: the --deepspeed config\'s "optimizer" block would make DeepSpeed build its AdamW optimizer, not',
    ),
    "lamb under deepspeed's own lamb": (
        ["{data}", *MODEL, *TOK, "--optim", "lamb", "--deepspeed", "{ds_lamb}"],
        "build DeepSpeed's own Lamb, a fused CUDA op that under ZeRO takes its trust ratio per flat partition",
    ),
    "lamb with optim args": (
        ["{data}", *MODEL, *TOK, "--optim", "lamb", "--optim_args", "trust_clip=true"],
        "--optim_args trust_clip=true: --optim lamb takes none",
    ),
    "patch dropout 1": (["{data}", *MODEL, *TOK, "--patch_dropout", "1"], "--patch_dropout 1: give the fraction"),
    "patch dropout until without a rate": (
        ["{data}", *MODEL, *TOK, "--patch_dropout_until_step", "5"],
        "--patch_dropout_until_step 5 without --patch_dropout",
    ),
    "patch dropout until step 0": (
        ["{data}", *MODEL, *TOK, "--patch_dropout", "0.5", "--patch_dropout_until_step", "0"],
        "--patch_dropout_until_step 0: give the step",
    ),
    "save steps 0": (["{data}", *MODEL, *TOK, "--save_steps", "0"], "--save_steps 0: give a positive number"),
    "text length 0": (["{data}", *MODEL, *TOK, "--max_text_length", "0"], "--max_text_length 0: give a positive"),
    "image size 0": (["{data}", *MODEL, *TOK, "--image_size", "0"], "--image_size 0: give a positive"),
    "chunk size 0": (["{data}", *MODEL, *TOK, "--chunk_size", "0"], "--chunk_size 0: give a positive"),
    "budget 0": (["{data}", *SIGLIP2, *TOK, "--max_num_patches", "0"], "--max_num_patches 0: give a positive"),
    "budget for a square-image model": (
        ["{data}", *MODEL, *TOK, "--max_num_patches", "64"],
        "--max_num_patches is SigLIP 2's (NaFlex); this is a clip model",
    ),
    "image size for siglip2": (
        ["{data}", *SIGLIP2, *TOK, "--image_size", "64"],
        "--image_size: SigLIP 2 keeps each image's aspect ratio",
    ),
    "teacher for siglip2": (
        ["{data}", *SIGLIP2, *TOK, "--teacher", "{siglip_teacher}"],
        "--teacher: distillation into SigLIP 2 is not supported",
    ),
    "patch dropout for siglip2": (
        ["{data}", *SIGLIP2, *TOK, "--patch_dropout", "0.5"],
        "--patch_dropout: not supported for SigLIP 2",
    ),
    "distill weight without a teacher": (
        ["{data}", *MODEL, *TOK, "--distill_weight", "0.5"],
        "--distill_weight without --teacher",
    ),
    "teacher missing": (["{data}", *MODEL, *TOK, "--teacher", "{tmp}/noteacher"], "noteacher: no such folder"),
    "teacher without weights": (  # e.g. a ZeRO-3 checkpoint's folder: config.json beside ZeRO shards
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}"],
        "clip_teacher: no model weights in the folder (model.safetensors or pytorch_model.bin)",
    ),
    "teacher of another family": (
        ["{data}", *MODEL, *TOK, "--teacher", "{siglip_teacher}"],
        "a siglip model cannot teach a clip one",
    ),
    "distill weight 0": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "--distill_weight", "0"],
        "--distill_weight 0: give a number in (0, 1]",
    ),
    "distill temperature negative": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "--distill_temperature", "-1"],
        "--distill_temperature -1: give a positive number",
    ),
    "embeddings missing": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "--teacher_embeddings", "{half_embedded}"],
        "no embeddings of shard data/00001.tar (00001.",
    ),
    "embeddings of another teacher": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "--teacher_embeddings", "{foreign_embedded}"],
        ".teacher.safetensors was made by another teacher (fingerprint x, not ",
    ),
    "embeddings of another shard": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "--teacher_embeddings", "{copied_embedded}"],
        ".teacher.safetensors was made for shard data/00000.tar, not data/00001.tar: run `disco-clip data embed",
    ),
    "peak tflops not positive": (
        ["{data}", *MODEL, *TOK, "--peak_tflops", "0"],
        "--peak_tflops 0.0: give one device's dense peak in TFLOPs, finite and above 0",
    ),
    "embeddings without a teacher": (
        ["{data}", *MODEL, *TOK, "--teacher_embeddings", "{tmp}"],
        "--teacher_embeddings without --teacher",
    ),
    "teacher with the local loss": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "--loss_impl", "local"],
        "--teacher distils the global batch's similarities",
    ),
    "teacher listed twice": (  # an ensemble's mean would count it twice
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "{siglip_teacher}", "{clip_teacher}/"],
        "/clip_teacher/ is listed twice (as /tmp/",
    ),
    "ensemble member of another family": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "{siglip_teacher}"],
        "/siglip_teacher: a siglip model cannot teach a clip one",
    ),
    "resolution schedule not increasing": (
        ["{data}", *MODEL, *TOK, "--resolution_schedule", "0:48,0.5:32"],
        "--resolution_schedule 0:48,0.5:32: entry '0.5:32' after 0:48: fractions and sizes must both increase",
    ),
    "resolution side not a patch multiple": (
        ["{data}", *MODEL, *TOK, "--resolution_schedule", "0:40,0.5:64"],
        "--resolution_schedule 0:40,0.5:64: side 40 is not a multiple of the patch size 16; use 32 or 48",
    ),
    "resolution schedule with a teacher": (
        ["{data}", *MODEL, *TOK, "--resolution_schedule", "0:32,0.5:64", "--teacher", "{clip_teacher}"],
        "--resolution_schedule 0:32,0.5:64 with --teacher: not supported together",
    ),
    "naflex budget schedule against max_num_patches": (
        ["{data}", *SIGLIP2, *TOK, "--resolution_schedule", "0:16,0.5:64", "--max_num_patches", "32"],
        "--resolution_schedule 0:16,0.5:64: its last budget 64 differs from --max_num_patches 32",
    ),
    "stage micro-batches without a schedule": (
        ["{data}", *MODEL, *TOK, "--stage_micro_batch_sizes", "8,4"],
        "--stage_micro_batch_sizes sets each --resolution_schedule stage's: give the schedule",
    ),
    "stage micro-batches not one per stage": (
        ["{data}", *MODEL, *TOK, *SCHEDULE_K4, "--stage_micro_batch_sizes", "8"],
        "--stage_micro_batch_sizes 8: 1 micro-batch sizes for 2 stages: give one per stage",
    ),
    "stage micro-batch not dividing the step": (
        ["{data}", *MODEL, *TOK, *SCHEDULE_K4, "--stage_micro_batch_sizes", "6,2"],
        "--stage_micro_batch_sizes 6,2: micro-batch 6: each stage's must be a multiple of "
        "--per_device_train_batch_size 2 that divides its 2 x 4 samples per step (one of 2, 4, 8)",
    ),
    "stage micro-batches under plain accumulation": (
        [
            "{data}",
            *MODEL,
            *TOK,
            *SCHEDULE_K4,
            "--stage_micro_batch_sizes",
            "4,2",
            "--contrastive_accumulation",
            "false",
        ],
        "--stage_micro_batch_sizes 4,2: with contrastive accumulation off (--contrastive_accumulation false) a larger "
        "micro-batch would contrast more pairs per loss: leave it on (the default), or give 2 for every stage",
    ),
    "ensemble member missing": (
        ["{data}", *MODEL, *TOK, "--teacher", "{clip_teacher}", "{tmp}/noteacher"],
        "noteacher: no such folder",
    ),
}


def _config(tmp_path, name: str, recipe: Path, **change) -> str:
    """A copy of a recipe's config with `change` ({"text_config": {...}}: merged into it) made, as TMP/NAME."""
    config = json.loads(recipe.read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (tmp_path / name).write_text(json.dumps(config))
    return str(tmp_path / name)


@pytest.fixture
def bad_inputs(bad_arguments_setup, tmp_path):
    """bad_arguments_setup, and model configs that cannot train: a list, towers of different embedding sizes."""
    (tmp_path / "list.json").write_text(json.dumps([json.loads((REPO / "recipes/models/tiny.json").read_text())]))
    ds_optimizer = {**json.loads((REPO / "ds_configs/cpu_zero2.json").read_text()), "optimizer": {"type": "AdamW"}}
    (tmp_path / "ds_optimizer.json").write_text(json.dumps(ds_optimizer))
    (tmp_path / "ds_lamb.json").write_text(json.dumps({**ds_optimizer, "optimizer": {"type": "Lamb"}}))
    for family, recipe in (("clip", REPO / MODEL[1]), ("siglip", SIGLIP)):  # a teacher's folder: its config.json
        (tmp_path / f"{family}_teacher").mkdir()
        (tmp_path / f"{family}_teacher" / "config.json").write_text(recipe.read_text())
    from disco_clip_ds.data.embeddings import shard_facts, sidecar_path, write_sidecar
    from disco_clip_ds.data.teacher_id import teacher_fingerprint

    rows = lambda: torch.zeros(4, 8)
    folders = (("half_embedded", ["00000"], None), ("foreign_embedded", ["00000", "00001"], "x"))
    folders += (("copied_embedded", ["00000", "00001"], None),)  # 00001's sidecar is a copy of 00000's (D3)
    for folder, shards, teacher in folders:
        for shard in shards:
            made_by = teacher or teacher_fingerprint(str(tmp_path / "clip_teacher"))
            url = str(tmp_path / "data" / f"{shard}.tar")
            made_for = url.replace("00001", "00000") if folder == "copied_embedded" else url
            keys = [str(i) for i in range(4)]
            meta = {"teacher": made_by, **shard_facts(made_for)}
            write_sidecar(sidecar_path(tmp_path / folder, url), keys, rows(), rows(), meta)
    return {
        "half_embedded": str(tmp_path / "half_embedded"),
        "foreign_embedded": str(tmp_path / "foreign_embedded"),
        "copied_embedded": str(tmp_path / "copied_embedded"),
        "clip_teacher": str(tmp_path / "clip_teacher"),
        "siglip_teacher": str(tmp_path / "siglip_teacher"),
        "ds_optimizer": str(tmp_path / "ds_optimizer.json"),
        "ds_lamb": str(tmp_path / "ds_lamb.json"),
        **bad_arguments_setup,
        "list_json": str(tmp_path / "list.json"),
        "siglip_32": _config(tmp_path, "siglip_32.json", SIGLIP, text_config={"projection_size": 32}),
        "clip_32": _config(tmp_path, "clip_32.json", REPO / MODEL[1], text_config={"projection_dim": 32}),
    }


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_get_a_message_saying_what_to_fix(case, bad_inputs, train_main, tmp_path, capsys):
    argv, message = BAD_ARGUMENTS[case]
    argv = [arg.format(**bad_inputs) for arg in argv]
    assert train_main("--train_shards", *argv) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(said) == 1 and message in said[0], said  # one line (transformers' own warnings aside)
    assert not (tmp_path / "out").exists()  # nothing written: no model, no run.lock


def test_a_siglip_text_shorter_than_the_pipelines_64_tokens_is_a_warning(bad_arguments_setup, tmp_path, caplog):
    """transformers' zero-shot pipeline pads SigLIP texts to 64 tokens: fewer positions train, but the exported
    model fails in that pipeline. A warning (the run goes on), and none for the shipped recipe's 64."""
    from disco_clip_ds.train.args import parse_args
    from disco_clip_ds.train.validate import validate

    def checked(config):
        argv = ["--output_dir", str(tmp_path / "out"), "--train_shards", bad_arguments_setup["data"], *TOK]
        caplog.clear()
        with caplog.at_level("WARNING", logger="disco_clip_ds.train"):
            return validate(*parse_args([*argv, "--model_config", config, "--dataloader_num_workers", "0"]))

    short = _config(tmp_path, "short.json", SIGLIP, text_config={"max_position_embeddings": 16})
    assert checked(short).max_length == 16
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"--model_config {short}: max_position_embeddings 16 in text_config" in warning
    assert "pads SigLIP texts to 64 tokens" in warning
    assert checked(str(SIGLIP)).max_length == 64
    assert caplog.records == []


def test_some_shards_of_a_pattern_missing_is_a_warning_and_the_run_goes_on(bad_arguments_setup, tmp_path, caplog):
    """img2dataset leaves gaps where a shard failed to download: the missing ones are said once and skipped while
    training (counted as bad samples: test_faults_and_preemption.py's `data` trains on such a list)."""
    from disco_clip_ds.train.args import parse_args
    from disco_clip_ds.train.validate import validate

    shards = f"{bad_arguments_setup['data']}/{{00000..00003}}.tar"  # 2 of the 4 exist
    argv = ["--output_dir", str(tmp_path / "out"), "--train_shards", shards, *MODEL, *TOK]
    with caplog.at_level("WARNING", logger="disco_clip_ds.train"):
        checked = validate(*parse_args([*argv, "--dataloader_num_workers", "0", "--train_num_samples", "8"]))
    assert len(checked.urls) == 4
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"2 of 4 shards not found, e.g. '{bad_arguments_setup['data']}/00002.tar'" in warning
    assert "skipped and counted as bad samples" in warning


def _ds_args(config, micro, accum, world):
    """What check_deepspeed_batch reads of DiscoTrainingArguments: the JSON as parse_args read it, and the batch."""
    return SimpleNamespace(
        deepspeed="ds.json",
        deepspeed_json=config,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        world_size=world,
    )


def test_deepspeed_batch_arithmetic_is_checked_against_the_arguments(tmp_path):
    from disco_clip_ds.train.args import parse_args
    from disco_clip_ds.train.validate import check_deepspeed_batch

    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": "auto"}
    check_deepspeed_batch(_ds_args(config, 16, 2, 2))  # 16 x 2 x 2 = 64
    check_deepspeed_batch(_ds_args(config, 16, 1, 4))
    with pytest.raises(UsageError, match="train_batch_size.*= .*'train_batch_size': 32"):
        check_deepspeed_batch(_ds_args(config, 16, 1, 2))
    with pytest.raises(UsageError, match="train_micro_batch_size_per_gpu"):
        check_deepspeed_batch(_ds_args(config, 8, 2, 4))
    broken = tmp_path / "ds.json"
    broken.write_text("{not json")  # refused by parse_args, which reads the JSON, before anything else does
    with pytest.raises(UsageError, match=f"--deepspeed {broken}: not valid JSON at line 1 column 2"):
        parse_args(["--output_dir", str(tmp_path / "out"), "--deepspeed", str(broken)])
    made = _ds_args(None, 16, 1, 2)  # arguments made without parse_args: the check reads the JSON itself
    made.deepspeed = str(tmp_path / "made.json")
    Path(made.deepspeed).write_text(json.dumps(config))
    with pytest.raises(UsageError, match="made.json: .*'train_batch_size': 64"):
        check_deepspeed_batch(made)
    assert made.deepspeed_json is None  # and leaves the arguments as they were
    for shipped in ("cpu_zero2.json", "cpu_zero3.json"):  # all "auto": any arguments fit
        check_deepspeed_batch(_ds_args(json.loads((REPO / "ds_configs" / shipped).read_text()), 3, 5, 7))


def test_parse_args_keeps_the_deepspeed_json_it_read(tmp_path):
    from disco_clip_ds.train.args import parse_args

    config = tmp_path / "ds.json"
    values = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto", "zero_optimization": {}}
    config.write_text(json.dumps(values))
    argv = ["--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "4", "--deepspeed", str(config)]
    *_, args = parse_args(argv)
    assert args.deepspeed_json == values
    assert "deepspeed_json" not in args.to_dict()  # not an argument: run.json and the Trainer's records leave it out
    *_, args = parse_args(argv[:2])
    assert args.deepspeed_json is None


def test_the_batch_check_is_the_planners(tmp_path):
    """Training and `disco-clip plan` refuse the same configs: one comparison (`plan.checks.batch_contradictions`)."""
    from disco_clip_ds.plan.checks import batch_contradictions

    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}
    assert batch_contradictions(config, 16, 2, 2) == {}
    assert batch_contradictions(config, 8, 2, 2) == {"train_batch_size": 64}
    assert batch_contradictions(config, 16, 1, 4) == {"gradient_accumulation_steps": 2}
    assert batch_contradictions({"train_batch_size": "auto"}, 1, 1, 1) == {}


def test_readers_are_ranks_times_workers():
    from disco_clip_ds.train.validate import readers

    def args(world, workers, dispatch):
        return SimpleNamespace(
            world_size=world,
            dataloader_num_workers=workers,
            accelerator_config=SimpleNamespace(dispatch_batches=dispatch),
        )

    assert readers(args(4, 3, False)) == 12
    assert readers(args(4, 0, False)) == 4  # no workers: the rank itself reads
    assert readers(args(4, 3, True)) == 3  # dispatch_batches: rank 0 reads for every rank


def _settings(**kw):
    base = dict(gradient_accumulation_steps=2, contrastive_accumulation=True, n_gpu=1, parallelism_config=None)
    return SimpleNamespace(**{**base, **kw})


def test_settings_that_cannot_accumulate_contrastively_are_refused():
    from disco_clip_ds.errors import AccumulationError
    from disco_clip_ds.train.validate import check_contrastive_accumulation

    check_contrastive_accumulation(_settings(), "tiled")
    check_contrastive_accumulation(_settings(), "disco")
    check_contrastive_accumulation(_settings(contrastive_accumulation=False), "local")  # independent losses: allowed
    check_contrastive_accumulation(_settings(gradient_accumulation_steps=1), "local")  # nothing to accumulate
    cases = [
        (_settings(), "local", "--contrastive_accumulation false"),
        (_settings(gradient_accumulation_steps=0), "tiled", ">= 1"),
        (_settings(gradient_accumulation_steps=-2, contrastive_accumulation=False), "tiled", ">= 1"),
        (_settings(n_gpu=2), "tiled", "one process per GPU"),
        (_settings(parallelism_config=SimpleNamespace(tp_size=2, cp_size=1)), "tiled", "data parallelism only"),
    ]
    for settings, impl, message in cases:
        with pytest.raises(AccumulationError, match=message):
            check_contrastive_accumulation(settings, impl)


def test_a_deepspeed_json_contradicting_the_accumulation_is_refused():
    from disco_clip_ds.train.validate import check_deepspeed_batch

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 8}
    check_deepspeed_batch(_ds_args(config, 4, 8, 2))
    with pytest.raises(UsageError, match="gradient_accumulation_steps.*--gradient_accumulation_steps 2"):
        check_deepspeed_batch(_ds_args(config, 4, 2, 2))


def test_epochs_become_max_steps_from_the_counted_samples(tmp_path):
    from types import SimpleNamespace

    from disco_clip_ds.data.shards import expand_shards
    from disco_clip_ds.train.args import DataArguments
    from disco_clip_ds.train.validate import steps_and_samples

    folder = tmp_path / "data"
    write_shards(folder, num_shards=2, per_shard=50)  # sizes.json: 100 samples
    urls = expand_shards(str(folder))
    args = SimpleNamespace(
        per_device_train_batch_size=8, gradient_accumulation_steps=2, world_size=2, max_steps=-1, num_train_epochs=3
    )
    assert steps_and_samples(DataArguments(train_shards=str(folder)), args, urls) == (10, 100)  # ceil(300 / 32)
    assert steps_and_samples(DataArguments(train_shards=str(folder), train_num_samples=64), args, urls) == (6, 64)
    args.max_steps = 7
    assert steps_and_samples(DataArguments(train_shards=str(folder)), args, urls) == (7, 100)


def test_a_reader_with_only_empty_shards_is_refused_before_the_model_is_built(tmp_path, capsys):
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.testing.launch import LAUNCH_COMMON, TINY_CONFIG

    shards = empty_second_shard(tmp_path / "shards", sizes=True)
    argv = ["--output_dir", str(tmp_path / "run"), "--model_config", str(TINY_CONFIG), "--train_shards", shards]
    argv += [*LAUNCH_COMMON, "--max_steps", "1", "--dataloader_num_workers", "2"]  # 1 rank x 2 workers: 2 readers
    assert run_main(main, argv, "disco-clip train") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "disco-clip train: reader 1 of 2 (rank 0, DataLoader worker 1) would read only shards without samples ("
        f"{tmp_path / 'shards' / '00001.tar'}: 0 samples in their sizes.json"
    ), err
    assert "leave empty shards out of --train_shards, or use fewer ranks x --dataloader_num_workers" in err[0]
    assert not (tmp_path / "run").exists()
    assert run_main(main, [*argv[:-2], "--dataloader_num_workers", "1", "--max_image_pixels", "0"], "t") == 2
    assert "--max_image_pixels 0: give a positive number" in capsys.readouterr().err


def test_max_image_pixels_is_checked_for_a_datasets_source_too(tmp_path, train_main, capsys):
    """--max_image_pixels 0 was refused only with --train_shards (inside the shard readers' check): a `datasets`
    source trained on with it."""
    from disco_clip_ds.testing.images import image_bytes

    rows = []
    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(image_bytes("PNG", color=40 * i))
        rows.append(f"{tmp_path / f'{i}.png'},a picture {i}")
    (tmp_path / "paths.csv").write_text("file,caption\n" + "\n".join(rows) + "\n")
    argv = ["--train_file", str(tmp_path / "paths.csv"), "--image_column", "file", *MODEL, *TOK]
    argv += ["--max_steps", "1", "--per_device_train_batch_size", "2", "--dataloader_num_workers", "0"]
    assert train_main(*argv, "--max_image_pixels", "0") == 2
    assert "--max_image_pixels 0: give a positive number of pixels" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--model_name_or_path", "--teacher"])
def test_weights_that_fail_their_manifest_are_refused_as_export_refuses_them(
    flag, bad_inputs, train_main, tmp_path, capsys
):
    """Initial weights or a teacher (a final or exported model) whose model.safetensors no longer matches its
    manifest: one line, exit 1, before any work (the weights were read as they were)."""
    import shutil

    from disco_clip_ds.checkpoint.manifest import write_manifest

    folder = tmp_path / "damaged"
    shutil.copytree(bad_inputs["clip_teacher"], folder)
    (folder / "model.safetensors").write_bytes(b"weights")
    write_manifest(folder)
    (folder / "model.safetensors").write_bytes(b"weightz")  # the same size: only the checksum shows it
    model = [*MODEL] if flag == "--teacher" else []
    assert train_main("--train_shards", bad_inputs["data"], *model, *TOK, flag, str(folder)) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert said == [
        f"disco-clip train: {flag} {folder} does not verify: model.safetensors does not match its checksum in the "
        "manifest; no checkpoint beside it verifies"
    ]
    assert not (tmp_path / "out").exists()
