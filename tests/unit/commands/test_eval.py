"""`disco-clip eval` (commands/eval.py): CLIP_benchmark's record, and each usage error in one line."""

from __future__ import annotations

import json

import pytest

from disco_clip_ds.commands.eval import load_for_eval
from disco_clip_ds.errors import CheckpointError
from disco_clip_ds.eval.tasks import zeroshot_classification

from unit.eval.sets import CLASSNAMES, TEMPLATES, eval_main, tiny_clip


@pytest.mark.slow  # beyond the fast tier's time budget
def test_cli_writes_clip_benchmark_record(cls_set, model_dir, tmp_path, capsys):
    folder, images, labels = cls_set
    out = tmp_path / "res" / "zeroshot.json"
    assert eval_main(["--model", str(model_dir), "--data", str(folder), "--batch_size", "3", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert set(record) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert record["task"] == "zeroshot_classification"
    model, tokenizer, processor = tiny_clip()
    expected = zeroshot_classification(
        model, tokenizer, str(folder), CLASSNAMES, TEMPLATES, image_processor=processor, progress=False
    )
    assert record["metrics"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/nonexistent/shards"], "shards not found, e.g. 'shards'"),
        (["--data", "DIR/{00000..00005}.tar"], "3 of 6 shards not found"),
        (["--classnames", "/nonexistent/names.txt"], "not found"),
        (["--classnames", "imagenet1k", "--templates", "TPL"], "must contain '{c}'"),
        (["--batch_size", "0"], "--batch_size must be positive"),
        (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),  # not a hub id's error
        (["--model", "./gone", "--data", "/nonexistent/shards"], "--model ./gone: no such folder"),  # before the data
    ],
)
@pytest.mark.slow  # beyond the fast tier's time budget
def test_cli_errors_are_clear(cls_set, model_dir, tmp_path, capsys, extra, message):
    folder, _, _ = cls_set
    (tmp_path / "TPL").write_text("no placeholder here\n")
    extra = [str(tmp_path / "TPL") if e == "TPL" else e.replace("DIR", str(folder)) for e in extra]
    argv = ["--model", str(model_dir), "--data", str(folder), *extra]
    assert eval_main(argv) == 2  # bad usage, as from every command
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_weightless_checkpoint_points_to_export(cls_set, model_dir, tmp_path, capsys):
    folder, _, _ = cls_set
    checkpoint = tmp_path / "checkpoint-8"  # what ZeRO-3 leaves without gathered weights: config + DeepSpeed state
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text((model_dir / "config.json").read_text())
    (checkpoint / "latest").write_text("global_step8")
    assert eval_main(["--model", str(checkpoint), "--data", str(folder)]) == 2
    assert "run `disco-clip export" in capsys.readouterr().err


@pytest.mark.slow  # beyond the fast tier's time budget
def test_class_index_beyond_classnames_is_reported(cls_set, model_dir, tmp_path, capsys):
    folder, _, _ = cls_set
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    assert (
        eval_main(["--model", str(model_dir), "--data", str(folder), "--classnames", str(tmp_path / "three.txt")]) == 2
    )
    assert "there are 3 class names" in capsys.readouterr().err


def _token_id_warnings(call) -> list[str]:
    """transformers' "*_token_id must be `None` or an integer within the vocabulary" warnings while `call` runs
    (warned once per process: its memory of what it warned is cleared first)."""
    import logging

    from transformers.utils import logging as hf_logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logging.warning_once.cache_clear()
    hf_logging.get_logger().addHandler(handler)
    try:
        call()
    finally:
        hf_logging.get_logger().removeHandler(handler)
    return [m for m in seen if "must be `None` or an integer within the vocabulary" in m]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_siglip_model_loads_for_eval_without_token_id_warnings(tmp_path, monkeypatch):
    """A SigLIP run warned "bos_token_id must be None or an integer within the vocabulary ... got 49406" at its start,
    its eval and its export: about SiglipTextConfig's own defaults, which transformers builds to diff each save and
    repr against (compat.quiet_default_config_warnings, which `disco-clip eval` and `train` install). The recipe's
    own ids are the tokenizer's, within its vocabulary."""
    from transformers import AutoTokenizer, CLIPImageProcessor
    from transformers import configuration_utils as cu

    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.testing.launch import REPO

    recipe = json.loads((REPO / "recipes/models/siglip_tiny.json").read_text())["text_config"]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/tokenizer")
    assert (recipe["bos_token_id"], recipe["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert len(tokenizer) <= recipe["vocab_size"]
    folder = tmp_path / "siglip"
    build_model(None, str(REPO / "recipes/models/siglip_tiny.json")).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(folder)
    # as a fresh process has it: transformers' own diff, not one this test process may have quieted before
    monkeypatch.setattr(
        cu, "recursive_diff_dict", getattr(cu.recursive_diff_dict, "__wrapped__", cu.recursive_diff_dict)
    )
    loaded = []
    assert _token_id_warnings(lambda: loaded.extend(load_for_eval(str(folder)))) == []  # what `disco-clip eval` loads
    assert loaded[0].config.model_type == "siglip"


def test_under_torchrun_each_rank_evaluates_on_the_gpu_of_its_local_rank(monkeypatch):
    from disco_clip_ds.commands.eval import launched_device

    assert launched_device("cuda") == "cuda" and launched_device("cpu") == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched_device("cuda") == "cuda:1" and launched_device("cpu") == "cpu"
    assert launched_device("cuda:0") == "cuda:0"  # a device the user named stands


# --- a checkpoint is verified before it is read, as export verifies it ---


def _damaged_copy(model_dir, folder, how: str):
    """A copy of `model_dir` in `folder` with a manifest, then its model.safetensors damaged: one byte flipped in the
    tensors (same size: only the checksum shows it), cut to half, or ("none") left whole."""
    import shutil

    from disco_clip_ds.checkpoint.manifest import write_manifest

    shutil.copytree(model_dir, folder)
    write_manifest(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if how == "flipped":
        data[-100] ^= 0xFF
    if how != "none":
        weights.write_bytes(bytes(data) if how == "flipped" else bytes(data[: len(data) // 2]))
    return folder


@pytest.mark.parametrize(
    "how, problem",
    [
        ("flipped", "model.safetensors does not match its checksum in the manifest"),
        ("truncated", "model.safetensors is "),
    ],
)
def test_eval_refuses_a_model_that_fails_its_manifest_as_export_does(
    model_dir, cls_set, tmp_path, capsys, how, problem
):
    from disco_clip_ds.commands import export as export_command
    from disco_clip_ds.errors import run_main

    folder = _damaged_copy(model_dir, tmp_path / "model", how)
    assert eval_main(["--model", str(folder), "--data", str(cls_set[0])]) == 1  # was 0 (flipped), a traceback (cut)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"disco-clip eval: --model {folder} does not verify: {problem}")
    assert run_main(export_command.main, [str(folder), str(tmp_path / "out")], "disco-clip export") == 1
    assert f"'{folder}' does not verify: {problem}" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_refused_naming_the_one_beside_it_that_verifies(model_dir, tmp_path, capsys):
    """Trainer checkpoints (trainer state, RNG state, manifest): the damaged checkpoint-2 is refused, naming
    checkpoint-1; weights without a manifest that safetensors cannot read are one line too."""
    from disco_clip_ds.checkpoint.manifest import write_manifest

    for step in (1, 2):
        checkpoint = _damaged_copy(model_dir, tmp_path / "run" / f"checkpoint-{step}", "none")
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (checkpoint / "rng_state.pth").write_bytes(b"rng")
        write_manifest(checkpoint)
    weights = tmp_path / "run" / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="the newest checkpoint beside it that verifies is .*checkpoint-1$"):
        load_for_eval(str(weights.parent))
    (tmp_path / "run" / "checkpoint-1" / "manifest.json").unlink()  # no manifest: an incomplete save
    with pytest.raises(CheckpointError, match="no manifest.json: the save did not complete; no checkpoint beside"):
        load_for_eval(str(tmp_path / "run" / "checkpoint-1"))
    cut = _damaged_copy(model_dir, tmp_path / "cut", "truncated")
    (cut / "manifest.json").unlink()  # save_pretrained's folder: nothing to check against, safetensors' error
    with pytest.raises(CheckpointError, match=r"^--model .*cut: its weights cannot be read \(.*\): a damaged"):
        load_for_eval(str(cut))
