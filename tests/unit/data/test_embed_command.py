"""`disco-clip data embed` (commands/data.py, data/prep/embed.py): two sources whose shards share file names and
sample keys get their own embeddings (D3), and a teacher that cannot be read or stored is one line, exit 2, before
any model is built (D5, D6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disco_clip_ds.commands.data import embed_main
from disco_clip_ds.data.embeddings import EmbeddingStore
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.teacher_id import teacher_fingerprint
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.images import noise_image_bytes, write_samples, write_shards
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR


def _embed(argv: list[str]) -> int:
    return run_main(embed_main, argv, "disco-clip data embed")


@pytest.mark.slow  # builds a tiny teacher and embeds 12 samples
def test_two_sources_with_the_same_shard_names_get_their_own_embeddings(tmp_path, capsys, monkeypatch):
    """D3: b's shards were "already done" with a's sidecars, and training read a's embeddings for b's samples."""
    from disco_clip_ds.models.build import build_model

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for src in "ab":  # the same shard names and keys (s00000 ...), other images and captions
        samples = [{"jpg": noise_image_bytes(rng, "JPEG"), "txt": f"{src}: caption {i}"} for i in range(6)]
        write_samples(tmp_path / src, samples, per_shard=3)
    torch.manual_seed(0)
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(tmp_path / "teacher")
    argv = ["--teacher", "teacher", "--tokenizer_name", str(TOKENIZER_DIR), "--output", "emb"]
    argv += ["--shards", "a/{00000..00001}.tar::b/{00000..00001}.tar"]
    assert _embed(argv) == 0
    assert "4 shard(s) embedded, 0 already done" in capsys.readouterr().out
    assert len(list((tmp_path / "emb").glob("*.teacher.safetensors"))) == 4
    store = EmbeddingStore("emb", teacher_fingerprint("teacher"))
    for name in ("00000.tar", "00001.tar"):
        keys = [sample["__key__"] for sample in raw_samples(f"a/{name}")]
        assert keys == [sample["__key__"] for sample in raw_samples(f"b/{name}")]
        for key in keys:
            a_image, a_text = store.pair(f"a/{name}", key)
            b_image, b_text = store.pair(str(tmp_path / "b" / name), key)  # the same shard spelled absolutely
            assert not torch.allclose(a_image, b_image) and not torch.allclose(a_text, b_text)
    assert _embed(argv) == 0 and "0 shard(s) embedded, 4 already done" in capsys.readouterr().out
    # one shard named twice would be embedded into one sidecar twice
    assert _embed([*argv[:-1], "a/00000.tar::a/../a/00000.tar"]) == 2
    err = capsys.readouterr().err
    assert "names the shard a/00000.tar twice" in err and len(err.splitlines()) == 1


def test_a_missing_relative_teacher_folder_is_one_line(tmp_path, capsys, monkeypatch, no_model):
    """D6: two tracebacks ending in LocalEntryNotFoundError."""
    monkeypatch.chdir(tmp_path)
    write_shards(tmp_path / "data", num_shards=1, per_shard=2)
    for teacher, said in (("teacher", "no such folder, nor a model on the hub"), ("./teacher", "no such folder")):
        assert _embed(["--teacher", teacher, "--shards", "data"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"disco-clip data embed: --teacher {teacher}: {said}") and len(err.splitlines()) == 1


def test_a_siglip2_teacher_is_refused_in_one_line(tmp_path, capsys, no_model):
    """D5: AttributeError: 'Siglip2VisionConfig' object has no attribute 'image_size'."""
    from disco_clip_ds.models.build import load_config

    load_config(model_config="recipes/models/siglip2_tiny.json").save_pretrained(tmp_path / "siglip2")
    write_shards(tmp_path / "data", num_shards=1, per_shard=2)
    assert _embed(["--teacher", str(tmp_path / "siglip2"), "--shards", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "a SigLIP 2 model, whose NaFlex image input has no one image size" in err and len(err.splitlines()) == 1
