"""Export (export.weights, through `disco-clip export`: commands/export.py) of plain checkpoints: every weight of a
sharded safetensors checkpoint kept; a diverged run's weights refused, naming the tensor. (ZeRO checkpoints and
their refusals, launched: launched/test_export_zero.py.)"""

from __future__ import annotations

import subprocess

import pytest
import torch

from disco_clip_ds.commands import export as export_command
from disco_clip_ds.errors import run_main
from disco_clip_ds.export import weights as ex
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR

MODEL_CONFIG = TINY_CONFIG


def export_main(argv: list[str]) -> int:
    """`disco-clip export` in this process: its exit code, its messages on stderr."""
    return run_main(export_command.main, argv, "disco-clip export")


@pytest.mark.slow  # beyond the fast tier's time budget
def test_weights_not_finite_or_absurd_are_refused_naming_the_tensor(tmp_path, capsys):
    """A diverged run's weights (NaN, or 1e30: a dot product of two such rows overflows float32) are not exported."""
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    model = CLIPModel(CLIPConfig.from_json_file(str(MODEL_CONFIG)))
    for value, says in ((float("nan"), "holds 1 NaN or inf values"), (1e30, "reaches |w| = 1e+30")):
        checkpoint = tmp_path / "diverged"
        with torch.no_grad():
            model.text_projection.weight[1, 2] = value
        model.save_pretrained(checkpoint)
        AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(checkpoint)
        CLIPImageProcessor().save_pretrained(checkpoint)
        capsys.readouterr()  # save_pretrained's progress bar
        assert export_main([str(checkpoint), str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"disco-clip export: weight 'text_projection.weight' in {checkpoint} {says}"), err
        assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow  # beyond the fast tier's time budget
def test_export_of_a_plain_sharded_checkpoint_keeps_every_weight(tmp_path):
    """A checkpoint without DeepSpeed state (DDP, or ZeRO-3 with gathered weights) in sharded safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(3)
    model = CLIPModel(CLIPConfig.from_json_file(str(MODEL_CONFIG)))
    checkpoint = tmp_path / "checkpoint-9"
    model.save_pretrained(checkpoint, max_shard_size="300KB")
    assert (checkpoint / "model.safetensors.index.json").is_file()
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(checkpoint)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(checkpoint)
    out = ex.export_checkpoint(checkpoint, tmp_path / "out")
    exported = load_file(out / "model.safetensors")
    original = model.state_dict()
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def plain_checkpoint(folder):
    """A checkpoint without DeepSpeed state of the tiny CLIP, with its tokenizer and image processor."""
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    CLIPModel(CLIPConfig.from_json_file(str(MODEL_CONFIG))).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    CLIPImageProcessor().save_pretrained(folder)
    return folder


def test_a_missing_input_or_a_file_is_bad_usage(tmp_path, capsys):
    assert export_main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"disco-clip export: checkpoint folder '{tmp_path / 'nope'}' does not exist\n"
    weights = plain_checkpoint(tmp_path / "checkpoint-1") / "model.safetensors"
    capsys.readouterr()  # save_pretrained's progress bar
    assert export_main([str(weights), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"disco-clip export: '{weights}' is a file, not a checkpoint folder") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture
def read_only_folder(tmp_path):
    """A real read-only file system (root ignores file modes, not a read-only mount)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_an_unwritable_output_is_one_line(tmp_path, read_only_folder, capsys):
    checkpoint = plain_checkpoint(tmp_path / "checkpoint-1")
    capsys.readouterr()
    for out in (read_only_folder / "model", read_only_folder / "deeper" / "model"):
        assert export_main([str(checkpoint), str(out)]) == 1
        err = capsys.readouterr().err
        assert err == f"disco-clip export: cannot write '{out}': Read-only file system: choose a writable folder\n"
    assert list(read_only_folder.iterdir()) == []


def test_a_second_export_into_one_folder_is_refused_naming_the_first(tmp_path, capsys):
    """The lock is beside OUTPUT_DIR (.NAME.lock: the folder stays empty until its rename); the holder here is a
    forked process holding it, as a running export does."""
    import socket

    from disco_clip_ds.distributed.runlock import writer_lock
    from disco_clip_ds.testing.writers import held_elsewhere

    checkpoint = plain_checkpoint(tmp_path / "checkpoint-1")
    out = tmp_path / "model"
    capsys.readouterr()
    with held_elsewhere(writer_lock(out, "OUTPUT_DIR", "disco-clip export", beside=True)) as pid:
        assert export_main([str(checkpoint), str(out)]) == 2
    holder = f"(disco-clip export: host {socket.gethostname()}, pid {pid}, since "
    err = capsys.readouterr().err
    assert err.startswith(f"disco-clip export: OUTPUT_DIR {out}: being written by another process {holder}")
    assert err.endswith("wait for it to end, or give another OUTPUT_DIR\n") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # nothing written, no lock left
