"""--torch_compile in process (`disco_clip_ds.train.compile`): the towers compiled in place give the eager model's
loss, embeddings and gradients, with grad and without (contrastive accumulation's two passes), and keep every key;
the Trainer is left nothing to compile; ZeRO-3 and FSDP, and a compile that fails, run eager after one line. (Inductor
against eager over 20 ZeRO-2 steps: tests/launched/test_compile.py.)"""

import logging
from types import SimpleNamespace

import pytest
import torch

from disco_clip_ds.testing.launch import REPO, TOKENIZER_DIR
from disco_clip_ds.train.compile import CompileSettings, compile_towers, eager_forward, take_compile_settings

TINY = REPO / "recipes/models/tiny.json"


def _model(seed: int = 3):
    from transformers import CLIPConfig

    from disco_clip_ds.models.clip import DiscoCLIPModel

    config = CLIPConfig.from_json_file(str(TINY))
    torch.manual_seed(seed)
    return DiscoCLIPModel(config).train()


def _batch(model, size: int = 6) -> dict:
    g = torch.Generator().manual_seed(1)
    text, vision = model.config.text_config, model.config.vision_config
    ids = torch.randint(2, text.vocab_size, (size, text.max_position_embeddings), generator=g)
    pixels = torch.randn(size, 3, vision.image_size, vision.image_size, generator=g)
    return {"input_ids": ids, "pixel_values": pixels}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, return_loss=True)
    out.loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return out, grads


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own model from scratch (dynamo's caches are per code object, shared by the models)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow  # dynamo traces both towers: seconds, beyond the fast tier's budget
def test_compiled_towers_give_the_eager_loss_embeddings_and_gradients_and_keep_every_key(tmp_path):
    """aot_eager: dynamo and AOTAutograd trace both towers (forward and backward graphs), without inductor's minutes
    of C++ compiles; inductor's kernels are the launched test's."""
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    eager, compiled = _model(), _model()
    keys = list(eager.state_dict())
    assert compile_towers(compiled, CompileSettings("aot_eager")) == ["vision tower", "text tower"]
    batch = _batch(eager)
    out_e, grads_e = _loss_and_grads(eager, batch)
    out_c, grads_c = _loss_and_grads(compiled, batch)
    assert counters["stats"]["unique_graphs"] >= 2  # both towers went through dynamo: the check below can fail
    assert out_c.loss.item() == pytest.approx(out_e.loss.item(), rel=1e-6)
    assert torch.allclose(out_c.image_embeds, out_e.image_embeds, atol=1e-6)
    assert (grads_c - grads_e).norm() <= 1e-5 * grads_e.norm()
    with torch.no_grad():  # contrastive accumulation's first pass: a graph of its own, without grad
        nograd = compiled(**batch, return_loss=False, return_logits=False)
    assert torch.allclose(nograd.text_embeds, out_e.text_embeds, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 4
    # names, state dict and saved model as the eager model's: no `_orig_mod.` anywhere
    assert list(compiled.state_dict()) == keys
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in eager.named_parameters()]
    compiled.save_pretrained(tmp_path / "compiled")
    eager.save_pretrained(tmp_path / "eager")
    saved = load_file(tmp_path / "compiled" / "model.safetensors")
    assert saved.keys() == load_file(tmp_path / "eager" / "model.safetensors").keys()
    assert all(torch.equal(saved[k], v) for k, v in load_file(tmp_path / "eager" / "model.safetensors").items())
    assert eager_forward(compiled.vision_model) is not compiled.vision_model.forward


def _failing_backend(graph, example_inputs):
    raise RuntimeError("no kernels for this graph\n(a second line, left out)")


@pytest.mark.slow
def test_a_failed_compile_is_one_line_per_tower_and_the_step_runs_eager(caplog, capfd):
    """A backend that fails on every graph: the towers' forwards are traced, the backend raises, each tower says why
    in one line and runs eager, with the eager model's loss and gradients."""
    eager, compiled = _model(), _model()
    compile_towers(compiled, CompileSettings(_failing_backend))
    batch = _batch(eager)
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds.train"):
        out_c, grads_c = _loss_and_grads(compiled, batch)
        _loss_and_grads(compiled, batch)  # said once: the tower stays eager
    out_e, grads_e = _loss_and_grads(eager, batch)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [
        "--torch_compile: the vision tower runs eager: RuntimeError: no kernels for this graph",
        "--torch_compile: the text tower runs eager: RuntimeError: no kernels for this graph",
    ], said
    assert not compiled.vision_model.forward.is_compiled and not compiled.text_model.forward.is_compiled
    assert out_c.loss.item() == out_e.loss.item() and torch.equal(grads_c, grads_e)
    assert "Traceback" not in "".join(capfd.readouterr())


@pytest.mark.slow
def test_no_cxx_compiler_is_one_line_and_the_step_runs_eager(caplog, capfd, monkeypatch):
    """inductor without a working C++ compiler (CXX naming none; its graph cache off, which would skip the
    compiler): the towers run eager after one line each naming the cause."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++"))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    model = _model()
    compile_towers(model, CompileSettings("inductor"))
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds.train"):
        _loss_and_grads(model, _batch(model))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2 and all("runs eager" in s and "No working C++ compiler" in s for s in said), said
    assert all("\n" not in s for s in said)
    assert "Traceback" not in "".join(capfd.readouterr())


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_under_zero3_or_fsdp_the_towers_run_eager_after_one_line(engine, caplog, monkeypatch):
    model = _model()
    if engine == "zero3":  # the mark ZeRO-3 leaves on every parameter it partitions
        monkeypatch.setattr(type(model.logit_scale), "ds_id", 0, raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as `accelerate launch` with an FSDP config sets it
    forwards = (model.vision_model.forward, model.text_model.forward)
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds.train"):
        assert compile_towers(model, CompileSettings("aot_eager")) == []
    assert (model.vision_model.forward, model.text_model.forward) == forwards  # untouched
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("--torch_compile: the towers run eager: "), said
    assert ("ZeRO-3" if engine == "zero3" else "FSDP") in said[0]


def test_the_settings_are_taken_from_the_trainer():
    """With them left on the arguments the Trainer would compile the whole model, the loss's collectives included."""
    args = SimpleNamespace(torch_compile=True, torch_compile_backend="inductor", torch_compile_mode="max-autotune")
    assert take_compile_settings(args) == CompileSettings("inductor", "max-autotune")
    assert (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode) == (False, None, None)
    assert take_compile_settings(args) is None
    assert compile_towers(_model(), None) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--torch_compile_backend", "nonesuch"], "--torch_compile_backend nonesuch: not a torch.compile backend"),
        (["--torch_compile", "true", "--torch_compile_mode", "fastest"], "--torch_compile_mode fastest: one of"),
        (["--torch_compile_backend", "aot_eager", "--torch_compile_mode", "max-autotune"], "is inductor's"),
    ],
)
@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_unknown_backend_or_mode_is_refused_in_one_line(flags, message, train_main, tmp_path, capsys):
    from disco_clip_ds.testing.images import write_shards

    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    argv = ["--train_shards", str(tmp_path / "data"), "--model_config", str(TINY), "--tokenizer_name"]
    assert train_main(*argv, str(TOKENIZER_DIR), *flags) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(said) == 1 and message in said[0], said
