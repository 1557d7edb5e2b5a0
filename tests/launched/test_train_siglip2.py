"""`disco-clip train` on SigLIP 2 with NaFlex (recipes/models/siglip2_tiny.json, a budget of 64 patches): 2 ranks x 16
under ZeRO-2 (torchrun), stopped by a signal at step 2 and resumed, and under ZeRO-3 (accelerate), train exactly like
1 rank with 2 contrastively accumulated micro-batches of 16 (within 1e-4 of the update), from one saved
initialisation: the global sigmoid loss, the sample-keyed crops and the padded budget are the same whatever the split
and however interrupted, and whether the patches are normalised in the DataLoader workers or on the device. A budget
of no patch stops both ranks with one line and exit 2. The final `disco-clip eval` of a run, through its folder and
its export, equals its last in-training zero-shot eval, with the quickstart's tokenizer and with SigLIP 2's own (a
Gemma-style Siglip2Tokenizer); eval takes any budget of at least one patch, above the position grid too. (The loss
against Siglip2Model in float64, and a budget above the grid against transformers: tests/unit/models/test_siglip2.py;
the pipeline against Siglip2ImageProcessor: tests/unit/data/test_naflex.py.)"""

import subprocess
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import (
    LAUNCH_COMMON,
    QUICK,
    REPO,
    SGD,
    TOKENIZER_DIR,
    launch,
    train_command,
    train_env,
)
from disco_clip_ds.testing.runs import assert_same_training, weights
from disco_clip_ds.testing.tokenizers import siglip2_tokenizer
from disco_clip_ds.testing.zeroshot import assert_final_eval_is_the_last_zeroshot, write_eval_shards

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
    # normalised on the device (uint8 batches handed over, the padding zeroed there); the resumed run in the workers
    on_device = ["--normalize_on_device", "true"]
    launch(QUICK, 1, root / "n1_k2", *common, "--gradient_accumulation_steps", "2", *on_device)
    # 2 steps with the zero-shot eval during training (at the last step), as the quickstart runs it, with its tokenizer
    # and with SigLIP 2's own kind (Gemma's rules). Apart from the runs compared above: the in-training eval's log at
    # a logging step leaves that step's loss out of the log history.
    zeroshot = ["--zeroshot_data", str(write_eval_shards(root / "eval")), "--zeroshot_steps", "2", "--max_steps", "2"]
    launch(QUICK, 1, root / "quickstart_tokenizer", *common, *zeroshot)
    own = ["--tokenizer_name", str(siglip2_tokenizer(root / "tokenizer"))]
    launch(QUICK, 1, root / "own_tokenizer", *common, *zeroshot, *own)
    launch("accelerate", 2, root / "n2_zero3", *common, ds_config="cpu_zero3.json")
    stopped = ["--save_steps", "2", *common]
    command = train_command("torchrun", 2) + ["--output_dir", str(root / "resumed"), *LAUNCH_COMMON, *stopped]
    command += ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]  # as launch() passes it
    stop = subprocess.run(command, cwd=REPO, env=train_env(DISCO_FAULT="signal_at_step=SIGUSR1:step=2,rank=1"))
    assert stop.returncode != 0 and (root / "resumed" / "checkpoint-2").is_dir()  # stopped there with a checkpoint
    launch(QUICK, 2, root / "resumed", *stopped, "--resume_from_checkpoint", "latest")
    return root


@pytest.mark.parametrize("run", ["resumed", "n2_zero3"])
def test_two_ranks_train_like_one_rank_with_two_accumulated_micro_batches(runs, initial_model, run):
    """ZeRO-2 under torchrun stopped and resumed, and ZeRO-3 under accelerate, against 1 rank x K=2."""
    assert_same_training(runs / run, runs / "n1_k2", weights(initial_model), steps=STEPS)


def test_the_result_is_a_plain_siglip2model_with_its_processor_at_the_budget(runs):
    import json

    from transformers import AutoProcessor, Siglip2Model

    out = runs / "n1_k2"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Siglip2Model"]
    assert type(Siglip2Model.from_pretrained(out)) is Siglip2Model
    processor = AutoProcessor.from_pretrained(out)
    assert processor.image_processor.max_num_patches == int(BUDGET) and processor.image_processor.patch_size == 4
    assert json.loads((out / "run.json").read_text())["max_num_patches"] == int(BUDGET)


