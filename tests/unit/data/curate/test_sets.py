"""The images of a `--dedup_against` / `--target` folder (data/curate/sets.py): training shards (`DIR/*.tar`) and a
CLIP_benchmark wds set (`DIR/test/*.tar`, webp + cls), read through the one tar reader; a folder with neither, and a
sample without an image, refused in one line."""

from __future__ import annotations

import pytest

from disco_clip_ds.data.curate.sets import image_samples, set_shards
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.testing.images import image_bytes, write_samples, write_shards


def test_training_shards_give_every_sample_in_shard_order(tmp_path):
    write_shards(tmp_path, num_shards=2, per_shard=3, bad={4: "rgba"})
    samples = list(image_samples(str(tmp_path)))
    assert [key for key, _ in samples] == [f"{i // 3:05d}{i:04d}" for i in range(6)]
    assert samples[0][1][:2] == b"\xff\xd8" and samples[4][1][:4] == b"\x89PNG"  # jpg, and the png sample's png


def test_clip_benchmark_set_reads_its_test_split(tmp_path):
    webps = [image_bytes("WEBP", color=(i, 0, 0)) for i in range(3)]
    write_samples(tmp_path / "test", [{"webp": w, "cls": str(i).encode()} for i, w in enumerate(webps)], per_shard=2)
    write_samples(tmp_path / "train", [{"webp": image_bytes("WEBP"), "cls": b"0"}], per_shard=2)  # not read
    (tmp_path / "classnames.txt").write_text("a\nb\nc\n")
    assert len(set_shards(str(tmp_path))) == 2
    assert list(image_samples(str(tmp_path))) == [(f"s{i:05d}", w) for i, w in enumerate(webps)]


@pytest.mark.parametrize("make", ["missing", "empty", "only_train_split"])
def test_a_folder_without_shards_is_one_line(tmp_path, make):
    folder = tmp_path / "set"
    if make != "missing":
        folder.mkdir()
    if make == "only_train_split":
        write_samples(folder / "train", [{"png": image_bytes("PNG"), "cls": b"0"}], per_shard=1)
    with pytest.raises(UsageError, match="set") as raised:
        list(image_samples(str(folder)))
    assert "\n" not in str(raised.value)


def test_a_sample_without_an_image_or_a_broken_shard_is_named(tmp_path):
    write_samples(tmp_path / "a", [{"png": image_bytes("PNG")}, {"cls": b"1"}], per_shard=2)
    with pytest.raises(DataError, match="s00001 has no image"):
        list(image_samples(str(tmp_path / "a")))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "00000.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(DataError, match="00000.tar: not a tar"):
        list(image_samples(str(tmp_path / "b")))
