"""data/streams/hf.py, a 🤗 datasets dataset as the training stream, map-style and streaming: readers read disjoint
rows that cover the dataset, list captions are drawn per pass, bad rows are skipped and counted, and a restored
stream yields what the uninterrupted one yields next."""

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from disco_clip_ds.data.hf_io import load_training_dataset
from disco_clip_ds.data.streams.hf import STATE_INTS, HFStream, pack_state, unpack_state
from disco_clip_ds.errors import DataError, UsageError

from unit.data.hfsets import (
    SIZE,
    check_rows,
    hf_args,
    hf_dataset,
    hf_png,
    hf_rows,
    hf_sample,
    one_pass,
    saved_dataset,
)


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("source", ["saved", "parquet", "saved-streaming", "parquet-streaming"])
def test_readers_read_disjoint_rows_that_together_are_the_dataset(folders, source):
    name, _, mode = source.partition("-")
    data = load_training_dataset(hf_args(dataset_name=str(folders / name), streaming=mode == "streaming"), 4)
    for readers in (2, 3, 4):  # as ranks x workers: reader r of N reads the same at any split of N
        ids = []
        for reader in range(readers):
            items = one_pass(HFStream(data, SIZE, rank=reader, world_size=readers, seed=3, shuffle_buffer=4))
            assert items and all(item[2][0] == reader for item in items)
            ids += [int(item[1].split()[1]) for item in items]
        assert sorted(ids) == list(range(23)), (source, readers)  # each row once: disjoint, and all of them


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("streaming", [False, True])
def test_dataloader_workers_are_the_readers_of_their_rank(folders, streaming):
    """Rank 1 of 2 with 2 DataLoader workers: its workers are readers 2 and 3 of 4 and read what those readers
    read in one process (datasets would split a stream again over the workers; ours is each worker's own part)."""
    data = load_training_dataset(hf_args(dataset_name=str(folders / "saved"), streaming=streaming), 4)
    alone = {r: one_pass(HFStream(data, SIZE, rank=r, world_size=4, seed=3, shuffle_buffer=4)) for r in (2, 3)}
    stream = HFStream(data, SIZE, rank=1, world_size=2, seed=3, shuffle_buffer=4, num_workers=2)
    got = {2: [], 3: []}
    for item in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2):
        if item[2][3] == 0:
            got[int(item[2][0])].append(item)
        if sum(len(v) for v in got.values()) == sum(len(v) for v in alone.values()):
            break
    for r in (2, 3):
        assert [hf_sample(i) for i in got[r]] == [hf_sample(i) for i in alone[r]], r
    assert stream.decoded.value >= 12 and stream.skipped.value == 0  # counted across the workers


def test_a_list_of_captions_gives_one_per_pass_drawn_from_seed_pass_and_row(tmp_path):
    import datasets

    rows = hf_rows(8)
    rows["caption"] = [[f"sample {i}", f"photo {i}", "", f"picture of {i}"] for i in range(8)]
    hf_dataset(rows, datasets.List(datasets.Value("string"))).save_to_disk(str(tmp_path / "lists"))
    options = lambda i: {f"sample {i}", f"photo {i}", f"picture of {i}"}  # noqa: E731 (the empty one never)
    data = load_training_dataset(hf_args(dataset_name=str(tmp_path / "lists")), 1)
    check_rows(data, 8, options)
    passes = [item[1] for item in itertools.islice(HFStream(data, SIZE, seed=1, shuffle_buffer=0), 24)]
    again = [item[1] for item in itertools.islice(HFStream(data, SIZE, seed=1, shuffle_buffer=0), 24)]
    assert passes == again  # deterministic
    drawn = {c for c in passes if c.endswith(" 0")}
    assert len(drawn) >= 2 and drawn <= options(0)  # drawn anew each pass


