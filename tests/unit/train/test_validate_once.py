"""Resolved once (train/validate/): the student's config is loaded once through the checks, the model builder, the
locking and the node facts; `validate` changes none of its inputs and hands back what it resolved; a model folder
is fingerprinted without reading its weights whole; SigLIP 2 budgets of any number of patches are accepted."""

import copy
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO, TINY_CONFIG, TOKENIZER_DIR

SIGLIP2 = REPO / "recipes/models/siglip2_tiny.json"


@pytest.fixture
def shards(tmp_path):
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    return str(tmp_path / "data")


def _parse(tmp_path, shards, *extra):
    from disco_clip_ds.train.args import parse_args

    argv = ["--output_dir", str(tmp_path / "out"), "--train_shards", shards, "--report_to", "none"]
    return parse_args([*argv, "--tokenizer_name", str(TOKENIZER_DIR), "--dataloader_num_workers", "0", *extra])


def _config_reads(monkeypatch, path: Path) -> list:
    """Every read of the config file at `path` through transformers (AutoConfig.from_pretrained, a config class's
    from_pretrained or from_json_file all go through PretrainedConfig._dict_from_json_file)."""
    from transformers import PretrainedConfig

    reads, original = [], PretrainedConfig._dict_from_json_file.__func__

    def counted(cls, json_file):
        if Path(json_file).resolve() == path.resolve():
            reads.append(cls.__name__)
        return original(cls, json_file)

    monkeypatch.setattr(PretrainedConfig, "_dict_from_json_file", classmethod(counted))
    return reads


@pytest.mark.parametrize("source", ["folder", "config"])
def test_the_student_config_is_loaded_once(source, tmp_path, shards, monkeypatch):
    """Through validate, the node facts, the model builder and the locking of a run (train/run.py's steps 1, 2 and
    5): one load of the student's config, from pretrained weights or from a config JSON."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.locking import lock_towers
    from disco_clip_ds.train.node_facts import node_facts
    from disco_clip_ds.train.validate import validate

    if source == "folder":
        build_model(model_config=str(TINY_CONFIG)).save_pretrained(tmp_path / "init")
        flags, config_file = ["--model_name_or_path", str(tmp_path / "init")], tmp_path / "init" / "config.json"
    else:
        flags, config_file = ["--model_config", str(TINY_CONFIG)], TINY_CONFIG
    model_args, data_args, args = _parse(tmp_path, shards, *flags, "--lock_text_tower")
    reads = _config_reads(monkeypatch, config_file)
    node_facts(model_args, data_args, args)
    checked = validate(model_args, data_args, args)
    run_args, resolved = checked.model_args, checked.config.to_dict()
    model = build_model(run_args.model_name_or_path, run_args.model_config, "disco", config=checked.config)
    lock_towers(model, run_args)
    assert len(reads) == 1, reads
    assert model.config.text_config.num_hidden_layers == checked.config.text_config.num_hidden_layers
    assert model.config.loss_impl == "disco" and checked.config.to_dict() == resolved  # set on the builder's copy


def test_validate_changes_none_of_its_inputs_and_returns_what_it_resolved(tmp_path, shards):
    """A run with a live teacher (its weight's default 0.5) and a DeepSpeed JSON: the three argument objects are as
    they were (field by field), and the checked run holds the filled-in default, both configs and the JSON."""
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.validate import validate

    build_model(model_config=str(TINY_CONFIG)).save_pretrained(tmp_path / "teacher")
    ds = REPO / "ds_configs/cpu_zero2.json"
    given = _parse(tmp_path, shards, "--model_config", str(TINY_CONFIG), "--teacher", str(tmp_path / "teacher"))
    given[2].deepspeed_json = None  # as arguments made without parse_args: validate reads the JSON itself
    given[2].deepspeed = str(ds)
    before = [copy.deepcopy(asdict(given[0])), copy.deepcopy(asdict(given[1])), json.dumps(given[2].to_dict())]
    checked = validate(*given)
    assert [asdict(given[0]), asdict(given[1]), json.dumps(given[2].to_dict())] == before
    assert given[0].distill_weight is None and given[2].deepspeed_json is None
    assert checked.model_args.distill_weight == 0.5 and checked.model_args.teacher == [str(tmp_path / "teacher")]
    assert checked.deepspeed == json.loads(ds.read_text())
    assert checked.config.model_type == checked.teacher_config[0].model_type == "clip"  # one per --teacher
    assert (checked.num_samples, checked.max_length, checked.image_size) == (8, 32, 64)  # tiny.json's


@pytest.mark.parametrize("budget", [1, 5, 256, 576, 1024])
def test_a_siglip2_budget_of_any_number_of_patches_is_accepted(budget, tmp_path, shards):
    """Siglip2 interpolates its position embeddings to any patch grid: budgets below a row of the tiny model's
    16 x 16 grid and above the grid train; the budget is the checked run's, the arguments keep theirs."""
    from disco_clip_ds.train.validate import validate

    given = _parse(tmp_path, shards, "--model_config", str(SIGLIP2), "--max_num_patches", str(budget))
    checked = validate(*given)
    assert checked.naflex == (4, budget) and checked.model_args.max_num_patches == budget
    default = _parse(tmp_path, shards, "--model_config", str(SIGLIP2))
    checked = validate(*default)
    assert checked.naflex == (4, 256) and checked.model_args.max_num_patches == 256
    assert default[0].max_num_patches is None


def _bytes_read(monkeypatch) -> list:
    """The bytes each file object opened by train/node_facts.py returned from read()."""
    import builtins

    import disco_clip_ds.train.node_facts as module

    counts = []

    class Counted:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            counts.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(module, "open", lambda *a, **k: Counted(builtins.open(*a, **k)), raising=False)
    return counts


def test_a_model_folder_is_fingerprinted_without_reading_its_weights_whole(tmp_path, monkeypatch):
    """A 64 GiB (sparse) weight file is fingerprinted by reading 3 MiB of it; the fingerprint changes with its size,
    with its safetensors header, and with a weight's bytes at its start or end; a small file is hashed whole."""
    from disco_clip_ds.train.node_facts import BLOCK, folder_fingerprint

    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**34], "data_offsets": [0, 2**36]}}).encode()
    with open(weights, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2**36)
    (folder / "config.json").write_text(TINY_CONFIG.read_text())
    counts = _bytes_read(monkeypatch)
    first = folder_fingerprint(folder)
    assert counts and sum(counts) <= 3 * BLOCK + len(TINY_CONFIG.read_bytes())  # read through the counted open
    assert first == folder_fingerprint(folder)

    def changed(edit):
        edit()
        return folder_fingerprint(folder)

    def write_at(offset, data):
        with open(weights, "r+b") as f:
            f.seek(offset)
            f.write(data)

    seen = [first]
    seen.append(changed(lambda: write_at(8, header.replace(b"F32", b"F16"))))  # another header
    seen.append(changed(lambda: write_at(8 + len(header) + 4, b"\1")))  # the first weight
    seen.append(changed(lambda: write_at(8 + len(header) + 2**36 - 2, b"\1")))  # the last weight
    seen.append(changed(lambda: open(weights, "ab").write(b"\0")))  # the size
    seen.append(changed(lambda: (folder / "config.json").write_text(TINY_CONFIG.read_text() + " ")))  # a small file
    assert len(set(map(json.dumps, seen))) == len(seen)
