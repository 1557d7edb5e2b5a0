"""Contrastive accumulation's math (`disco_clip_ds.train.accumulation`): the cached-gradient steps against plain
autograd over the whole batch in float64 (with dropout replayed), and a bf16 model against one bf16 batch."""

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.testing.launch import (
    REPO,
)

STEPS, MICRO, SEED = 3, 4, 11

# The model and the cached-gradient path run in float64; the loss module computes its logits in fp32 by design,
# which bounds the agreement: ~1e-7 relative on the loss, ~1e-6 on gradients (a wrong factor would show as O(1)).
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def _tiny_model(dropout: float = 0.0):
    from transformers import CLIPConfig

    from disco_clip_ds.models.clip import DiscoCLIPModel

    config = CLIPConfig.from_json_file(str(REPO / "recipes/models/tiny.json"))
    for tower in (config.text_config, config.vision_config):
        tower.dropout = tower.attention_dropout = dropout
    config.chunk_size = 5  # several tiles
    torch.manual_seed(SEED)
    model = DiscoCLIPModel(config).double().train()
    with torch.no_grad():
        model.logit_scale.fill_(2.0)  # below CLIP's clamp, so its gradient is not zero
    return model


def _micro_batches(model, k: int, b: int):
    gen = torch.Generator().manual_seed(SEED)
    text, vision = model.config.text_config, model.config.vision_config
    batches = []
    for _ in range(k):
        ids = torch.randint(1, text.vocab_size - 2, (b, 7), generator=gen)
        ids[:, -1] = text.eos_token_id
        pixels = torch.randn(b, 3, vision.image_size, vision.image_size, generator=gen, dtype=torch.float64)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels})
    return batches


def clip_loss_fp64(image_embeds, text_embeds, logit_scale):
    """CLIP's loss written out, for references independent of disco_clip_ds.losses."""
    logits = logit_scale * image_embeds @ text_embeds.T
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def assert_same_grads(got: dict, expected: dict):
    assert got.keys() == expected.keys() and "logit_scale" in got
    for name, want in expected.items():
        # per tensor, in norm: k_proj's bias has a zero gradient (softmax ignores it), where elementwise checks see
        # noise
        assert (got[name] - want).norm() <= GRAD_RTOL * want.norm() + 1e-12, name
    assert expected["logit_scale"].abs().item() > 1e-6


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _cached_gradient_step(model, batches, replay: bool = True):
    """Steps 1-3 of the accumulation as the Trainer mixin runs them, on a bare model; returns (loss, grads)."""
    from disco_clip_ds.train.accumulation import (
        _rng_state,
        _set_rng_state,
        cached_embedding_gradients,
        logit_params,
        surrogate_loss,
    )

    model.zero_grad()
    states, images, texts = [], [], []
    with torch.no_grad():
        for batch in batches:
            states.append(_rng_state())
            out = model(**batch)
            images.append(out.image_embeds)
            texts.append(out.text_embeds)
    loss, grads, param_grads = cached_embedding_gradients(images, texts, logit_params(model, out), model.global_loss)
    for k, batch in enumerate(batches):
        if replay:
            _set_rng_state(states[k])
        out = model(**batch)
        params = logit_params(model, out)
        surrogate_loss(out.image_embeds, out.text_embeds, params, grads[k], param_grads, len(batches)).backward()
    return loss, _grads(model)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_cached_gradients_equal_autograd_over_the_whole_batch_float64():
    model = _tiny_model()
    batches = _micro_batches(model, k=4, b=3)
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    model.zero_grad()
    out = model(**whole)  # plain autograd over all 12 pairs, one graph
    reference = clip_loss_fp64(out.image_embeds, out.text_embeds, out.logit_scale)
    reference.backward()
    expected = _grads(model)
    loss, got = _cached_gradient_step(model, batches)
    assert loss.item() == pytest.approx(reference.item(), rel=LOSS_RTOL)
    assert_same_grads(got, expected)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_siglip_cached_gradients_equal_autograd_over_the_whole_batch_float64():
    """The same for the sigmoid loss, whose bias is a second logit parameter with its own cached gradient."""
    from disco_clip_ds.models.build import build_model

    torch.manual_seed(SEED)
    model = build_model(model_config=str(REPO / "recipes/models/siglip_tiny.json"), chunk_size=5).double().train()
    with torch.no_grad():
        model.logit_bias.fill_(-1.0)  # the loss then depends on the bias markedly
    batches = _micro_batches(model, k=4, b=3)
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    model.zero_grad()
    out = model(**whole)
    logits = out.logit_scale * out.image_embeds @ out.text_embeds.T + out.logit_bias  # SigLIP's loss written out
    signs = 2 * torch.eye(len(logits), dtype=logits.dtype) - 1
    reference = -F.logsigmoid(signs * logits).sum() / len(logits)
    reference.backward()
    expected = _grads(model)
    loss, got = _cached_gradient_step(model, batches)
    assert loss.item() == pytest.approx(reference.item(), rel=LOSS_RTOL)
    assert_same_grads(got, expected)
    assert expected["logit_bias"].abs().item() > 1e-6


