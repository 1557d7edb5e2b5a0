"""Contrastive accumulation (`disco_clip_ds.train.accumulation`): the cached-gradient math against plain autograd in
float64 (with dropout replayed), then end to end: K micro-batches of b train exactly like one batch of K x b on
one rank, and N ranks x K micro-batches like one rank with N x K x b, under plain PyTorch, DDP, DeepSpeed
ZeRO-1/2/3 and FSDP, with gradient checkpointing; a resumed run continues exactly; bad settings are refused.
"""

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import (
    REPO,
    SGD,
    TINY_CONFIG,
    TOKENIZER_DIR,
    launch,
    launch_in_one_process,
    train_command,
    train_env,
)

from helpers import assert_same_training, assert_trained_under_fsdp, save_initial_model, step_losses, weights

STEPS, MICRO, SEED = 3, 4, 11
# The model and the cached-gradient path run in float64; the loss module computes its logits in fp32 by design,
# which bounds the agreement: ~1e-7 relative on the loss, ~1e-6 on gradients (a wrong factor would show as O(1)).
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
SAME_STREAM = ["--max_steps", str(STEPS), "--accelerator_config", '{"dispatch_batches": true}']


# --- the math, float64, one process ---


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


# --- bad settings: refused before training, with what to change ---


def _settings(**kw):
    base = dict(gradient_accumulation_steps=2, contrastive_accumulation=True, n_gpu=1, parallelism_config=None)
    return SimpleNamespace(**{**base, **kw})


def test_settings_that_cannot_accumulate_contrastively_are_refused():
    from disco_clip_ds.train.accumulation import AccumulationError, check_contrastive_accumulation

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


def test_a_deepspeed_json_contradicting_the_accumulation_is_refused(tmp_path):
    from disco_clip_ds.train.run import UsageError, check_deepspeed_batch

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 8}))
    args = lambda accum: SimpleNamespace(
        deepspeed=str(config),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accum,
        world_size=2,
    )
    check_deepspeed_batch(args(8))
    with pytest.raises(UsageError, match="gradient_accumulation_steps.*--gradient_accumulation_steps 2"):
        check_deepspeed_batch(args(2))


@pytest.mark.slow
def test_bad_settings_stop_every_rank_with_the_reason(tmp_path):
    """2 ranks under torchrun: each rank prints the reason and the launch ends (no rank waits in a collective)."""
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    cmd = [
        *train_command("torchrun", 2),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--train_shards",
        str(tmp_path / "data"),
        "--model_config",
        str(TINY_CONFIG),
        "--tokenizer_name",
        str(TOKENIZER_DIR),
        "--loss_impl",
        "local",
        "--gradient_accumulation_steps",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("cannot be accumulated contrastively") == 2, (proc.stdout + proc.stderr)[
        -3000:
    ]
    assert not (tmp_path / "out" / "model.safetensors").exists()


# --- end to end: the Trainer under every engine ---


@pytest.fixture(scope="module")
def initial_model(tmp_path_factory):
    return save_initial_model(tmp_path_factory.mktemp("init") / "tiny", SEED)


# The fixture's 10 runs (~15-25 s of imports per launch on a quiet 2-core machine, several times that on a loaded
# one) are charged to the first test that uses it.
E2E_TIMEOUT = pytest.mark.timeout(1800)

# AdamW with weight decay, clipping that bites, and a warmup + cosine schedule: all act on the accumulated gradient
# at the optimizer step, so K micro-batches must still train like one batch of all pairs. Adam divides by each
# gradient's own scale, which lifts fp32 summation-order noise in near-zero gradients: a looser update bound.
ADAMW = [
    "--optim",
    "adamw_torch",
    "--learning_rate",
    "1e-3",
    "--weight_decay",
    "0.1",
    "--max_grad_norm",
    "0.05",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial_model):
    """The references (1 rank, K=1, micro 4b; SGD and AdamW) and the accumulating runs; ~3 min on 2 cores."""
    root = tmp_path_factory.mktemp("accum")
    write_shards(root / "data", num_shards=4, per_shard=24, seed=3)
    data = [
        "--model_name_or_path",
        str(initial_model),
        "--train_shards",
        f"{root}/data/{{00000..00003}}.tar",
        "--train_num_samples",
        "96",
    ]
    common, same = [*data, *SGD], [*data, *SGD, *SAME_STREAM]
    micro = lambda b, k: ["--per_device_train_batch_size", str(b), "--gradient_accumulation_steps", str(k)]
    gc = ["--gradient_checkpointing", "true"]
    zero1 = root / "zero1.json"
    zero1.write_text(
        json.dumps(
            {
                **json.loads((REPO / "ds_configs/cpu_zero2.json").read_text()),
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000},
            }
        )
    )
    # the one-rank runs share one interpreter (the reference first); each is what `python -m disco_clip_ds.train` runs
    launch_in_one_process(
        [
            (root / "n1_k1", [*same, *micro(4 * MICRO, 1)]),
            (root / "n1_k4", [*same, *micro(MICRO, 4)]),
            (root / "n1_k4_plain", [*same, *micro(MICRO, 4), "--contrastive_accumulation", "false"]),
            (root / "adamw_k1", [*data, *ADAMW, *SAME_STREAM, *micro(4 * MICRO, 1)]),
            (root / "adamw_k4", [*data, *ADAMW, *SAME_STREAM, *micro(MICRO, 4)]),
        ]
    )
    # the launchers themselves are test_train's subject: torchrun starts fastest, accelerate sets up FSDP
    launch("torchrun", 2, root / "n2_k2_zero1", *same, *micro(MICRO, 2), ds_config=str(zero1))
    launch("torchrun", 2, root / "n2_k2_zero2", *same, *micro(MICRO, 2))
    launch("accelerate", 2, root / "n2_k2_zero3_gc", *same, *micro(MICRO, 2), *gc, ds_config="cpu_zero3.json")
    launch("accelerate", 2, root / "n2_k2_fsdp", *same, *micro(MICRO, 2), ds_config=None)
    launch("torchrun", 2, root / "n2_k2_ddp_gc", *same, *micro(MICRO, 2), *gc, ds_config=None)
    # each rank reading its own shards (the default), uninterrupted, then resumed from the step-2 checkpoint
    own = [*common, *micro(MICRO, 2), "--max_steps", "4", "--save_steps", "2"]
    launch("torchrun", 2, root / "full", *own)
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    launch("torchrun", 2, root / "resumed", *own, "--resume_from_checkpoint", "latest")
    return root


