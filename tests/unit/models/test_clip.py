"""DiscoCLIPModel (models/clip.py, with models/base.py's GlobalBatchLossMixin): its loss and gradients against
transformers' own CLIPModel in float64, in one process and on two gloo ranks; CLIP's logit clamp, its
initialisation (fresh, from a checkpoint, under ZeRO-3), its save as a plain CLIPModel."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import CLIPConfig, CLIPModel

from disco_clip_ds.models.build import build_model
from disco_clip_ds.models.clip import DiscoCLIPModel
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.ranks import run_ranks

from unit.models.batches import LOSS_RTOL, assert_grad_close, batch

TINY = REPO / "recipes" / "models" / "tiny.json"


def tiny_model(loss_impl="tiled", dtype=torch.float64, seed=0) -> DiscoCLIPModel:
    torch.manual_seed(seed)
    return build_model(model_config=str(TINY), loss_impl=loss_impl, chunk_size=2).to(dtype)


def reference_loss_and_grads(model: DiscoCLIPModel, inputs) -> tuple[float, dict]:
    """transformers' own CLIPModel loss on the global batch (float64), same weights, clamped scale."""
    ref = CLIPModel(model.config).to(torch.float64)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref.logit_scale.clamp_(max=math.log(100))
    ref(**inputs, return_loss=True).loss.backward()
    loss = ref(**inputs, return_loss=True).loss.item()
    return loss, {n: p.grad.clone().reshape(-1) for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("impl", ["tiled", "disco", "local"])
def test_single_process_loss_and_grads_equal_clip(impl):
    model, inputs = tiny_model(impl), batch()
    loss = model(**inputs, return_loss=True).loss
    loss.backward()
    ref_loss, ref_grads = reference_loss_and_grads(model, inputs)
    assert loss.item() == pytest.approx(ref_loss, rel=LOSS_RTOL)
    for name, p in model.named_parameters():
        assert_grad_close(p.grad.reshape(-1), ref_grads[name], name)


def _rank_loss_and_grads(rank, world, impl, sizes):
    torch.set_num_threads(1)
    model, full = tiny_model(impl), batch()
    start = sum(sizes[:rank])
    local = {k: v[start : start + sizes[rank]] for k, v in full.items()}
    loss = model(**local, return_loss=True).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():  # what DDP/DeepSpeed do: average the gradients over ranks
        torch.distributed.all_reduce(p.grad)
        grads[name] = (p.grad / world).reshape(-1)
    return loss.item(), grads


def _rank_cases(rank, world, cases):
    losses = [_rank_loss_and_grads(rank, world, impl, list(sizes)) for impl, sizes in cases]
    return losses, _zero3_fresh_model_params(rank, world)  # last: it leaves DeepSpeed set up in the process


TWO_RANK_CASES = [("tiled", (3, 3)), ("disco", (4, 2)), ("local", (3, 3))]


@pytest.fixture(scope="module")
def two_rank_results():
    """{(impl, sizes): [(loss, grads) of rank 0, of rank 1]} and {"zero3": rank 0's (partitioned names, params)}:
    every case in one spawn of 2 ranks (their imports cost more than the forwards)."""
    per_rank = run_ranks(_rank_cases, 2, TWO_RANK_CASES, timeout=300)
    results = {case: [per_rank[rank][0][i] for rank in range(2)] for i, case in enumerate(TWO_RANK_CASES)}
    return {**results, "zero3": per_rank[0][1]}


@pytest.mark.parametrize("impl,sizes", [("tiled", (3, 3)), ("disco", (4, 2))])
@pytest.mark.slow
def test_two_ranks_give_the_global_batch_loss_and_gradient(impl, sizes, two_rank_results):
    results = two_rank_results[impl, sizes]
    ref_loss, ref_grads = reference_loss_and_grads(tiny_model(impl), batch())
    assert sum(loss for loss, _ in results) / 2 == pytest.approx(ref_loss, rel=LOSS_RTOL)
    assert results[0][0] != pytest.approx(results[1][0], rel=1e-3)  # the ranks really computed different shares
    for name, ref in ref_grads.items():
        for _, grads in results:
            assert_grad_close(grads[name], ref, name)


@pytest.mark.slow
def test_local_loss_on_two_ranks_is_the_per_device_loss(two_rank_results):
    # "local" must stay what HF's contrastive example trains with: each rank's own b x b loss, no gathering.
    results = two_rank_results["local", (3, 3)]
    model, full = tiny_model("local"), batch()
    halves = [model(**{k: v[s : s + 3] for k, v in full.items()}, return_loss=True).loss.item() for s in (0, 3)]
    assert [loss for loss, _ in results] == pytest.approx(halves, rel=1e-10)


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("impl", ["tiled", "disco"])
def test_loss_under_bf16_autocast_matches_fp32(impl):
    # the Trainer's --bf16 without DeepSpeed runs forward under autocast
    model, inputs = tiny_model(impl, dtype=torch.float32), batch(torch.float32)
    reference = model(**inputs, return_loss=True).loss.item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs, return_loss=True).loss
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(reference, rel=3e-2)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow  # beyond the fast tier's time budget
def test_logit_scale_is_clamped_at_100():
    model, inputs = tiny_model(), batch()
    with torch.no_grad():
        model.logit_scale.fill_(5.0)  # exp(5) = 148 > 100
    out = model(**inputs, return_loss=True, return_logits=True)
    assert model.clamped_logit_scale().item() == pytest.approx(100.0)
    torch.testing.assert_close(out.logits_per_text, 100.0 * out.text_embeds @ out.image_embeds.t())
    out.loss.backward()
    assert model.logit_scale.grad.abs().max().item() == 0.0


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("impl", ["tiled", "disco", "local"])
def test_logits_are_built_for_inference_local_loss_or_on_request(impl):
    """A training forward with the distributed loss skips the unused b x b logits; CLIPModel's (inference, or
    the local loss, which reads them) keep them, and return_logits overrides either way without moving the loss."""
    model, inputs = tiny_model(impl), batch()
    reference = CLIPModel(model.config).to(torch.float64)
    reference.load_state_dict(model.state_dict())
    expected = reference(**inputs).logits_per_text
    assert (model(**inputs, return_loss=True).logits_per_text is None) == (impl != "local")
    torch.testing.assert_close(model(**inputs).logits_per_text, expected)
    asked = model(**inputs, return_loss=True, return_logits=True)
    torch.testing.assert_close(asked.logits_per_text, expected)
    torch.testing.assert_close(asked.logits_per_image, expected.t())
    skipped = model(**inputs, return_loss=True, return_logits=False)
    assert skipped.logits_per_text is None and skipped.logits_per_image is None
    assert skipped.loss.item() == pytest.approx(asked.loss.item(), rel=1e-12)


