"""The exported model card's usage code, run exactly as the card prints it (its placeholders filled in) on an export
of each model type, gives the scores of the project's own eval on the exported folder (eval/encode.py through
`disco-clip eval`'s loader): the same tokenizer ids, SigLIP's text padding and attention mask, SigLIP 2's patch size
and budget. A run folder saved before the tokenizer pin exports pinned. The teacher's paths stay off the card."""

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from disco_clip_ds.export.card import USAGE_FOLDER, USAGE_IMAGE
from disco_clip_ds.export.weights import export_checkpoint
from disco_clip_ds.testing.launch import TOKENIZER_DIR
from disco_clip_ds.testing.tokenizers import family_tokenizer

from unit.models.test_processor import BUDGET, assert_reloads_the_tokenizer, saved_run

slow = pytest.mark.slow


def card_usage(folder) -> str:
    """The python block of `folder`'s README.md, as printed."""
    (code,) = re.findall(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S)
    return code


def eval_scores(folder, image, texts) -> torch.Tensor:
    """Per text, the probability `disco-clip eval`'s model, tokenizer and image processor give `image` (float32)."""
    from disco_clip_ds.commands.eval import load_for_eval
    from disco_clip_ds.eval.encode import encode_images, encode_texts
    from disco_clip_ds.eval.sources import pixels

    model, tokenizer, image_processor = load_for_eval(str(folder))
    model.eval()
    logits = encode_images(model, pixels(image_processor, [image])) @ encode_texts(model, tokenizer, texts).T
    logits = logits * model.logit_scale.exp().item()
    if model.config.model_type == "clip":
        return logits.softmax(-1)[0]
    return torch.sigmoid(logits + model.logit_bias.item())[0]


def run_the_card(export, image_path) -> dict:
    code = card_usage(export).replace(USAGE_FOLDER, str(export)).replace(USAGE_IMAGE, str(image_path))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # the card's code, as a user pastes it
    return scope