def test_a_budget_of_no_patch_stops_every_rank_with_one_line(tmp_path):
    write_shards(tmp_path / "data", num_shards=4, per_shard=4)  # one a reader: the budget is the only fault
    cmd = [
        *train_command("torchrun", 2), "--output_dir", str(tmp_path / "out"), "--report_to", "none",
        "--train_shards", str(tmp_path / "data"), "--model_config", str(SIGLIP2_TINY),
        "--tokenizer_name", str(TOKENIZER_DIR), "--max_num_patches", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    line = "--max_num_patches 0: give a positive number, or leave it out for the default"
    assert proc.returncode != 0 and log.count(line) == 2 and "(exitcode: 2)" in log, log[-3000:]
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("run", ["quickstart_tokenizer", "own_tokenizer"])
def test_the_final_eval_through_the_folder_and_the_export_is_the_last_in_training_one(runs, run, tmp_path):
    """D9: the saved and the exported folder reload the tokenizer the run trained with (the quickstart's CLIP-style
    BPE, or SigLIP 2's own), so `disco-clip eval` scores as the run's own zero-shot eval did at its last step."""
    from transformers import AutoTokenizer

    during = assert_final_eval_is_the_last_zeroshot(runs / run, runs / "eval", tmp_path / "export")
    assert 0 <= during["acc1"] <= 1
    expected = "Siglip2Tokenizer" if run == "own_tokenizer" else "CLIPTokenizer"
    assert type(AutoTokenizer.from_pretrained(runs / run)).__name__ == expected


def test_the_export_states_the_budget_and_the_zero_shot_pipeline_loads_it(runs, tmp_path):
    """`disco-clip export`: a plain Siglip2Model folder with its processor at the run's budget and a card stating
    it; transformers' zero-shot-image-classification pipeline scores an image as the float64 recomputation from
    the exported weights (sigmoid(scale x cosine + bias) per label, the image through Siglip2ImageProcessor)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Siglip2Model, pipeline

    from disco_clip_ds.commands.export import main as export_main
    from disco_clip_ds.errors import run_main

    export = tmp_path / "export"
    assert run_main(export_main, [str(runs / "n1_k2"), str(export)], "disco-clip export") == 0
    card = (export / "README.md").read_text()
    assert "# SigLIP 2 (NaFlex) trained with disco-clip-ds" in card and "Siglip2Model.from_pretrained" in card
    assert f"| NaFlex patch budget per image (max_num_patches) | {BUDGET} |" in card
    classify = pipeline("zero-shot-image-classification", model=str(export))
    assert type(classify.model).__name__ == "Siglip2Model"
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8))
    labels = ["zero", "one", "two"]
    scores = {r["label"]: r["score"] for r in classify(image, candidate_labels=labels)}
    model = Siglip2Model.from_pretrained(export).double().eval()
    processor = AutoProcessor.from_pretrained(export)
    texts = [f"This is a photo of {label}." for label in labels]
    tokens = processor.tokenizer(texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    inputs = processor.image_processor(images=image, return_tensors="pt")
    assert inputs["pixel_attention_mask"].shape == (1, int(BUDGET))
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.get_text_features(**tokens).pooler_output, dim=-1)
        inputs["pixel_values"] = inputs["pixel_values"].double()
        picture = torch.nn.functional.normalize(model.get_image_features(**inputs).pooler_output, dim=-1)
        expected = torch.sigmoid(picture @ text.T * model.logit_scale.exp() + model.logit_bias)[0]
    assert [scores[label] for label in labels] == pytest.approx(expected.tolist(), abs=1e-5)


@pytest.mark.parametrize("budget", [16, 144, 576])
def test_eval_at_a_chosen_budget_sees_each_image_within_it(runs, budget, monkeypatch):
    """`disco-clip eval --max_num_patches`: retrieval on the training shards with the processor at that budget, above
    the 16 x 16 position grid too; every image batch the model sees is padded to it, each image's patches within
    it."""
    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.eval import tasks

    seen = []
    encode = tasks.encode_images

    def watched(model, inputs):
        seen.append((inputs["pixel_values"].shape[1], int(inputs["spatial_shapes"].prod(-1).max())))
        return encode(model, inputs)

    monkeypatch.setattr(tasks, "encode_images", watched)
    data = f"{runs}/shards/{{00000..00001}}.tar"
    args = EvalArguments(model=str(runs / "n1_k2"), data=data, task="zeroshot_retrieval", max_num_patches=budget)
    record = run_eval(args)
    assert set(record["metrics"]) >= {"image_retrieval_recall@1", "text_retrieval_recall@1"}
    assert seen and all(padded == budget and largest <= budget for padded, largest in seen)
    assert any(largest > budget * 0.8 for _, largest in seen)  # the images fill the budget, as NaFlex resizes


def test_eval_refuses_a_budget_of_no_patch(runs):
    from disco_clip_ds.commands.eval import EvalArguments, run_eval
    from disco_clip_ds.errors import UsageError

    data = f"{runs}/shards/{{00000..00001}}.tar"
    with pytest.raises(UsageError, match="--max_num_patches 0: give at least 1"):
        run_eval(EvalArguments(model=str(runs / "n1_k2"), data=data, task="zeroshot_retrieval", max_num_patches=0))