@pytest.mark.slow  # a fresh interpreter that imports transformers: ~6 s
def test_saved_model_is_a_plain_clipmodel_and_round_trips(tmp_path):
    model, inputs = tiny_model("disco", dtype=torch.float32), batch(torch.float32)
    with torch.no_grad():
        model.logit_scale.fill_(3.25)
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["CLIPModel"] and config["loss_impl"] == "disco"
    torch.save({k: v for k, v in inputs.items()}, tmp_path / "inputs.pt")
    expected = model(**inputs).logits_per_image
    # a fresh interpreter with transformers alone: no disco_clip_ds import
    code = (
        "import sys, torch; from transformers import CLIPModel; "
        f"m = CLIPModel.from_pretrained({str(tmp_path / 'm')!r}); "
        "assert type(m).__name__ == 'CLIPModel' and m.logit_scale.dim() == 0, m.logit_scale.shape; "
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r}); "
        f"torch.save((m.logit_scale.item(), m(**x).logits_per_image), {str(tmp_path / 'out.pt')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=120)
    scale, logits = torch.load(tmp_path / "out.pt")
    assert scale == pytest.approx(3.25)
    torch.testing.assert_close(logits, expected)
    # and back: a CLIPModel checkpoint loads into DiscoCLIPModel with its values
    again = DiscoCLIPModel.from_pretrained(tmp_path / "m")
    assert again.config.loss_impl == "disco" and again.logit_scale.reshape(()).item() == pytest.approx(3.25)
    torch.testing.assert_close(again(**inputs).logits_per_image, expected)


def test_from_pretrained_of_a_stock_clip_checkpoint_defaults_to_tiled(tmp_path):
    stock = CLIPModel(CLIPConfig.from_json_file(str(TINY)))
    stock.save_pretrained(tmp_path)
    model = build_model(model_name_or_path=str(tmp_path), loss_impl="tiled")
    assert model.config.loss_impl == "tiled"
    assert model.logit_scale.reshape(()).item() == pytest.approx(stock.logit_scale.item())


# --- CLIP's initialisation (OpenAI CLIP clip/model.py, open_clip transformer.py), hand-computed per group ---


def _config(text_width, text_layers, vision_width, vision_layers, patch=16, image=64):
    config = CLIPConfig.from_json_file(str(TINY))
    for tower, width, layers in (
        (config.text_config, text_width, text_layers),
        (config.vision_config, vision_width, vision_layers),
    ):
        tower.hidden_size, tower.num_hidden_layers, tower.intermediate_size = width, layers, 4 * width
    config.vision_config.patch_size, config.vision_config.image_size = patch, image
    return config