def test_corrupt_missing_and_uncaptioned_rows_are_skipped_and_counted(tmp_path):
    bad = {1: "corrupt", 4: "none", 6: "empty"}
    data = load_training_dataset(hf_args(dataset_name=str(saved_dataset(tmp_path, hf_rows(10, bad)))), 1)
    for streaming in (False, True):
        if streaming:
            data = load_training_dataset(hf_args(dataset_name=str(tmp_path / "ds"), streaming=True), 1)
        stream = HFStream(data, SIZE, seed=1, shuffle_buffer=3)
        items = one_pass(stream)
        assert sorted(int(item[1].split()[1]) for item in items) == [0, 2, 3, 5, 7, 8, 9]
        assert stream.skipped.value == 3 and stream.decoded.value == 7 + 1  # and the next pass's first
    paths = [{"file": str(tmp_path / f"{i}.png"), "caption": f"sample {i}"} for i in range(4)]
    for i in (0, 2, 3):
        (tmp_path / f"{i}.png").write_bytes(hf_png(i))  # 1.png is missing
    (tmp_path / "3.png").write_bytes(b"not a png")
    (tmp_path / "paths.jsonl").write_text("\n".join(json.dumps(p) for p in paths))
    stream = HFStream(
        load_training_dataset(hf_args(train_file=str(tmp_path / "paths.jsonl"), image_column="file"), 1), SIZE
    )
    assert [item[1] for item in one_pass(stream)] != [] and stream.skipped.value == 2


@pytest.mark.parametrize("streaming", [False, True])
def test_a_reader_with_nothing_readable_raises_one_data_error(tmp_path, streaming):
    rows = hf_rows(4, {1: "corrupt", 3: "none"})  # reader 1 of 2 reads rows 1 and 3 (map-style), or shard 1
    data = load_training_dataset(hf_args(dataset_name=str(saved_dataset(tmp_path, rows)), streaming=streaming), 2)
    if streaming:  # shard 1 of 2 holds rows 2 and 3: make both bad
        rows = hf_rows(4, {2: "empty", 3: "none"})
        shutil.rmtree(tmp_path / "ds")
        data = load_training_dataset(hf_args(dataset_name=str(saved_dataset(tmp_path, rows)), streaming=True), 2)
    with pytest.raises(DataError, match=r"^reader 1 of 2 \(rank 1, DataLoader worker 0\) found no readable sample"):
        list(itertools.islice(HFStream(data, SIZE, rank=1, world_size=2), 5))
    assert len(list(itertools.islice(HFStream(data, SIZE, rank=0, world_size=2), 5))) == 5  # the other reader is fine


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("source", ["saved", "saved-streaming", "parquet-streaming"])
@pytest.mark.parametrize("block", [1, 4, 9])
def test_a_restored_datasets_stream_yields_what_the_uninterrupted_one_does_next(folders, source, block):
    """Reader 0 of 2 (11 or 12 rows per pass; 40 = 3+ passes); the restore goes through stream_state.json."""
    name, _, mode = source.partition("-")
    data = load_training_dataset(hf_args(dataset_name=str(folders / name), streaming=mode == "streaming"), 2)

    def make():
        return HFStream(data, SIZE, rank=0, world_size=2, seed=5, shuffle_buffer=block)

    reference = list(itertools.islice(make(), 45))
    keys = [hf_sample(item) for item in reference]
    per_pass = sum(1 for item in reference if item[2][3] == 0)
    assert len(set(keys[:per_pass])) == per_pass and set(keys[per_pass : 2 * per_pass]) == set(keys[:per_pass])
    fields = 5 if data.streaming else 4  # past them, the state_dict: datasets may spell one place two ways

    def restored(rows: list, n: int, tag: str) -> HFStream:
        folder = Path(data.base_dir).parent / f"state-{source}-{block}-{n}-{tag}"
        folder.mkdir(exist_ok=True)
        make().write_state(folder, torch.stack(rows))
        stream = make()
        stream.restore(stream.positions_from(json.loads((folder / "stream_state.json").read_text()), folder), 0)
        return stream

    for n in (1, 3, 5, 11, 12, 13, 17, 30):
        stream = restored([item[2] for item in reference[:n]], n, "a")
        resumed = list(itertools.islice(stream, 10))
        assert [hf_sample(item) for item in resumed] == keys[n : n + 10], n
        positions = [item[2][:fields].tolist() for item in resumed]
        assert positions == [item[2][:fields].tolist() for item in reference[n : n + 10]]
        assert stream.decoded.value == 10  # nothing before the position is decoded again
        # a resumed run's own positions resume it again
        again = list(itertools.islice(restored([resumed[-1][2]], n, "b"), 5))
        assert [hf_sample(item) for item in again] == keys[n + 10 : n + 15], n