@pytest.mark.slow  # beyond the fast tier's time budget
def test_dropout_is_replayed_between_the_two_passes_float64():
    model = _tiny_model(dropout=0.2)
    batches = _micro_batches(model, k=3, b=4)
    # Plain autograd over the whole batch, each micro-batch drawing its dropout masks from where the cached
    # pass's first forward drew them.
    model.zero_grad()
    torch.manual_seed(123)
    outs = [model(**batch) for batch in batches]
    reference = clip_loss_fp64(
        torch.cat([o.image_embeds for o in outs]), torch.cat([o.text_embeds for o in outs]), outs[0].logit_scale
    )
    reference.backward()
    expected = _grads(model)
    torch.manual_seed(123)
    loss, got = _cached_gradient_step(model, batches)
    assert loss.item() == pytest.approx(reference.item(), rel=LOSS_RTOL)
    assert_same_grads(got, expected)
    torch.manual_seed(123)
    _, unreplayed = _cached_gradient_step(model, batches, replay=False)  # fresh masks in the second pass
    gap = max((unreplayed[n] - expected[n]).abs().max().item() for n in expected)
    assert gap > 1e-4, "dropout had no effect: the replay check above proves nothing"


@pytest.mark.slow  # beyond the fast tier's time budget
def test_bf16_model_accumulates_as_exactly_as_one_bf16_batch():
    """DeepSpeed's bf16 runs the model in bf16 (the 196K-on-8-GPU recipe): K cached micro-batches must give the
    global-batch gradient to bf16 accuracy, no less exact than one bf16 backward over all pairs."""
    bf16 = _tiny_model().to(torch.bfloat16)
    exact = _tiny_model()
    exact.load_state_dict({name: value.double() for name, value in bf16.state_dict().items()})  # the same weights
    batches = _micro_batches(exact, k=4, b=4)
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    out = exact(**whole)
    clip_loss_fp64(out.image_embeds, out.text_embeds, out.logit_scale).backward()
    reference = _grads(exact)
    to_bf16 = lambda batch: {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    _, accumulated = _cached_gradient_step(bf16, [to_bf16(b) for b in batches])
    bf16.zero_grad()
    bf16(**to_bf16(whole), return_loss=True).loss.backward()
    one_batch = _grads(bf16)
    flat = lambda grads: torch.cat([grads[name].double().flatten() for name in reference])
    error = lambda grads: ((flat(grads) - flat(reference)).norm() / flat(reference).norm()).item()
    # measured: 0.020 accumulated, 0.024 in one batch; a wrong factor anywhere would be O(1)
    assert error(accumulated) <= 1.5 * error(one_batch) and error(accumulated) < 0.04, (
        error(accumulated),
        error(one_batch),
    )
    assert accumulated["logit_scale"].item() == pytest.approx(reference["logit_scale"].item(), rel=0.02)


def _trainer_loop_step(model, batches, merged: int):
    """One optimizer step as DiscoTrainer drives ContrastiveAccumulation: `record` the K fetched micro-batches, then
    per micro-batch `take` the batch its training_step runs (None: nothing), `micro_step` around the forward and
    `loss`'s backward. Returns (the summed logged loss, grads, the rows of each forward with grad)."""
    from types import SimpleNamespace

    from disco_clip_ds.train.accumulation import ContrastiveAccumulation

    args = SimpleNamespace(contrastive_accumulation=True, gradient_accumulation_steps=len(batches))
    accumulation = ContrastiveAccumulation(args)
    embed_and_cache = lambda update: accumulation.embed_and_cache(update, model, model, lambda b: b, _no_autocast)
    model.zero_grad()
    accumulation.record(batches, merged)
    logged, rows = 0.0, []
    for inputs in batches:
        batch = accumulation.take(inputs)
        if batch is None:
            continue
        with accumulation.micro_step(batch, embed_and_cache):
            loss = accumulation.loss(model, model, batch, return_outputs=False)
            loss.backward()
        logged += loss.item()
        rows.append(accumulation.last_forward_rows)
    assert accumulation.update is None  # the step's last micro-batch closed the update
    return logged, _grads(model), rows


def _no_autocast():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize(
    "merged", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_a_stages_merged_micro_batches_give_the_global_batch_gradient_float64(merged):
    """--stage_micro_batch_sizes: K=4 micro-batches of 3 run as 4/merged forwards of 3 x merged rows; the step's loss
    and gradient are plain autograd's over all 12 pairs, whatever the merge."""
    model = _tiny_model()
    batches = _micro_batches(model, k=4, b=3)
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    model.zero_grad()
    out = model(**whole)
    reference = clip_loss_fp64(out.image_embeds, out.text_embeds, out.logit_scale)
    reference.backward()
    expected = _grads(model)
    logged, got, rows = _trainer_loop_step(model, batches, merged)
    assert rows == [3 * merged] * (4 // merged)
    assert logged == pytest.approx(reference.item(), rel=LOSS_RTOL)
    assert_same_grads(got, expected)


def test_take_refuses_micro_batches_out_of_order():
    from types import SimpleNamespace

    from disco_clip_ds.train.accumulation import ContrastiveAccumulation

    accumulation = ContrastiveAccumulation(
        SimpleNamespace(contrastive_accumulation=True, gradient_accumulation_steps=2)
    )
    first, second = {"x": torch.zeros(1)}, {"x": torch.ones(1)}
    accumulation.record([first, second], 2)
    with pytest.raises(RuntimeError, match="in order"):
        accumulation.take(second)
