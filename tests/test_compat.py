"""compat.py: each gate matches the installed release's behaviour, and the branch for releases without the bug
(CLIP's own 0-dim logit_scale) runs here too, with the gate forced off."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import CLIPConfig, CLIPModel

from disco_clip_ds import compat
from disco_clip_ds.modeling import DiscoCLIPModel, build_model
from disco_clip_ds.testing.launch import TINY_CONFIG
from disco_clip_ds.testing.ranks import run_ranks

TINY = TINY_CONFIG


def _deepspeed_init_with_a_0dim_parameter(rank, world_size):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.weight = torch.nn.Parameter(torch.tensor(1.0)), torch.nn.Parameter(torch.ones(3))

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    try:
        deepspeed.initialize(model=Scaled(), config=config)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)  # one deepspeed import and engine start: minutes on a busy 2-core machine
def test_the_logit_scale_gate_matches_the_installed_deepspeed():
    """The gate is on exactly when the installed deepspeed fails to start an engine on a 0-dim parameter."""
    (error,) = run_ranks(_deepspeed_init_with_a_0dim_parameter, 1, timeout=500)
    assert (error is not None) == compat.LOGIT_SCALE_AS_VECTOR, error
    if error is not None:
        assert "dim" in error  # the uint8 view of a 0-dim tensor, not some other failure


def _batch(n=4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 539, (n, 8), generator=g)
    ids[:, 0], ids[:, -1] = 0, 1  # bos, eos as in recipes/tokenizer
    return {"input_ids": ids, "pixel_values": torch.randn(n, 3, 64, 64, generator=g)}


def test_the_model_without_the_workaround_is_clip_itself(monkeypatch, tmp_path):
    """Gate off (a deepspeed without the bug): CLIP's 0-dim parameter, CLIP's loss, and a save/load round trip."""
    monkeypatch.setattr(compat, "LOGIT_SCALE_AS_VECTOR", False)
    torch.manual_seed(0)
    model = build_model(model_config=str(TINY), loss_impl="local").eval()
    assert model.logit_scale.dim() == 0
    stock = CLIPModel(CLIPConfig.from_json_file(str(TINY))).eval()
    stock.load_state_dict(model.state_dict(), strict=True)
    inputs = _batch()
    with torch.no_grad():
        expected = stock(**inputs, return_loss=True).loss
        assert model(**inputs, return_loss=True).loss.item() == pytest.approx(expected.item(), rel=1e-6)
        model.config.loss_impl = "tiled"  # one process: the global batch is this batch
        assert model(**inputs, return_loss=True).loss.item() == pytest.approx(expected.item(), rel=1e-5)
        model.logit_scale.fill_(2.5)
    model.save_pretrained(tmp_path / "m")
    again = DiscoCLIPModel.from_pretrained(tmp_path / "m")
    assert again.logit_scale.dim() == 0 and again.logit_scale.item() == pytest.approx(2.5)
    assert again._weight_conversions == []