@pytest.mark.slow  # beyond the fast tier's time budget
@pytest.mark.parametrize("streaming", [False, True])
def test_a_restored_datasets_dataloader_with_workers_continues_the_uninterrupted_batches(folders, streaming, tmp_path):
    """Rank 0 of 2 with two workers, as the trainer folds and saves positions: after c batches the next comes from
    worker c mod 2, so the fresh loader's worker 0 takes that worker's place."""
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import POSITION_KEY, ClipCollator
    from disco_clip_ds.data.streams.state import as_rows, note_positions
    from disco_clip_ds.testing.launch import TOKENIZER_DIR

    data = load_training_dataset(hf_args(dataset_name=str(folders / "parquet"), streaming=streaming), 4)
    collate = ClipCollator(AutoTokenizer.from_pretrained(TOKENIZER_DIR), 8)

    def make():
        return HFStream(data, SIZE, rank=0, world_size=2, seed=1, shuffle_buffer=4, num_workers=2)

    def batches(stream, n):
        loader = torch.utils.data.DataLoader(stream, batch_size=3, num_workers=2, collate_fn=collate)
        return list(itertools.islice(loader, n))

    reference = batches(make(), 10)
    for consumed in (1, 2, 5):
        newest: dict = {}
        for batch in reference[:consumed]:
            note_positions(newest, batch[POSITION_KEY])
        stream = make()
        stream.write_state(tmp_path, as_rows(newest, 2, len(stream.position_fields)))
        stream.restore(
            stream.positions_from(json.loads((tmp_path / "stream_state.json").read_text()), tmp_path), consumed
        )
        for got, want in zip(batches(stream, 4), reference[consumed : consumed + 4], strict=True):
            assert torch.equal(got["pixel_values"], want["pixel_values"]), consumed
            assert torch.equal(got["input_ids"], want["input_ids"]), consumed


def test_a_saved_state_is_readable_and_refused_under_other_readers(folders, tmp_path):
    data = load_training_dataset(hf_args(dataset_name=str(folders / "parquet"), streaming=True), 2)
    reference = list(itertools.islice(HFStream(data, SIZE, rank=0, world_size=2, seed=5, shuffle_buffer=4), 6))
    HFStream(data, SIZE, rank=0, world_size=2, seed=5, shuffle_buffer=4).write_state(tmp_path, reference[5][2][None])
    state = json.loads((tmp_path / "stream_state.json").read_text())
    entry = state["readers"]["0"]
    assert (entry["count"], entry["epoch"], entry["block"], entry["offset"]) == (6, 0, 1, 2)
    assert entry["state_dict"]["epoch"] == 0 and "examples_iterable" in entry["state_dict"]  # datasets' own
    assert unpack_state(pack_state(entry["state_dict"])) == entry["state_dict"] and len(pack_state(None)) == STATE_INTS
    with pytest.raises(DataError, match=r"^the dataset's state_dict takes 1\d\d\d bytes of JSON, more than the 1024"):
        pack_state({"sources": list(range(300))})  # e.g. a mix of many streams
    other = HFStream(data, SIZE, rank=0, world_size=3, seed=5, shuffle_buffer=4)
    with pytest.raises(UsageError, match="saved reading the data differently .num_readers 2 -> 3.*--ignore_data_skip"):
        other.positions_from(state, tmp_path)
