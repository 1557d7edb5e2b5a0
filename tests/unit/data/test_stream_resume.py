"""A restored stream continues where it stood: each reader restarts at its saved (pass, shard, sample, block offset)
and decodes only what it still has to yield, checked against references that do not share its logic: webdataset's
own tar reader for the raw samples of a shard, and an uninterrupted stream (or DataLoader) for what a restored one
yields next, with bad samples, a missing shard, blocks that cross shards and passes that wrap. (Launched runs:
tests/launched/test_stream_resume_runs.py.)"""

from itertools import islice

import pytest
import torch
from transformers import AutoTokenizer

from disco_clip_ds.data.collate import POSITION_KEY, ClipCollator
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.streams.state import (
    POSITION_FIELDS,
    as_rows,
    note_positions,
    positions_to_restore,
    read_stream_state,
    skipped_samples,
    write_stream_state,
)
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import TOKENIZER_DIR

BAD = {1: "corrupt", 7: "no_text", 12: "empty_text", 13: "gray", 20: "corrupt"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """6 shards x 5 samples with bad ones, plus a shard that is missing: blocks of 4 cross shard boundaries."""
    root = tmp_path_factory.mktemp("stream")
    return write_shards(root, num_shards=6, per_shard=5, seed=2, bad=BAD) + [str(root / "missing.tar")]


def _identity(item) -> tuple:
    """A sample's caption and colour: write_shards draws flat images of random colours, which no crop changes."""
    pixels, caption, position = item
    return caption, tuple(round(float(c), 3) for c in pixels.double().mean(dim=(1, 2)))


def test_raw_samples_from_any_start_match_webdataset(shards):
    from webdataset.tariterators import tarfile_samples

    for url in shards[:3]:
        reference = [{k: v for k, v in s.items() if k != "__local_path__"} for s in tarfile_samples([{"url": url}])]
        assert len(reference) == 5
        for start in range(len(reference) + 1):
            assert list(raw_samples(url, start)) == reference[start:], (url, start)


@pytest.mark.parametrize("block", [1, 4, 9])
def test_a_restored_stream_yields_what_the_uninterrupted_one_does_next(shards, block):
    # reader 0 of 2 (rank 0): 3 shards (3 bad samples) + the missing one, 12 good samples per pass; 40 = 3+ passes
    reference = list(islice(ShardStream(shards, 16, rank=0, world_size=2, seed=5, shuffle_buffer=block), 40))
    keys = [_identity(item) for item in reference]
    assert len(set(keys[:12])) == 12 and set(keys[12:24]) == set(keys[:12])  # each pass: every good sample once
    assert keys[:12] != keys[12:24] or block == 1  # a new order each pass (shards reordered, blocks reshuffled)
    for n in (1, 2, 3, 5, 11, 12, 13, 17, 30):
        position = reference[n - 1][2].tolist()
        assert position[0] == 0 and position[1] == n  # the reader, the samples it has yielded
        stream = ShardStream(shards, 16, rank=0, world_size=2, seed=5, shuffle_buffer=block)
        stream.restore({0: position[1:]}, consumed_batches=0)
        resumed = list(islice(stream, 10))
        assert [_identity(item) for item in resumed] == keys[n : n + 10], n
        assert [item[2].tolist() for item in resumed] == [item[2].tolist() for item in reference[n : n + 10]]
        assert stream.decoded.value == 10  # only what it yielded: nothing before the position is decoded


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_restored_dataloader_with_workers_continues_the_uninterrupted_batches(shards):
    """Two workers per rank hand out batches in turn; after c batches the next comes from worker c mod 2, so the
    fresh loader's worker 0 takes that worker's place. Positions are folded as the trainer folds them."""
    collate = ClipCollator(AutoTokenizer.from_pretrained(TOKENIZER_DIR), 8)

    def loader(stream):
        return torch.utils.data.DataLoader(stream, batch_size=3, num_workers=2, collate_fn=collate)

    def batches(stream, n):
        out = []
        for batch in loader(stream):
            out.append(batch)
            if len(out) == n:
                return out

    def make():
        return ShardStream(shards, 16, rank=0, world_size=2, seed=1, shuffle_buffer=4, num_workers=2)

    reference = batches(make(), 12)
    for consumed in (1, 2, 5):
        newest: dict = {}
        for batch in reference[:consumed]:
            note_positions(newest, batch[POSITION_KEY])
        assert sorted(newest) == [0, 1][: min(consumed, 2)]  # readers 0 and 1 of 4: rank 0's two workers
        stream = make()
        stream.restore({reader: row[1:] for reader, row in newest.items()}, consumed)
        resumed = batches(stream, 4)
        for got, want in zip(resumed, reference[consumed : consumed + 4]):
            assert torch.equal(got["pixel_values"], want["pixel_values"]), consumed
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(
                got[POSITION_KEY], want[POSITION_KEY]
            )


def test_positions_are_folded_per_reader_saved_and_checked(tmp_path):
    newest: dict = {}
    note_positions(newest, torch.tensor([[2, 5, 1, 0, 1, 0, 3], [2, 6, 1, 0, 1, 0, 4]]))
    note_positions(newest, torch.tensor([[0, 9, 2, 1, 0, 4, 1], [2, 4, 0, 0, 0, 4, 2]]))  # an older row of reader 2
    assert newest == {0: [0, 9, 2, 1, 0, 4, 1], 2: [2, 6, 1, 0, 1, 0, 4]}
    assert skipped_samples(newest) == 3  # each reader's skips at its newest position
    rows = torch.cat([as_rows(newest, 3), as_rows({2: [2, 7, 1, 0, 1, 0, 5]}, 3)])  # as gathered from two ranks
    assert rows.shape == (6, len(POSITION_FIELDS)) and (rows[:, 0] == -1).sum() == 3
    facts = {"num_readers": 4, "seed": 3, "shuffle_buffer": 8}
    write_stream_state(tmp_path, rows, facts, POSITION_FIELDS)
    state = read_stream_state(tmp_path)
    named = lambda row: dict(zip(POSITION_FIELDS[1:], row))  # noqa: E731
    assert state["readers"] == {"0": named([9, 2, 1, 0, 4, 1]), "2": named([7, 1, 0, 1, 0, 5])}
    restored = {0: (9, 2, 1, 0, 4, 1), 2: (7, 1, 0, 1, 0, 5)}
    assert positions_to_restore(state, facts, POSITION_FIELDS, tmp_path) == restored
    with pytest.raises(UsageError, match="saved reading the data differently .num_readers 4 -> 2.*--ignore_data_skip"):
        positions_to_restore(state, {**facts, "num_readers": 2}, POSITION_FIELDS, tmp_path)
    assert read_stream_state(tmp_path / "none") is None and read_stream_state(None) is None
    # saved before the readers' skips were kept: resumed, counting them from 0
    old = {**state, "fields": [f for f in POSITION_FIELDS if f != "skipped"]}
    old["readers"] = {r: {k: v for k, v in e.items() if k != "skipped"} for r, e in state["readers"].items()}
    assert positions_to_restore(old, facts, POSITION_FIELDS, tmp_path) == {0: (9, 0, 1, 0, 4, 1), 2: (7, 0, 0, 1, 0, 5)}


def test_a_weighted_run_resumed_without_its_weights_is_told_the_sources_and_weights_differ(tmp_path):
    """A mixture's state holds its sources and weights (and a position row per source): resumed as a plain stream,
    the refusal names them, not the rows' fields."""
    facts = {"num_readers": 2, "seed": 0, "shuffle_buffer": 8}
    mixed = {**facts, "sources": ["a", "b"], "weights": [0.75, 0.25]}
    write_stream_state(tmp_path, as_rows({0: [0, 3, 0, 0, 0, 1, 0, 0, 0, 2]}, 1, 10), mixed, POSITION_FIELDS)
    with pytest.raises(UsageError) as refused:
        positions_to_restore(read_stream_state(tmp_path), facts, POSITION_FIELDS, tmp_path)
    message = str(refused.value)
    assert "sources ['a', 'b'] -> none, weights [0.75, 0.25] -> none" in message, message
    assert "has fields" not in message
