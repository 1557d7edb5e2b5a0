"""What the in-process `disco-clip train` tests of train/ share: the command run in this process, and a set-up of
tiny shards, a model config whose eos disagrees with the tokenizer, a cut-short JSON and no Hugging Face token."""

import json

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO


@pytest.fixture
def train_main(tmp_path):
    """`disco-clip train` in this process, with --output_dir TMP/out: its exit code, its messages on stderr."""
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main

    def run(*args):
        return run_main(main, ["--output_dir", str(tmp_path / "out"), "--report_to", "none", *args], "disco-clip train")

    return run


@pytest.fixture
def bad_arguments_setup(tmp_path, monkeypatch):
    """Tiny shards, a model config whose eos disagrees with the tokenizer, and no Hugging Face token anywhere."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))  # nor a cached one
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    config = json.loads((REPO / "recipes/models/tiny.json").read_text())
    config["text_config"]["eos_token_id"] = 49407
    (tmp_path / "wrong_eos.json").write_text(json.dumps(config))
    (tmp_path / "not.json").write_text('{"zero_optimization": {"stage": 2,')  # cut short
    return {
        "data": str(tmp_path / "data"),
        "tmp": str(tmp_path),
        "wrong_eos": str(tmp_path / "wrong_eos.json"),
        "not_json": str(tmp_path / "not.json"),
    }
