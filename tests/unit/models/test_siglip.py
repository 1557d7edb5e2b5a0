"""DiscoSiglipModel (models/siglip.py): the sigmoid loss in forward against transformers' SiglipModel in float64, in
one process and on two gloo ranks (the same mechanism as CLIP's); the paper's logit init; its save as a plain
SiglipModel."""

import json
import math

import pytest
import torch

from disco_clip_ds.models.build import build_model
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import run_ranks

from unit.models.batches import LOSS_RTOL, assert_grad_close, batch

SIGLIP_TINY = REPO / "recipes" / "models" / "siglip_tiny.json"


def tiny_siglip(loss_impl="tiled", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return build_model(model_config=str(SIGLIP_TINY), loss_impl=loss_impl, chunk_size=2).to(dtype)


def siglip_reference(model, inputs) -> tuple[float, dict]:
    """transformers' own SiglipModel loss on the whole batch (float64), same weights."""
    from transformers import SiglipModel

    ref = SiglipModel(model.config).to(torch.float64)
    ref.load_state_dict(model.state_dict())
    loss = ref(**inputs, return_loss=True).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone().reshape(-1) for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("impl", ["tiled", "local"])
def test_siglip_single_process_loss_and_grads_equal_siglipmodel(impl):
    model, inputs = tiny_siglip(impl), batch()
    loss = model(**inputs, return_loss=True).loss
    loss.backward()
    ref_loss, ref_grads = siglip_reference(model, inputs)
    assert loss.item() == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert set(ref_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        assert_grad_close(p.grad.reshape(-1), ref_grads[name], name)


def _siglip_rank(rank, world, sizes):
    torch.set_num_threads(1)
    model, full = tiny_siglip(), batch()
    start = sum(sizes[:rank])
    loss = model(**{k: v[start : start + sizes[rank]] for k, v in full.items()}, return_loss=True).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():  # data-parallel averaging
        torch.distributed.all_reduce(p.grad)
        grads[name] = (p.grad / world).reshape(-1)
    return loss.item(), grads


@pytest.mark.slow
def test_siglip_two_ranks_give_the_global_batch_loss_and_gradient():
    results = run_ranks(_siglip_rank, 2, [4, 2], timeout=300)
    ref_loss, ref_grads = siglip_reference(tiny_siglip(), batch())
    assert sum(loss for loss, _ in results) / 2 == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert results[0][0] != pytest.approx(results[1][0], rel=1e-3)  # the ranks computed different shares
    for name, ref in ref_grads.items():  # logit_scale and logit_bias included
        for _, grads in results:
            assert_grad_close(grads[name], ref, name)


def test_fresh_siglip_gets_the_papers_logit_init_and_transformers_init_elsewhere():
    from transformers import SiglipModel

    from disco_clip_ds.models.base import drawn_by_name

    model = tiny_siglip(dtype=torch.float32, seed=3)
    stock = SiglipModel(model.config)
    with drawn_by_name(stock, 3):  # transformers' own rules on stock SiglipModel, each weight drawn by its name
        for module in stock.modules():
            module.__dict__.pop("_is_hf_initialized", None)
        stock.initialize_weights()
    assert model.logit_scale.item() == pytest.approx(math.log(10)) and model.logit_bias.item() == -10.0
    assert stock.logit_scale.item() == 0.0 and stock.logit_bias.item() == 0.0  # transformers' own init
    ours, theirs = model.state_dict(), stock.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key not in ("logit_scale", "logit_bias"):
            assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_fresh_siglip_is_drawn_from_the_seed_and_each_parameters_name_only():
    torch.manual_seed(1)
    first = build_model(model_config=str(SIGLIP_TINY), seed=4).state_dict()
    torch.manual_seed(2)
    torch.randn(1000)  # other draws in between
    again = build_model(model_config=str(SIGLIP_TINY), seed=4).state_dict()
    other = build_model(model_config=str(SIGLIP_TINY), seed=5).state_dict()
    for name, value in first.items():
        assert torch.equal(again[name], value), name
        random = value.numel() > 1 and value.unique().numel() > 1
        assert torch.equal(other[name], value) != random, name


@pytest.mark.slow  # beyond the fast tier's time budget
def test_siglip_saves_as_a_plain_siglipmodel(tmp_path):
    from transformers import SiglipModel

    model, inputs = tiny_siglip(dtype=torch.float32), batch(torch.float32)
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["SiglipModel"]
    plain = SiglipModel.from_pretrained(tmp_path / "m")
    assert type(plain) is SiglipModel and plain.logit_bias.item() == -10.0
    expected = model(**inputs).logits_per_image
    torch.testing.assert_close(plain(**inputs).logits_per_image, expected)
    again = build_model(model_name_or_path=str(tmp_path / "m"))
    assert type(again).__name__ == "DiscoSiglipModel"
    torch.testing.assert_close(again(**inputs).logits_per_image, expected)


def test_siglip_refuses_the_disco_loss():
    with pytest.raises(ValueError, match=r"loss_impl must be one of \('tiled', 'local'\) for SiglipModel"):
        tiny_siglip("disco")