def _clip_init_table(config):
    """(parameter-name pattern, distribution, scale): 'normal' std, 'uniform' bound, 'const' value; hand-derived."""
    wt, lt = config.text_config.hidden_size, config.text_config.num_hidden_layers
    wv, p = config.vision_config.hidden_size, config.vision_config.patch_size
    proj_std = wt**-0.5 * (2 * lt) ** -0.5
    return [
        # text tower: CLIP.initialize_parameters / TextTransformer.init_parameters
        (r"text_model\.embeddings\.token_embedding\.weight", "normal", 0.02),
        (r"text_model\.embeddings\.position_embedding\.weight", "normal", 0.01),
        (r"text_model.*self_attn\.[qkv]_proj\.weight", "normal", wt**-0.5),
        (r"text_model.*self_attn\.out_proj\.weight", "normal", proj_std),
        (r"text_model.*mlp\.fc1\.weight", "normal", (2 * wt) ** -0.5),
        (r"text_model.*mlp\.fc2\.weight", "normal", proj_std),
        (r"text_model.*mlp\.fc1\.bias", "uniform", wt**-0.5),  # nn.Linear default, fan_in = w
        (r"text_model.*mlp\.fc2\.bias", "uniform", (4 * wt) ** -0.5),  # fan_in = mlp width
        (r"text_projection\.weight", "normal", wt**-0.5),
        # vision tower: VisionTransformer.__init__ (scale * randn), torch's layer defaults elsewhere
        (r"vision_model\.embeddings\.class_embedding", "normal", wv**-0.5),
        (r"vision_model\.embeddings\.position_embedding\.weight", "normal", wv**-0.5),
        (r"vision_model\.embeddings\.patch_embedding\.weight", "uniform", (3 * p * p) ** -0.5),
        (r"vision_model.*self_attn\.[qkv]_proj\.weight", "uniform", (6 / (wv + 3 * wv)) ** 0.5),  # xavier on (3w, w)
        (r"vision_model.*self_attn\.out_proj\.weight", "uniform", wv**-0.5),
        (r"vision_model.*mlp\.fc1\.(weight|bias)", "uniform", wv**-0.5),
        (r"vision_model.*mlp\.fc2\.(weight|bias)", "uniform", (4 * wv) ** -0.5),
        (r"visual_projection\.weight", "normal", wv**-0.5),
        # both towers: MultiheadAttention zeroes its biases; LayerNorm (1, 0); logit_scale = ln(1/0.07) via the config
        (r".*self_attn\.[qkvout]+_proj\.bias", "const", 0.0),
        (r".*(layer_norm\d|layrnorm|layernorm|final_layer_norm)\.weight", "const", 1.0),
        (r".*(layer_norm\d|layrnorm|layernorm|final_layer_norm)\.bias", "const", 0.0),
        (r"logit_scale", "const", config.logit_scale_init_value),
    ]


