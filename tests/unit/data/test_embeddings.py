"""A teacher's embeddings stored once per shard (`disco-clip data embed`, data/embeddings.py) and read in training
(`--teacher_embeddings`): the same embeddings and loss as the live teacher on the same inputs, resumable writing,
and a clear error for a missing, altered or foreign embedding."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from disco_clip_ds.data.collate import ClipCollator
from disco_clip_ds.data.embeddings import (
    EmbeddingStore,
    check_sidecars,
    read_sidecar,
    shard_facts,
    sidecar_path,
    write_sidecar,
)
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import TINY_CONFIG, TOKENIZER_DIR


def test_sidecar_round_trip_and_checksum(tmp_path):
    path = tmp_path / "00000.teacher.safetensors"
    image, text = F.normalize(torch.randn(3, 4), dim=1), F.normalize(torch.randn(3, 4), dim=1)
    write_sidecar(path, ["a", "b", "c"], image, text, {"teacher": "t1"})
    rows, got_image, got_text, meta = read_sidecar(path)
    assert rows == {"a": 0, "b": 1, "c": 2} and meta["teacher"] == "t1"
    assert torch.equal(got_image, image) and torch.equal(got_text, text)
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"  # the last float of "text" altered: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum does not match"):
        read_sidecar(path)


def test_store_errors_name_the_shard_and_the_key(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    for name in ("00000.tar", "00001.tar"):
        (shards / name).write_bytes(b"x" * 10)
    first, second = str(shards / "00000.tar"), str(shards / "00001.tar")
    meta = {"teacher": "t1", **shard_facts(first)}
    write_sidecar(sidecar_path(tmp_path, first), ["k0"], torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), meta)
    store = EmbeddingStore(tmp_path, "t1")
    assert store.pair(first, "k0")[0].shape == (2,)
    with pytest.raises(DataError, match="sample k9 of shard data/00000.tar"):
        store.lookup(first, "k9")
    with pytest.raises(DataError, match="no teacher embeddings for shard data/00001.tar \\(sample k0\\)"):
        store.lookup(second, "k0")
    with pytest.raises(DataError, match="made by another teacher"):
        EmbeddingStore(tmp_path, "t2").lookup(first, "k0")
    (shards / "00000.tar").write_bytes(b"x" * 11)  # the shard written again after its embeddings
    with pytest.raises(DataError, match="made for data/00000.tar when it held 10 bytes; it now holds 11"):
        EmbeddingStore(tmp_path, "t1").lookup(first, "k0")


def test_shards_of_one_name_in_two_sources_get_two_sidecars_and_a_foreign_one_is_refused(tmp_path):
    """D3: sidecars were named by the shard's file name alone, so a/00000.tar and b/00000.tar shared one, and training
    read a's embeddings for b's samples (same keys, other captions) without a word."""
    urls = {src: str(tmp_path / src / "00000.tar") for src in "ab"}
    for url in urls.values():
        Path(url).parent.mkdir()
        Path(url).write_bytes(b"tar")
    paths = {src: sidecar_path(tmp_path / "emb", url) for src, url in urls.items()}
    assert paths["a"] != paths["b"] and paths["a"].parent == paths["b"].parent == tmp_path / "emb"
    assert sidecar_path(tmp_path / "emb", "a/../a/00000.tar") == sidecar_path(tmp_path / "emb", "a/00000.tar")
    # a's sidecar put where b's belongs (renamed or copied): the recorded shard is checked on read
    meta = {"teacher": "t1", **shard_facts(urls["a"])}
    write_sidecar(paths["b"], ["k0"], torch.ones(1, 2), torch.ones(1, 2), meta)
    with pytest.raises(DataError, match="made for shard a/00000.tar, not b/00000.tar"):
        EmbeddingStore(tmp_path / "emb", "t1").lookup(urls["b"], "k0")
    with pytest.raises(UsageError, match="00000.[0-9a-f]{12}.teacher.safetensors was made for shard a/00000.tar"):
        check_sidecars(tmp_path / "emb", [urls["b"]], "t1", "T")
    with pytest.raises(UsageError, match="no embeddings of shard a/00000.tar"):
        check_sidecars(tmp_path / "emb", [urls["a"]], "t1", "T")


@pytest.mark.slow  # builds a model and embeds 48 samples (~3 s)
def test_stored_embeddings_give_the_live_teachers_loss(tmp_path):
    """The live teacher and its stored embeddings on the same samples (the stream's center crops, in stream order,
    as the collator batches them with each sample's shard and key): the same embeddings, multiplier and mixed loss."""
    from transformers import AutoTokenizer

    from disco_clip_ds.data.embeddings import EmbeddingStore
    from disco_clip_ds.data.prep.embed import embed_shards
    from disco_clip_ds.data.streams.reinforced import Reinforcement
    from disco_clip_ds.data.streams.shards import ShardStream
    from disco_clip_ds.data.teacher_id import teacher_fingerprint
    from disco_clip_ds.models.build import build_model
    from disco_clip_ds.train.distill import Teacher, load_teacher, split_inputs, stored_teacher

    urls = write_shards(tmp_path / "data", num_shards=2, per_shard=24, seed=1)
    torch.manual_seed(4)
    build_model(model_config=str(TINY_CONFIG)).save_pretrained(tmp_path / "teacher")
    teacher_dir = str(tmp_path / "teacher")
    summary = embed_shards(teacher_dir, urls, str(tmp_path / "emb"), batch_size=10, tokenizer_name=str(TOKENIZER_DIR))
    assert len(summary["embedded"]) == 2 and summary["skipped"] == 0
    again = embed_shards(teacher_dir, urls, str(tmp_path / "emb"), tokenizer_name=str(TOKENIZER_DIR))
    assert again["embedded"] == [] and len(again["kept"]) == 2  # resumable: verified sidecars are kept

    live = load_teacher(teacher_dir, 0.5, None)
    store = EmbeddingStore(str(tmp_path / "emb"), teacher_fingerprint(teacher_dir), shards=urls)
    stored, extra = stored_teacher([teacher_dir], store, 0.5, None)
    assert extra.stored and store.augmentations == 0 and store.caption_keys == ["txt"]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    # no pool: the stream's own (here centre) crop, and each sample's stored row 0 and real caption as its targets
    stream = ShardStream(urls, 64, train=False, shuffle_buffer=0, reinforcement=Reinforcement(store, 1, pool=False))
    items = [item for _, item in zip(range(32), stream)]
    plain = ClipCollator(tokenizer, 32)([(*item[:2], item[3]) for item in items])
    with_targets = ClipCollator(tokenizer, 32, teacher=extra)(items)
    assert torch.equal(plain["pixel_values"], with_targets["pixel_values"])
    live_out, (images, texts, params) = live.embed(split_inputs(plain)[1]), stored.embed(split_inputs(with_targets)[1])
    stored_out = (images[0], texts[0], (params[0][0],))  # the one teacher of the ensemble
    torch.testing.assert_close(stored_out[0], live_out[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stored_out[1], live_out[1], rtol=1e-5, atol=1e-6)
    assert stored_out[2][0].item() == pytest.approx(live_out[2][0].item())

    g = torch.Generator().manual_seed(0)
    x, y = (F.normalize(torch.randn(32, 8, generator=g), dim=1) for _ in "xy")
    values = [t.loss_fn(*out)(x, y, torch.tensor(20.0)) for t, out in ((live, live_out), (stored, stored_out))]
    assert values[1].item() == pytest.approx(values[0].item(), rel=1e-5)
    assert isinstance(live, Teacher) and json.loads((tmp_path / "data" / "sizes.json").read_text())
    assert sidecar_path(tmp_path / "emb", urls[0]).is_file()
