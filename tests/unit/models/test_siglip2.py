"""DiscoSiglip2Model (models/siglip2.py): the sigmoid loss in forward against transformers' Siglip2Model in float64
on NaFlex inputs, in one process and on two gloo ranks; the paper's logit init; its save as a plain Siglip2Model;
its refusals."""

import json
import math

import pytest
import torch

from disco_clip_ds.models.build import build_model
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import run_ranks

from unit.models.batches import LOSS_RTOL, assert_grad_close, naflex_batch

SIGLIP2_TINY = REPO / "recipes" / "models" / "siglip2_tiny.json"


def tiny_siglip2(loss_impl="tiled", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return build_model(model_config=str(SIGLIP2_TINY), loss_impl=loss_impl, chunk_size=2).to(dtype)


def siglip2_reference(model, inputs) -> tuple[float, dict]:
    """transformers' own Siglip2Model loss on the whole batch (float64), same weights."""
    from transformers import Siglip2Model

    ref = Siglip2Model(model.config).to(torch.float64)
    ref.load_state_dict(model.state_dict())
    loss = ref(**inputs, return_loss=True).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone().reshape(-1) for n, p in ref.named_parameters() if p.grad is not None}


def test_the_tiny_config_builds_a_siglip2_whose_grid_holds_the_default_budget():
    model = tiny_siglip2(dtype=torch.float32)
    assert type(model).__name__ == "DiscoSiglip2Model" and model.config.model_type == "siglip2"
    assert model.config.vision_config.num_patches == 256 and model.config.vision_config.patch_size == 4


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("impl", ["tiled", "local"])
def test_siglip2_single_process_loss_and_grads_equal_siglip2model(impl):
    model, inputs = tiny_siglip2(impl), naflex_batch()
    loss = model(**inputs, return_loss=True).loss
    loss.backward()
    ref_loss, ref_grads = siglip2_reference(model, inputs)
    assert loss.item() == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert set(ref_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    assert "vision_model.embeddings.position_embedding.weight" in ref_grads  # the resized grid is trained
    for name, p in model.named_parameters():
        assert_grad_close(p.grad.reshape(-1), ref_grads[name], name)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_padding_patches_do_not_change_an_images_embedding():
    model, inputs = tiny_siglip2(dtype=torch.float64), naflex_batch()
    noisy = dict(inputs, pixel_values=inputs["pixel_values"] + 5 * (1 - inputs["pixel_attention_mask"][..., None]))
    torch.testing.assert_close(model(**noisy).image_embeds, model(**inputs).image_embeds)


def _siglip2_rank(rank, world, sizes):
    torch.set_num_threads(1)
    model, full = tiny_siglip2(), naflex_batch()
    start = sum(sizes[:rank])
    loss = model(**{k: v[start : start + sizes[rank]] for k, v in full.items()}, return_loss=True).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():  # data-parallel averaging
        torch.distributed.all_reduce(p.grad)
        grads[name] = (p.grad / world).reshape(-1)
    return loss.item(), grads


@pytest.mark.slow
def test_siglip2_two_ranks_give_the_global_batch_loss_and_gradient():
    results = run_ranks(_siglip2_rank, 2, [4, 2], timeout=300)
    ref_loss, ref_grads = siglip2_reference(tiny_siglip2(), naflex_batch())
    assert sum(loss for loss, _ in results) / 2 == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert results[0][0] != pytest.approx(results[1][0], rel=1e-3)
    for name, ref in ref_grads.items():
        for _, grads in results:
            assert_grad_close(grads[name], ref, name)


def test_fresh_siglip2_gets_the_papers_logit_init_and_transformers_init_elsewhere():
    from transformers import Siglip2Model

    from disco_clip_ds.models.base import drawn_by_name

    model = tiny_siglip2(dtype=torch.float32, seed=3)
    stock = Siglip2Model(model.config)
    with drawn_by_name(stock, 3):
        for module in stock.modules():
            module.__dict__.pop("_is_hf_initialized", None)
        stock.initialize_weights()
    assert model.logit_scale.item() == pytest.approx(math.log(10)) and model.logit_bias.item() == -10.0
    assert stock.logit_scale.item() == 0.0 and stock.logit_bias.item() == 0.0
    ours, theirs = model.state_dict(), stock.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key not in ("logit_scale", "logit_bias"):
            assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow  # beyond the fast tier's time budget
def test_siglip2_saves_as_a_plain_siglip2model(tmp_path):
    from transformers import Siglip2Model

    model, inputs = tiny_siglip2(dtype=torch.float32), naflex_batch(torch.float32)
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["Siglip2Model"]
    plain = Siglip2Model.from_pretrained(tmp_path / "m")
    assert type(plain) is Siglip2Model and plain.logit_bias.item() == -10.0
    expected = model(**inputs).logits_per_image
    torch.testing.assert_close(plain(**inputs).logits_per_image, expected)
    again = build_model(model_name_or_path=str(tmp_path / "m"))
    assert type(again).__name__ == "DiscoSiglip2Model"
    torch.testing.assert_close(again(**inputs).logits_per_image, expected)


def test_siglip2_refuses_missing_naflex_inputs_and_patch_dropout():
    model, inputs = tiny_siglip2(dtype=torch.float32), naflex_batch(torch.float32)
    with pytest.raises(ValueError, match="needs spatial_shapes beside pixel_values"):
        model(**{k: v for k, v in inputs.items() if k != "spatial_shapes"})
    with pytest.raises(ValueError, match="patch dropout is not supported by SigLIP 2"):
        model(**inputs, patch_keep=torch.zeros(len(inputs["input_ids"]), 4, dtype=torch.long))


def test_a_square_image_model_refuses_naflex_inputs():
    from unit.models.batches import batch
    from unit.models.test_siglip import tiny_siglip

    inputs = batch(torch.float32)
    with pytest.raises(ValueError, match="takes no pixel_attention_mask or spatial_shapes"):
        tiny_siglip(dtype=torch.float32)(**inputs, spatial_shapes=torch.ones(6, 2, dtype=torch.long))


@pytest.mark.slow  # beyond the fast tier's time budget
def test_above_its_position_grid_siglip2_equals_transformers_pipeline_in_float64():
    """A 16 x 16 position grid evaluated at 576 patches per image (SigLIP 2's NaFlex, the grid resized to each
    image's patch rows and columns): the project's path (data/naflex.py's eval transform, padding and normalisation,
    DiscoSiglip2Model) gives the logits of transformers' Siglip2ImageProcessor at max_num_patches 576 and plain
    Siglip2Model on the same weights and images, in float64."""
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer, Siglip2ImageProcessor, Siglip2Model

    from disco_clip_ds.data.naflex import NaflexTransform, PatchNormalize, pack_patches
    from disco_clip_ds.testing.launch import TOKENIZER_DIR

    budget, model = 576, tiny_siglip2(dtype=torch.float64).eval()
    assert model.config.vision_config.num_patches == 256  # the 16 x 16 grid
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((96, 96), (50, 300))]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    texts = ["a photo of the number 5.", "a handwritten 7."]
    tokens = tokenizer(texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")

    ours = pack_patches([NaflexTransform(4, budget, train=False).pixels(image) for image in images], budget)
    ours["pixel_values"] = PatchNormalize().batch(ours["pixel_values"], ours["pixel_attention_mask"]).double()
    assert ours["spatial_shapes"].tolist() == [[24, 24], [10, 57]]  # beyond 16 rows or columns: the grid resized
    with torch.no_grad():
        logits = model(**tokens, **ours).logits_per_image

    reference = Siglip2Model(model.config).double().eval()
    reference.load_state_dict(model.state_dict())
    inputs = Siglip2ImageProcessor(patch_size=4, max_num_patches=budget)(images=images, return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].double()
    with torch.no_grad():
        expected = reference(**tokens, **inputs).logits_per_image
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    assert (expected[:, 0] - expected[:, 1]).abs().max() > 1e-3  # the texts score apart: the comparison can tell