def assert_clip_init(model, config, names=None):
    """Every parameter (or those in `names`) is drawn as the table says; pooled per group over the layers."""
    import re

    params = dict(model.named_parameters())
    checked = set()
    for pattern, dist, scale in _clip_init_table(config):
        group = [n for n in params if re.fullmatch(pattern, n) and (names is None or n in names)]
        if not group:
            continue
        raw = torch.cat([params[n].detach().reshape(-1) for n in group])
        values, n = raw.double(), raw.numel()
        checked.update(group)
        if dist == "const":  # in the parameter's dtype
            assert torch.equal(raw, torch.full_like(raw, scale)), (
                f"{pattern}: expected all {scale}, got {raw[:4].tolist()}"
            )
            continue
        std = scale if dist == "normal" else scale / 3**0.5
        # 5 standard errors of the sample std and mean; a fixed seed makes the draw reproducible
        assert values.std().item() == pytest.approx(std, rel=5 / (2 * n) ** 0.5), (
            f"{pattern} ({dist} {scale:.4g}): std {values.std().item():.4g}"
        )
        assert abs(values.mean().item()) < 5 * std / n**0.5, f"{pattern}: mean {values.mean().item():.4g}"
        if dist == "uniform":  # bounded at the bound, and reaching close to it
            assert scale * (1 - 10 / n) <= values.abs().max().item() <= scale, (
                f"{pattern}: max {values.abs().max().item():.4g} vs {scale:.4g}"
            )
    missed = set(params if names is None else names) - checked
    assert not missed, f"no rule checked {sorted(missed)}"


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("widths", [(64, 2, 64, 2), (128, 6, 96, 3)])
def test_fresh_model_gets_clip_init(widths):
    config = _config(*widths, patch=8, image=32) if widths[0] == 128 else CLIPConfig.from_json_file(str(TINY))
    torch.manual_seed(0)
    assert_clip_init(DiscoCLIPModel(config), config)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_fresh_model_is_drawn_from_the_seed_and_each_parameters_name_only():
    """Same seed: the same weights whatever the global generator's state or what it drew before; each random
    parameter is its rule's draw from a CPU generator seeded by sha256("SEED:NAME") (computed here by hand)."""
    import hashlib

    torch.manual_seed(11)
    first = build_model(model_config=str(TINY), seed=5).state_dict()
    torch.manual_seed(12)
    torch.randn(1000)  # other draws in between
    again = build_model(model_config=str(TINY), seed=5).state_dict()
    other = build_model(model_config=str(TINY), seed=6).state_dict()
    for name, value in first.items():
        assert torch.equal(again[name], value), name
        random = value.numel() > 1 and value.unique().numel() > 1  # not a constant-initialised tensor
        assert torch.equal(other[name], value) != random, name
    name = "text_model.embeddings.token_embedding.weight"
    seed = int.from_bytes(hashlib.sha256(f"5:{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    drawn = torch.empty(first[name].shape).normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(first[name], drawn)  # CLIP's N(0, 0.02) token embedding, drawn by name


def _perturbed_saved_model(path):
    torch.manual_seed(1)
    model = build_model(model_config=str(TINY))
    with torch.no_grad():  # values no init would draw, so a re-init cannot pass unnoticed
        for p in model.parameters():
            p.add_(torch.rand_like(p) + 1.0)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_from_pretrained_keeps_every_weight_bit_for_bit(tmp_path):
    saved = _perturbed_saved_model(tmp_path)
    torch.manual_seed(2)
    for loaded in (DiscoCLIPModel.from_pretrained(tmp_path), build_model(model_name_or_path=str(tmp_path))):
        state = loaded.state_dict()
        assert state.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(state[name], value), name


def test_only_weights_missing_from_a_checkpoint_get_clip_init(tmp_path):
    from safetensors.torch import load_file, save_file

    saved = _perturbed_saved_model(tmp_path)
    missing = {
        "text_model.embeddings.position_embedding.weight",
        "text_model.encoder.layers.1.self_attn.q_proj.weight",
        "text_model.encoder.layers.0.mlp.fc1.bias",
        "vision_model.embeddings.position_embedding.weight",
        "vision_model.encoder.layers.0.self_attn.out_proj.weight",
        "vision_model.encoder.layers.1.mlp.fc2.weight",
        "text_projection.weight",
    }
    weights = load_file(tmp_path / "model.safetensors")
    assert missing <= weights.keys()
    save_file(
        {k: v for k, v in weights.items() if k not in missing},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    torch.manual_seed(3)
    model = DiscoCLIPModel.from_pretrained(tmp_path)
    state = model.state_dict()
    for name, value in saved.items():
        if name not in missing:
            assert torch.equal(state[name], value), name
    assert_clip_init(model, model.config, names=missing)


def _zero3_fresh_model_params(rank, world):
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    deepspeed.init_distributed(dist_backend="gloo")
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})  # noqa: F841
    torch.manual_seed(0)
    model = build_model(model_config=str(TINY))
    partitioned = [n for n, p in model.named_parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return partitioned, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # 2 spawned DeepSpeed ranks
def test_fresh_model_under_zero3_gets_clip_init(two_rank_results):
    # CLIPModel builds its towers with `_from_config`, which partitions them inside zero.Init under ZeRO-3
    # (rank 0's copy: the projections outside the towers are not partitioned yet; the engine broadcasts them)
    partitioned, params = two_rank_results["zero3"]
    assert any(n.startswith("text_model.") for n in partitioned) and any(
        n.startswith("vision_model.") for n in partitioned
    )

    class Gathered(torch.nn.Module):
        def named_parameters(self):
            return iter(params.items())

    assert_clip_init(Gathered(), CLIPConfig.from_json_file(str(TINY)))


@pytest.mark.slow  # 2 spawned DeepSpeed ranks
def test_fresh_model_under_zero3_has_the_weights_drawn_without_it(two_rank_results):
    # gathered per module on rank 0 inside zero.Init, partitioned over 2 ranks, and still each weight drawn by name
    _, params = two_rank_results["zero3"]
    plain = dict(build_model(model_config=str(TINY), seed=0).named_parameters())
    assert params.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(params[name].reshape(value.shape), value.detach()), name


# --- DiscoSiglipModel: the sigmoid loss in forward against transformers' SiglipModel, same mechanism as CLIP's ---
