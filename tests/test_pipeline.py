"""Training stream: decode/augment/tokenize, disjoint reading per rank and worker, resampling, bad samples."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from disco_clip_ds.data.shards import epoch_order
from disco_clip_ds.data.collate import ClipCollator
from disco_clip_ds.data.streams.base import error_message
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.transforms import ImageTransform, to_rgb
from disco_clip_ds.errors import DataError
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import TOKENIZER_DIR

TOKENIZER = TOKENIZER_DIR


def _keys_seen(stream: ShardStream, n: int, workers: int = 0) -> list[tuple]:
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    out = []
    for pixels, caption, _ in loader:
        out.append((caption, round(float(pixels.sum()), 2)))
        if len(out) == n:
            return out
    return out


def test_to_rgb_converts_gray_and_composites_alpha_on_white():
    assert to_rgb(Image.new("L", (4, 4), 7)).getpixel((0, 0)) == (7, 7, 7)
    assert to_rgb(Image.new("RGBA", (4, 4), (10, 20, 30, 0))).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("RGBA", (4, 4), (10, 20, 30, 255))).getpixel((0, 0)) == (10, 20, 30)


def test_transform_normalises_with_clip_mean_std():
    image = Image.new("RGB", (50, 70), (255, 0, 128))
    for train in (True, False):
        x = ImageTransform(32, train=train)(image, random.Random(0))
        assert x.shape == (3, 32, 32)
        expected = (
            torch.tensor([1.0, 0.0, 128 / 255]) - torch.tensor([0.48145466, 0.4578275, 0.40821073])
        ) / torch.tensor([0.26862954, 0.26130258, 0.27577711])
        torch.testing.assert_close(x[:, 16, 16], expected, atol=2e-3, rtol=0)


def test_random_crop_depends_on_the_rng_only():
    gradient = Image.fromarray(np.tile(np.arange(100, dtype=np.uint8), (80, 1)))
    t = ImageTransform(16, train=True)
    a, b = t(gradient, random.Random("k1")), t(gradient, random.Random("k1"))
    assert torch.equal(a, b)
    assert any(not torch.equal(a, t(gradient, random.Random(f"k{i}"))) for i in range(2, 6))


def test_collator_pads_to_max_length_with_eos_and_no_labels():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    batch = ClipCollator(tokenizer, max_length=12)(
        [(torch.zeros(3, 8, 8), "a photo of the digit seven"), (torch.ones(3, 8, 8), "seven")]
    )
    assert set(batch) == {"pixel_values", "input_ids", "attention_mask"}
    assert batch["input_ids"].shape == (2, 12) and batch["pixel_values"].shape == (2, 3, 8, 8)
    ids = batch["input_ids"][1].tolist()
    assert ids[0] == tokenizer.bos_token_id and ids[2] == tokenizer.eos_token_id
    assert batch["attention_mask"][1].tolist() == [1, 1, 1] + [0] * 9
    long = ClipCollator(tokenizer, max_length=5)([(torch.zeros(3, 8, 8), "a photo of the digit seven eight nine")])
    assert long["input_ids"][0, -1] == tokenizer.eos_token_id  # truncation keeps the end token CLIP pools at


def test_ranks_and_workers_read_disjoint_shards_and_resample(tmp_path):
    urls = write_shards(tmp_path, num_shards=4, per_shard=5)
    per_rank = [
        _keys_seen(ShardStream(urls, 16, rank=r, world_size=2, shuffle_buffer=0), 20, workers=2) for r in range(2)
    ]
    one_pass = [set(seen[:10]) for seen in per_rank]  # each rank owns 2 shards = 10 samples per pass
    assert all(len(s) == 10 for s in one_pass)
    assert not one_pass[0] & one_pass[1]
    captions = {c for s in one_pass for c, _ in s}
    assert len(captions) == 10  # every digit appears: all 20 samples read across the two ranks
    # the second pass revisits the same samples (new crops, same captions): the stream does not run dry
    assert {c for c, _ in per_rank[0][10:]} == {c for c, _ in per_rank[0][:10]}


def test_bad_samples_are_skipped_and_counted(tmp_path):
    urls = write_shards(tmp_path, num_shards=2, per_shard=6, bad={1: "corrupt", 2: "no_text", 3: "gray", 4: "rgba"})
    urls.append(str(tmp_path / "missing.tar"))
    stream = ShardStream(urls, 16, shuffle_buffer=0, seed=3)
    seen = _keys_seen(stream, 11)  # a full pass (10 good of 12 samples) and the first sample of the next
    assert len(seen) == 11
    # the corrupt image, the sample without text and the missing shard; plus the missing shard once more if
    # the second pass happens to open it before its first good sample
    second_pass_starts_with_missing = epoch_order(urls, seed=3, epoch=1, reader=0)[0].endswith("missing.tar")
    assert stream.skipped.value == 3 + second_pass_starts_with_missing


def test_empty_captions_and_oversized_images_are_skipped_and_counted(tmp_path):
    urls = write_shards(tmp_path, num_shards=1, per_shard=6, bad={1: "empty_text", 4: "large"})
    stream = ShardStream(urls, 16, shuffle_buffer=0, max_image_pixels=300 * 300)
    seen = _keys_seen(stream, 4)  # one pass: 4 of the 6 samples
    assert [caption for caption, _ in seen] == [f"a photo of the digit {d}" for d in ("zero", "two", "three", "five")]
    assert stream.skipped.value == 2
    everything = ShardStream(urls, 16, shuffle_buffer=0, max_image_pixels=400 * 400)  # the cap is inclusive
    assert len(_keys_seen(everything, 5)) == 5 and everything.skipped.value == 1


def test_shard_set_without_readable_samples_raises_one_line(tmp_path):
    bad = tmp_path / "00000.tar"
    bad.write_bytes(b"not a tar file at all" * 10)
    with pytest.raises(DataError, match=r"^reader 0 of 1 \(rank 0, DataLoader worker 0\) found no readable sample"):
        _keys_seen(ShardStream([str(bad)], 16, shuffle_buffer=0), 1)
    # in a DataLoader worker torch re-raises it with the worker's traceback as the message: the line is recovered
    with pytest.raises(DataError) as raised:
        _keys_seen(ShardStream([str(bad)], 16, shuffle_buffer=4, num_workers=1), 1, workers=1)
    assert "Traceback" in str(raised.value)
    assert error_message(raised.value).startswith("reader 0 of 1 (rank 0, DataLoader worker 0) found no readable")
    assert "\n" not in error_message(raised.value) and str(bad) in error_message(raised.value)


def test_too_few_shards_for_the_readers_is_a_clear_error(tmp_path):
    urls = write_shards(tmp_path, num_shards=1, per_shard=2)
    with pytest.raises(ValueError, match="each reader needs at least one shard"):
        ShardStream(urls, 16, rank=0, world_size=2)
    urls = write_shards(tmp_path, num_shards=3, per_shard=2)
    ShardStream(urls, 16, rank=0, world_size=1, num_workers=3)
    with pytest.raises(ValueError, match="lower --dataloader_num_workers"):
        ShardStream(urls, 16, rank=0, world_size=1, num_workers=4)
