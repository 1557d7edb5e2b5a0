"""data/streams/shards.py (with streams/base.py): disjoint reading per rank and worker, resampling each pass, bad
samples skipped and counted, a shard set without readable samples or with too few shards for the readers one line."""

import pytest
import torch

from disco_clip_ds.data.shards import epoch_order
from disco_clip_ds.data.streams.base import error_message
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.models.patch_dropout import PATCHES_KEY, stage_key
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


@pytest.mark.slow  # beyond the fast tier's time budget
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


@pytest.mark.slow  # the failed worker's DataLoader, once collected, waits torch's 5 s status interval to shut down
def test_shard_set_without_readable_samples_raises_one_line_from_a_worker(tmp_path):
    """In a DataLoader worker torch re-raises the error with the worker's traceback as the message: the one line is
    recovered from it."""
    bad = tmp_path / "00000.tar"
    bad.write_bytes(b"not a tar file at all" * 10)
    with pytest.raises(DataError) as raised:
        _keys_seen(ShardStream([str(bad)], 16, shuffle_buffer=4, num_workers=1), 1, workers=1)
    assert "Traceback" in str(raised.value)
    assert error_message(raised.value).startswith("reader 0 of 1 (rank 0, DataLoader worker 0) found no readable")
    assert "\n" not in error_message(raised.value) and f"{tmp_path.name}/00000.tar" in error_message(raised.value)


def test_too_few_shards_for_the_readers_is_a_clear_error(tmp_path):
    urls = write_shards(tmp_path, num_shards=1, per_shard=2)
    with pytest.raises(ValueError, match="each reader needs at least one shard"):
        ShardStream(urls, 16, rank=0, world_size=2)
    urls = write_shards(tmp_path, num_shards=3, per_shard=2)
    ShardStream(urls, 16, rank=0, world_size=1, num_workers=3)
    with pytest.raises(ValueError, match="lower --dataloader_num_workers"):
        ShardStream(urls, 16, rank=0, world_size=1, num_workers=4)


def test_a_stream_state_is_one_schema_and_an_old_one_still_resumes(tmp_path):
    """stream_state.json of a shard stream: its facts, its field names and each reader's {field: value}, written and
    read by streams/state.py (the schema a datasets stream writes too); a file written before the one schema (each
    reader a whole row) gives the same positions."""
    import json

    from disco_clip_ds.data.streams.state import POSITION_FIELDS, read_stream_state

    urls = write_shards(tmp_path / "shards", num_shards=2, per_shard=2, seed=0)
    stream = ShardStream(urls, 16, world_size=2, seed=3, shuffle_buffer=8)
    rows = torch.tensor([[0, 9, 2, 1, 0, 4, 1], [1, 7, 0, 0, 1, 0, 5], [-1] * 7])
    stream.write_state(tmp_path, rows)
    state = read_stream_state(tmp_path)
    assert state == {
        "num_readers": 2,
        "seed": 3,
        "shuffle_buffer": 8,
        "fields": list(POSITION_FIELDS),
        "readers": {
            "0": dict(zip(POSITION_FIELDS[1:], [9, 2, 1, 0, 4, 1])),
            "1": dict(zip(POSITION_FIELDS[1:], [7, 0, 0, 1, 0, 5])),
        },
    }
    expected = {0: (9, 2, 1, 0, 4, 1), 1: (7, 0, 0, 1, 0, 5)}
    assert stream.positions_from(state, tmp_path) == expected
    # before the one schema (each reader a whole row) and before the readers' skips were kept (counted from 0)
    old = {k: v for k, v in state.items() if k != "fields"}
    old["readers"] = {"0": [0, 9, 1, 0, 4, 1], "1": [1, 7, 0, 1, 0, 5]}
    assert stream.positions_from(json.loads(json.dumps(old)), tmp_path) == {
        0: (9, 0, 1, 0, 4, 1),
        1: (7, 0, 0, 1, 0, 5),
    }
    with pytest.raises(UsageError, match="saved reading the data differently .seed 3 -> 4.*--ignore_data_skip"):
        ShardStream(urls, 16, world_size=2, seed=4, shuffle_buffer=8).positions_from(state, tmp_path)


