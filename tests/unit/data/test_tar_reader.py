"""The one shard reader (data/streams/tar_samples.py) under training's stream, `disco-clip data verify` and eval: one
count (webdataset's, keys split at the first dot of a member's base name), one truncation check (a cut at a member
boundary included, which tarfile and webdataset read as a shorter, valid tar), a missing shard of a pattern (training
skips it, eval refuses it saying why), and no shard source shown with its credential (D1)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from disco_clip_ds.commands.data import embed_main
from disco_clip_ds.data.embeddings import EmbeddingStore, check_sidecars
from disco_clip_ds.data.prep.verify import verify
from disco_clip_ds.data.shards import count_samples, expand_shards
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.eval.sources import check_eval_shards, resolve_shards, shard_batches
from disco_clip_ds.testing.images import image_bytes, write_shards

SECRET = "SECRET123"


def _tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _stream(urls: list[str], n: int) -> tuple[list, ShardStream]:
    """The first `n` items of a training stream over `urls` (no shuffle) and the stream, for its skip count."""
    stream = ShardStream(urls, 16, shuffle_buffer=0, train=False)
    return [item for _, item in zip(range(n), stream)], stream


def test_keys_with_dots_count_alike_in_verify_training_and_webdataset(tmp_path):
    """webdataset keys `v1.2.jpg` as sample `v1`, extension `2.jpg`, so `v1.2.*` and `v1.3.*` are one sample (and not
    one with an image): verify counted them as two (it split at the last dot), so sizes.json was wrong."""
    import webdataset as wds

    jpg = image_bytes("JPEG", "RGB", (8, 8), (1, 2, 3))
    members = [("x0.jpg", jpg), ("x0.txt", b"one")]
    members += [("v1.2.jpg", jpg), ("v1.2.txt", b"two"), ("v1.3.jpg", jpg), ("v1.3.txt", b"three")]
    members += [("d.v2/y.jpg", jpg), ("d.v2/y.txt", b"four"), ("__meta__", b"{}"), ("README", b"no extension")]
    _tar(tmp_path / "00000.tar", members)
    url = str(tmp_path / "00000.tar")

    wds_samples = list(wds.WebDataset(url, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in wds_samples] == ["x0", "v1", "d.v2/y"]
    assert [s["__key__"] for s in raw_samples(url)] == [s["__key__"] for s in wds_samples]
    report = verify(tmp_path)
    assert report["samples"] == len(wds_samples) == 3 and not report["broken"]
    assert json.loads((tmp_path / "sizes.json").read_text()) == {"00000.tar": 3}
    assert count_samples([url]) == 3  # what training counts its epochs by
    items, stream = _stream([url], 3)  # one pass and the first item of the next
    assert [caption for _, caption, _ in items] == ["one", "four", "one"]
    assert stream.skipped.value == 1  # v1: no .jpg (its extensions are 2.jpg, 3.jpg ...): 2 + 1 = 3 samples


@pytest.mark.parametrize("cut", ["member boundary", "member data", "end marker"])
def test_a_truncated_shard_is_found_by_every_reader(tmp_path, cut):
    import webdataset as wds

    (url,) = write_shards(tmp_path / "data", num_shards=1, per_shard=4)
    data = open(url, "rb").read()
    with tarfile.open(url) as tar:
        members = tar.getmembers()  # three per sample: jpg, json, txt
    end = members[-1].offset_data + members[-1].size
    at = {
        "member boundary": members[6].offset,  # where sample 2 starts
        "member data": members[6].offset_data + 5,
        "end marker": -(-end // 512) * 512 + 512,  # one zero block of the two
    }[cut]
    open(url, "wb").write(data[:at])
    if cut == "member boundary":  # what webdataset and tarfile make of it: a shorter, valid shard
        assert len(list(wds.WebDataset(url, shardshuffle=False, empty_check=False))) == 2

    read = []
    with pytest.raises(tarfile.TarError):
        for sample in raw_samples(url):
            read.append(sample["__key__"])
    assert len(read) == {"member boundary": 1, "member data": 2, "end marker": 3}[cut]
    # verify: broken, left out of sizes.json
    report = verify(tmp_path / "data")
    assert list(report["broken"]) == ["00000.tar"] and report["samples"] == 0
    assert json.loads((tmp_path / "data" / "sizes.json").read_text()) == {}  # write_shards had recorded 4
    # eval: refused before any model loads, naming the shard
    with pytest.raises(DataError, match="shard 'data/00000.tar' is truncated or not a tar"):
        check_eval_shards([url], "zeroshot_retrieval")
    # training: the samples before the damage stand, the shard is counted as skipped once per pass
    items, stream = _stream([url], len(read) + 1)
    assert len(items) == len(read) + 1 and stream.skipped.value == 1


def test_a_missing_shard_of_a_pattern_is_skipped_in_training_and_refused_by_eval_saying_why(tmp_path):
    write_shards(tmp_path / "data", num_shards=3, per_shard=2)
    (tmp_path / "data" / "00001.tar").unlink()
    spec = f"{tmp_path}/data/{{00000..00002}}.tar"
    items, stream = _stream(expand_shards(spec), 4)  # one pass: 2 shards x 2 samples
    assert len(items) == 4 and stream.skipped.value == 1
    with pytest.raises(UsageError) as refused:
        resolve_shards(spec)
    message = str(refused.value)
    assert message.startswith("1 of 3 shards not found, e.g. 'data/00001.tar': an evaluation reads every shard")
    assert "training skips missing shards, evaluation does not" in message


def test_no_message_naming_a_shard_source_shows_its_credential(tmp_path, capsys):
    """D1: `--train_shards "pipe:curl -s -H 'Authorization: Bearer SECRET123' file:///.../{00000..00007}.tar"` without
    --train_num_samples printed the token in "cannot count the samples of 8 shard(s), e.g. ..."."""
    write_shards(tmp_path / "data", num_shards=2, per_shard=2)
    spec = f"pipe:curl -s -f -H 'Authorization: Bearer {SECRET}' file://{tmp_path}/data/{{00000..00007}}.tar"
    urls = expand_shards(spec)
    messages = []

    def said(call, *args):
        with pytest.raises(Exception) as raised:
            result = call(*args)
            list(result) if hasattr(result, "__next__") else None
        messages.append(str(raised.value))

    said(count_samples, urls)
    said(lambda: _stream(urls[2:], 1))  # shards 2..7 do not exist: a whole pass without a sample
    said(lambda: list(shard_batches(urls[2:3], None, "txt", 2)))
    said(embed_main, ["--teacher", "t", "--shards", spec])
    said(EmbeddingStore(tmp_path, "t").lookup, urls[0], "k")
    said(check_sidecars, tmp_path, urls, "t", "t")
    assert len(messages) == 6 and all("pipe: data/0000" in message for message in messages), messages
    for message in messages:
        assert SECRET not in message and "Bearer" not in message and "curl" not in message, message
    assert SECRET not in capsys.readouterr().err


def test_members_left_unread_are_read_later_from_a_plain_shard_and_read_at_once_from_a_compressed_one(tmp_path):
    """`read` a set of extensions: those are read; in a plain local tar the others are `Member`s whose `read()` gives
    the member's bytes (eval reads an image where its batch is decoded), in a .tar.gz they are read at once (an
    offset in the decompressed stream is not one in the file)."""
    import gzip
    import shutil

    from disco_clip_ds.data.streams.tar_samples import Member

    members = [(f"s{i}.{ext}", f"{ext} {i}".encode() * (i + 1)) for i in range(3) for ext in ("jpg", "cls")]
    _tar(tmp_path / "0.tar", members)
    with open(tmp_path / "0.tar", "rb") as plain, gzip.open(tmp_path / "1.tar.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    whole = list(raw_samples(str(tmp_path / "0.tar")))
    left = list(raw_samples(str(tmp_path / "0.tar"), read=frozenset({"cls"})))
    assert [s["cls"] for s in left] == [s["cls"] for s in whole]
    assert all(isinstance(s["jpg"], Member) for s in left)
    assert [s["jpg"].read() for s in left] == [s["jpg"] for s in whole] == [data for n, data in members[::2]]
    assert list(raw_samples(str(tmp_path / "1.tar.gz"), read=frozenset({"cls"}))) == [
        {**s, "__url__": str(tmp_path / "1.tar.gz")} for s in whole
    ]
