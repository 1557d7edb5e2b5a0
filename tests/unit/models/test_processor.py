"""models/processor.py: a folder saved as a run saves it (the model, its processor pinned) reloads, through
transformers' AutoTokenizer, AutoProcessor and zero-shot pipeline, the exact tokenizer it was saved with (the same
ids on the training captions), for CLIP, SigLIP and SigLIP 2, with the quickstart's tokenizer and with each family's
own; SigLIP 2's AutoProcessor call gives the run's patch size and budget. The reason for the pin, on the installed
transformers: without it a SigLIP 2 folder reloads a CLIP-style tokenizer as Siglip2Tokenizer."""

import numpy as np
import pytest
import torch
from PIL import Image

from disco_clip_ds.models.build import build_model
from disco_clip_ds.models.processor import load_saved_tokenizer, pin_processor
from disco_clip_ds.testing.launch import REPO, TOKENIZER_DIR
from disco_clip_ds.testing.tokenizers import CAPTIONS, family_tokenizer

CONFIGS = {t: REPO / "recipes" / "models" / f"{n}.json" for t, n in [("clip", "tiny"), ("siglip", "siglip_tiny"),
                                                                      ("siglip2", "siglip2_tiny")]}  # fmt: skip
PATCH, BUDGET = 4, 64  # SigLIP 2's: the tiny recipe's patch size and a budget other than the processor's default


def run_processor(model_type, tokenizer):
    """The processor as train/run.py saves it with the model: Siglip2Processor at the run's patch size and budget,
    else CLIPProcessor at the run's image size; pinned."""
    from transformers import CLIPImageProcessor, CLIPProcessor, Siglip2ImageProcessor, Siglip2Processor

    if model_type == "siglip2":
        image_processor = Siglip2ImageProcessor(patch_size=PATCH, max_num_patches=BUDGET)
        return pin_processor(Siglip2Processor(image_processor=image_processor, tokenizer=tokenizer), model_type)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    return pin_processor(CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer), model_type)


def saved_run(folder, model_type, tokenizer_dir, pin=True):
    """`folder` as a run's final save holds it: the model and its processor (pinned, or as before the pin)."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    build_model(model_config=str(CONFIGS[model_type])).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    processor = run_processor(model_type, tokenizer)
    if not pin:
        for key in ("auto_map", "max_num_patches", "patch_size"):
            processor.tokenizer.init_kwargs.pop(key, None)
    processor.save_pretrained(folder)
    return tokenizer


def ids(tokenizer):
    return [tokenizer(caption)["input_ids"] for caption in CAPTIONS]


def assert_reloads_the_tokenizer(folder, trained):
    """AutoTokenizer, AutoProcessor and the zero-shot pipeline on `folder` hold `trained`'s class and ids."""
    from transformers import AutoProcessor, AutoTokenizer, pipeline

    expected = (type(trained).__name__, ids(trained))
    for name, tokenizer in (
        ("AutoTokenizer", AutoTokenizer.from_pretrained(folder)),
        ("AutoProcessor", AutoProcessor.from_pretrained(folder).tokenizer),
        ("pipeline", pipeline("zero-shot-image-classification", model=str(folder)).tokenizer),
    ):
        assert (type(tokenizer).__name__, ids(tokenizer)) == expected, name


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("model_type", ["clip", "siglip", "siglip2"])
@pytest.mark.parametrize("tokenizer", ["quickstart", "family"])
def test_a_saved_folder_reloads_the_tokenizer_it_trained_with(tmp_path, model_type, tokenizer):
    source = TOKENIZER_DIR if tokenizer == "quickstart" else family_tokenizer(model_type, tmp_path / "tokenizer")
    if source is None:
        pytest.skip(f"{model_type}'s own tokenizer needs the sentencepiece package")
    trained = saved_run(tmp_path / "run", model_type, source)
    assert_reloads_the_tokenizer(tmp_path / "run", trained)
    assert type(load_saved_tokenizer(tmp_path / "run")) is type(trained)


def test_without_the_pin_a_siglip2_folder_reloads_gemmas_tokenizer(tmp_path):
    """Why the pin exists: transformers overrides a siglip2 folder's tokenizer_class with Siglip2Tokenizer."""
    from transformers import AutoTokenizer

    trained = saved_run(tmp_path, "siglip2", TOKENIZER_DIR, pin=False)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(reloaded).__name__ == "Siglip2Tokenizer" and ids(reloaded) != ids(trained)
    assert type(load_saved_tokenizer(tmp_path)) is type(trained)  # the class it was saved as, named in its config


def test_siglip2_autoprocessor_gives_the_runs_patch_size_and_budget(tmp_path):
    from transformers import AutoProcessor

    saved_run(tmp_path, "siglip2", TOKENIZER_DIR)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 200, 3), dtype=np.uint8))
    inputs = AutoProcessor.from_pretrained(tmp_path)(images=image, text=[CAPTIONS[0]], return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, BUDGET, PATCH * PATCH * 3)
    rows, cols = inputs["spatial_shapes"][0].tolist()
    assert rows * cols <= BUDGET and rows * cols > BUDGET * 0.8 and cols > 3 * rows  # NaFlex: the aspect kept