def test_a_skipped_shard_read_through_a_command_is_logged_without_the_command(tmp_path, caplog):
    """A gated shard that cannot be read: the skip line names the source as the model card would, never the `pipe:`
    command and its credential (data/redact.py)."""
    token = "hf_" + "aBcD3fGh1jKlMn0pQrStUvWxYz0123456"  # split so that no scanner flags this file
    urls = write_shards(tmp_path, num_shards=1, per_shard=4)
    urls.append(f"pipe:curl -s -f -H 'Authorization: Bearer {token}' file://{tmp_path}/gone/00001.tar")
    with caplog.at_level("WARNING", logger="disco_clip_ds"):
        assert len(_keys_seen(ShardStream(urls, 16, shuffle_buffer=0, seed=3), 5)) == 5  # past a whole pass
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping unreadable shard")]
    assert skipped and all(
        line.startswith("skipping unreadable shard or tar member in pipe: gone/00001.tar") for line in skipped
    ), skipped
    assert not any(token in r.getMessage() or "curl" in r.getMessage() for r in caplog.records)


def _masks_seen(stream: ShardStream, n: int, workers: int = 0) -> dict:
    """{(caption, pixel sum): kept patches} of the first N samples (under a schedule: {batch key: kept patches})."""
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    seen = {}
    for pixels, caption, keep, _ in loader:
        seen[(caption, int(pixels.sum()))] = (
            {k: tuple(v.tolist()) for k, v in keep.items()} if isinstance(keep, dict) else keep.tolist()
        )
        if len(seen) == n:
            break
    return seen


@pytest.mark.slow  # beyond the fast tier's time budget
# (): the tower's grid alone (16 patches); a resolution schedule's earlier grids of 1 and 4 patches
@pytest.mark.parametrize("stages", [(), ((1, 1), (4, 2))])
def test_a_samples_kept_patches_are_its_own_on_any_rank_or_worker_and_crops_stay_as_without(tmp_path, stages):
    """Patch dropout's mask is drawn from (seed, pass, sample key): one reader and 2 ranks x 2 workers give each
    sample the same mask (and the same crop as a stream without patch dropout), under a schedule the same mask of
    every grid; another seed draws other masks."""
    urls = write_shards(tmp_path, num_shards=4, per_shard=5)
    options = {"shuffle_buffer": 0, "patches": (16, 8), "stage_patches": stages}
    alone = _masks_seen(ShardStream(urls, 16, seed=1, **options), 20)
    spread = {}
    for rank in range(2):
        stream = ShardStream(urls, 16, seed=1, rank=rank, world_size=2, **options)
        spread.update(_masks_seen(stream, 10, workers=2))
    assert len(alone) == 20 and spread == alone
    last = [keep[PATCHES_KEY] if stages else keep for keep in alone.values()]
    assert all(len(keep) == 8 == len(set(keep)) for keep in last)
    assert len({tuple(keep) for keep in last}) > 10  # masks differ between samples
    if stages:  # each earlier grid's: its count, within its grid; the last grid's as a run without a schedule draws
        for n, kept in stages:
            masks = [keep[stage_key(n)] for keep in alone.values()]
            assert all(len(keep) == kept == len(set(keep)) and max(keep) < n for keep in masks)
        without = _masks_seen(ShardStream(urls, 16, seed=1, shuffle_buffer=0, patches=(16, 8)), 20)
        assert [list(keep) for keep in last] == list(without.values())
    plain = _keys_seen(ShardStream(urls, 16, seed=1, shuffle_buffer=0), 20)
    assert {(caption, int(total)) for caption, total in plain} == set(alone)
    other = _masks_seen(ShardStream(urls, 16, seed=2, **options), 20)
    assert list(other.values()) != list(alone.values())