@E2E_TIMEOUT
@pytest.mark.parametrize("run", ["n1_k4", "n2_k2_zero1", "n2_k2_zero2", "n2_k2_zero3_gc", "n2_k2_fsdp", "n2_k2_ddp_gc"])
@pytest.mark.slow
def test_accumulated_run_trains_like_one_batch_of_all_pairs(runs, initial_model, run):
    if "fsdp" in run:  # sharded by FSDP2, not fallen back to DDP
        assert_trained_under_fsdp(runs / run)
    assert_same_training(runs / run, runs / "n1_k1", weights(initial_model), steps=STEPS)


@E2E_TIMEOUT
@pytest.mark.slow
def test_contrastive_accumulation_false_keeps_independent_micro_batch_losses(runs):
    """The flag off: the same K=4 run trains on 4 separate losses of b pairs, so the reference check above can fail."""
    plain, reference = step_losses(runs / "n1_k4_plain"), step_losses(runs / "n1_k1")
    # at the shared initial weights CLIP's loss is about ln(pairs): ln(4) per micro-batch against ln(16)
    assert reference[0] - plain[0] > 0.5
    logged = json.loads((runs / "n1_k4_plain" / "trainer_state.json").read_text())["log_history"][0]
    assert logged["global_contrastive_batch"] == MICRO


@E2E_TIMEOUT
@pytest.mark.slow
def test_logged_contrastive_batch_is_micro_x_world_x_k(runs):
    for run, expected in (("n1_k4", 4 * MICRO), ("n2_k2_zero2", 4 * MICRO), ("n1_k1", 4 * MICRO)):
        logged = json.loads((runs / run / "trainer_state.json").read_text())["log_history"][0]
        assert logged["global_contrastive_batch"] == expected, run
        assert json.loads((runs / run / "run.json").read_text())["global_contrastive_batch"] == expected


@E2E_TIMEOUT
@pytest.mark.slow
def test_resumed_run_continues_exactly(runs):
    full, resumed = step_losses(runs / "full"), step_losses(runs / "resumed")
    assert (runs / "resumed.log").read_text().count("{'loss': ") == 2  # steps 3 and 4 were trained after the resume
    assert len(full) == len(resumed) == 4
    assert resumed == pytest.approx(full, rel=1e-6)
    wa, wb = weights(runs / "full"), weights(runs / "resumed")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6


@E2E_TIMEOUT
@pytest.mark.slow
def test_weight_decay_clipping_and_schedule_act_on_the_accumulated_gradient(runs, initial_model):
    for run in ("adamw_k1", "adamw_k4"):
        history = json.loads((runs / run / "trainer_state.json").read_text())["log_history"]
        assert all(h["grad_norm"] > 0.05 for h in history if "grad_norm" in h), run  # clipping was active
        # one warmup step (at the full lr: warmup starts at lr / warmup), then cosine over the remaining two
        assert [h["learning_rate"] for h in history if "learning_rate" in h] == pytest.approx([1e-3, 1e-3, 5e-4])
    assert_same_training(runs / "adamw_k4", runs / "adamw_k1", weights(initial_model), update_rtol=1e-3, steps=STEPS)