# SigLIP 2 with the quickstart's tokenizer (the case of the defect) in the fast tier, the others in the slow one; CLIP's
# own family tokenizer is the quickstart's
CASES = [
    pytest.param(model_type, tokenizer, marks=() if (model_type, tokenizer) == ("siglip2", "quickstart") else slow)
    for model_type in ("clip", "siglip", "siglip2")
    for tokenizer in ("quickstart", "family")
    if (model_type, tokenizer) != ("clip", "family")
]


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("model_type, tokenizer", CASES)
def test_the_cards_usage_on_an_export_gives_our_eval(tmp_path, model_type, tokenizer):
    source = TOKENIZER_DIR if tokenizer == "quickstart" else family_tokenizer(model_type, tmp_path / "tokenizer")
    if source is None:
        pytest.skip(f"{model_type}'s own tokenizer needs the sentencepiece package")
    checkpoint = tmp_path / "run" / "checkpoint-1"
    trained = saved_run(checkpoint, model_type, source)
    export = export_checkpoint(checkpoint, tmp_path / "export")
    assert_reloads_the_tokenizer(export, trained)
    image_path = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 120, 3), dtype=np.uint8)).save(image_path)
    scope = run_the_card(export, image_path)
    if model_type == "siglip2":  # the run's patches and budget, not Siglip2Processor's defaults (16 px, 256)
        assert scope["inputs"]["pixel_values"].shape == (1, BUDGET, 48)
    with torch.no_grad():
        expected = eval_scores(export, Image.open(image_path), scope["texts"])
    torch.testing.assert_close(scope["probs"][0].detach(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("model_type", ["siglip", "siglip2"])
def test_an_export_holds_the_files_transformers_writes_and_its_tokenizers_ids(tmp_path, model_type):
    """The export's files are those transformers' own processor `save_pretrained` writes (processor_config.json, not
    the image processor's preprocessor_config.json), its tokenizer_config.json holds no fact of the machine that
    loaded it ("is_local", "local_files_only"), and its config's special ids are its tokenizer's: loading it logs no
    out-of-vocabulary warning about them. (transformers 5 still warns about its own SiglipTextConfig defaults, 49406
    and 49407, building them to diff against while it logs any SigLIP config: huggingface/transformers#47612.)"""
    import logging

    from transformers import AutoModel, AutoProcessor

    checkpoint = tmp_path / "run" / "checkpoint-1"
    saved_run(checkpoint, model_type, TOKENIZER_DIR)
    export = export_checkpoint(checkpoint, tmp_path / "export")
    for folder in (checkpoint, export):
        saved = json.loads((folder / "tokenizer_config.json").read_text())
        assert "is_local" not in saved and "local_files_only" not in saved, folder
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        model, processor = AutoModel.from_pretrained(export), AutoProcessor.from_pretrained(export)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    processor.save_pretrained(tmp_path / "resaved")  # the reference: what transformers writes of this processor
    weights = {"README.md", "config.json", "model.safetensors"}
    assert {p.name for p in export.iterdir()} == weights | {p.name for p in (tmp_path / "resaved").iterdir()}
    text, tokenizer = model.config.text_config, processor.tokenizer
    ids = (text.bos_token_id, text.eos_token_id, text.pad_token_id)
    assert ids == (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert all(0 <= i < text.vocab_size for i in ids)
    vocabulary = [r.getMessage() for r in records if "within the vocabulary" in r.getMessage()]
    assert not [
        m
        for m in vocabulary
        if not m.endswith(
            ("got 49406. This may result in unexpected behavior.", "got 49407. This may result in unexpected behavior.")
        )
    ]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_folder_saved_before_the_pin_exports_pinned(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-1"
    trained = saved_run(checkpoint, "siglip2", TOKENIZER_DIR, pin=False)
    export = export_checkpoint(checkpoint, tmp_path / "export")
    assert_reloads_the_tokenizer(export, trained)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_card_and_run_json_name_the_teacher_without_its_absolute_paths(tmp_path):
    """D2: --teacher /abs/teacher --teacher_embeddings /abs/emb: run.json (distillation_setting) and the card show
    the folders' names, as --train_shards' local folders are shown; a run.json written before shows alike."""
    from types import SimpleNamespace

    from disco_clip_ds.checkpoint.resume import distillation_setting

    teacher, stored = tmp_path / "secret-home" / "teacher", tmp_path / "secret-home" / "emb"
    args = SimpleNamespace(teacher=str(teacher), teacher_embeddings=str(stored), distill_weight=0.5)
    args.distill_temperature = None
    shown = distillation_setting(args)
    assert shown == "from teacher, weight 0.5, the teacher's logit scale, its embeddings stored in emb"
    hub = SimpleNamespace(teacher="org/clip-teacher", teacher_embeddings=None, distill_weight=1, distill_temperature=2)
    assert distillation_setting(hub) == "from org/clip-teacher, weight 1, temperature 2"  # a hub id is public
    pool = SimpleNamespace(**vars(args), augmentation_pool=True)
    pool.teacher, pool.augmentation_pool_size, pool.synthetic_caption_ratio = [str(teacher), "org/t2"], 4, 0.5
    assert distillation_setting(pool) == (
        "from teacher + org/t2, weight 0.5, the teacher's logit scale, its embeddings stored in emb; one of the first "
        "4 stored crops per sample; synthetic captions at ratio 0.5"
    )
    pool.live_teacher, pool.augmentation_pool_size = True, None
    assert distillation_setting(pool).endswith(
        ", crops replayed from emb; one of all stored crops per sample; synthetic captions at ratio 0.5"
    )
    checkpoint = tmp_path / "run" / "checkpoint-1"
    saved_run(checkpoint, "clip", TOKENIZER_DIR)
    old = f"from {teacher}, weight 0.5, the teacher's logit scale, its embeddings stored in {stored}"
    (checkpoint.parent / "run.json").write_text(json.dumps({"distillation": old}))  # as versions before wrote it
    card = (export_checkpoint(checkpoint, tmp_path / "export") / "README.md").read_text()
    assert f"| distilled (teacher, weight, temperature) | {shown} |" in card
    assert str(tmp_path) not in card and "secret-home" not in card
