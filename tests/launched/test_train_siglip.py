"""`disco-clip train` on a SigLIP model (recipes/models/siglip_tiny.json) on 2 CPU ranks, the sigmoid loss in its
forward, with FLIP's patch dropout at 0.5 (each sample's mask is its own): ZeRO-3 (accelerate), FSDP (accelerate),
1 rank with 2 contrastively accumulated micro-batches, and a run stopped by a signal and resumed each train exactly
like 2 ranks under ZeRO-2 (torchrun), from one saved initialisation; the result is a plain SiglipModel folder that
export, transformers' zero-shot pipeline and the zero-shot evaluation take. (The loss itself against float64 and
open_clip: test_sigmoid_loss.py.)"""

import subprocess
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import LAUNCH_COMMON, QUICK, REPO, SGD, launch, train_command, train_env
from disco_clip_ds.testing.runs import assert_same_training, assert_trained_under_fsdp, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
STEPS, PER_RANK = 4, 8
SIGLIP_TINY = REPO / "recipes/models/siglip_tiny.json"


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory) -> Path:
    import torch

    from disco_clip_ds.models.build import build_model

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("init") / "siglip"
    build_model(model_config=str(SIGLIP_TINY)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial_model):
    root = tmp_path_factory.mktemp("siglip_runs")
    write_shards(root / "shards", num_shards=2, per_shard=48, seed=4)
    common = [
        "--model_name_or_path", str(initial_model), "--train_shards", f"{root}/shards/{{00000..00001}}.tar",
        "--train_num_samples", "96", "--max_steps", str(STEPS), *SGD, "--patch_dropout", "0.5",
        "--accelerator_config", '{"dispatch_batches": true}',  # step t sees one global batch at any world size
    ]  # fmt: skip
    per_rank = ["--per_device_train_batch_size", str(PER_RANK)]
    launch(QUICK, 2, root / "n2_zero2", *common, *per_rank)
    launch("accelerate", 2, root / "n2_zero3", *common, *per_rank, ds_config="cpu_zero3.json")
    wrap = ["--fsdp_transformer_layer_cls_to_wrap", "SiglipEncoderLayer"]  # fsdp.yaml names CLIP's layer
    launch("accelerate", 2, root / "n2_fsdp", *common, *per_rank, ds_config=None, launcher_args=wrap)
    launch(QUICK, 1, root / "n1_k2", *common, *per_rank, "--gradient_accumulation_steps", "2")
    stopped = ["--save_steps", "2", *common, *per_rank]
    command = train_command("torchrun", 2) + ["--output_dir", str(root / "resumed"), *LAUNCH_COMMON, *stopped]
    command += ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]  # as launch() passes it
    stop = subprocess.run(command, cwd=REPO, env=train_env(DISCO_FAULT="signal_at_step=SIGUSR1:step=2,rank=1"))
    assert stop.returncode != 0 and (root / "resumed" / "checkpoint-2").is_dir()  # stopped there with a checkpoint
    launch(QUICK, 2, root / "resumed", *stopped, "--resume_from_checkpoint", "latest")
    return root


@pytest.mark.parametrize("run", ["n2_zero3", "n2_fsdp", "n1_k2", "resumed"])
def test_trains_like_two_ranks_under_zero2(runs, initial_model, run):
    if "fsdp" in run:  # sharded by FSDP2, not fallen back to DDP
        assert_trained_under_fsdp(runs / run)
    assert_same_training(runs / run, runs / "n2_zero2", weights(initial_model), steps=STEPS)


def test_logit_bias_trains_and_the_result_is_a_plain_siglipmodel(runs, initial_model):
    import json

    from transformers import SiglipModel

    out = runs / "n2_zero2"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["SiglipModel"]
    model = SiglipModel.from_pretrained(out)
    assert type(model) is SiglipModel
    start = weights(initial_model)
    assert model.logit_bias.item() != pytest.approx(start["logit_bias"].item(), abs=1e-6)  # it has a gradient
    assert json.loads((out / "run.json").read_text())["global_contrastive_batch"] == 2 * PER_RANK


def test_the_export_is_a_siglipmodel_folder_for_the_zero_shot_pipeline(runs, tmp_path):
    """`disco-clip export` of the run: a plain SiglipModel folder with its card, which transformers' own
    zero-shot-image-classification pipeline loads and scores with sigmoid probabilities."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, SiglipModel, pipeline

    from disco_clip_ds.commands.export import main as export_main
    from disco_clip_ds.errors import run_main

    assert run_main(export_main, [str(runs / "n2_zero2"), str(tmp_path / "export")], "disco-clip export") == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert "# SigLIP trained with disco-clip-ds" in card and "SiglipModel.from_pretrained" in card
    assert "| patch dropout (FLIP) | 0.5 of the patches dropped |" in card  # the card states it, the model has none
    assert "patch" not in (tmp_path / "export" / "config.json").read_text().replace("patch_size", "")
    classify = pipeline("zero-shot-image-classification", model=str(tmp_path / "export"))
    assert type(classify.model).__name__ == "SiglipModel"
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    labels = ["zero", "one", "two"]
    scores = {r["label"]: r["score"] for r in classify(image, candidate_labels=labels)}
    # recomputed in float64 from the exported weights: sigmoid(scale x cosine + bias) per label, the text as the
    # pipeline gives it (its default template, padded to SigLIP's 64 positions)
    model = SiglipModel.from_pretrained(tmp_path / "export").double().eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "export")
    texts = [f"This is a photo of {label}." for label in labels]
    tokens = processor.tokenizer(texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    pixels = processor.image_processor(images=image, return_tensors="pt")["pixel_values"].double()
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.get_text_features(**tokens).pooler_output, dim=-1)
        picture = torch.nn.functional.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
        expected = torch.sigmoid(picture @ text.T * model.logit_scale.exp() + model.logit_bias)[0]
    assert [scores[label] for label in labels] == pytest.approx(expected.tolist(), abs=1e-5)
    assert sum(scores.values()) != pytest.approx(1.0, abs=1e-3)  # independent sigmoids, not a softmax over the labels


def test_zero_shot_evaluation_pads_siglip_text_to_its_length(runs):
    """disco-clip eval's classification on the trained SiglipModel: text padded to the 64 positions SigLIP pools
    the last of; the same classifier as transformers' own pipeline input (padding="max_length")."""
    import torch
    from transformers import AutoTokenizer, SiglipModel

    from disco_clip_ds.eval.encode import encode_texts
    from disco_clip_ds.eval.tasks import zeroshot_classification

    model = SiglipModel.from_pretrained(runs / "n2_zero2").eval()
    tokenizer = AutoTokenizer.from_pretrained(runs / "n2_zero2")
    names = ["zero", "one", "two"]
    tokens = tokenizer(names, padding="max_length", max_length=64, return_tensors="pt")
    with torch.no_grad():
        expected = torch.nn.functional.normalize(model.get_text_features(**tokens).pooler_output, dim=-1)
    torch.testing.assert_close(encode_texts(model, tokenizer, names), expected)
    pixels = torch.randn(6, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    metrics = zeroshot_classification(model, tokenizer, [(pixels, labels.tolist())], names, ["{c}"], progress=False)
    # top-1 recomputed in float64 from the saved weights: each image's nearest class text (one template: "{c}")
    model = model.double()
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.get_text_features(**tokens).pooler_output, dim=-1)
        picture = model.get_image_features(pixel_values=pixels.double()).pooler_output
        predicted = (torch.nn.functional.normalize(picture, dim=-1) @ text.T).argmax(dim=1)
    assert metrics["acc1"] == pytest.approx((predicted == labels).double().mean().item())
