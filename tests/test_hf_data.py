"""A 🤗 `datasets` dataset as the training source (data/hf.py): map-style and streaming.

Fast tests build small datasets on the spot (save_to_disk, parquet, imagefolder, csv/json files) of flat-colour images
whose colour and caption name the row, and check the stream against that: readers read disjoint rows that cover the
dataset, each column kind decodes to the row's own colour, bad rows are skipped and counted, a restored stream yields
what the uninterrupted one yields next, and each bad input is one line with exit code 2 before any training.
The launched tests (slow) train 2 ranks from a save_to_disk dataset and a streamed parquet folder, resume them from
a mid-run checkpoint to the uninterrupted run's losses and weights, and accumulate 1 rank x K=2 like 2 ranks x K=1.
"""

import itertools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disco_clip_ds.data.hf_io import load_training_dataset
from disco_clip_ds.data.streams.hf import STATE_INTS, HFStream, pack_state, unpack_state
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.testing.images import image_bytes
from disco_clip_ds.testing.launch import LAUNCH_COMMON, TINY_CONFIG

SIZE = 16


def _colour(i: int) -> tuple[int, int, int]:
    return (i * 37 % 256, i * 91 % 256, 200 - i)


def _png(i: int) -> bytes:
    return image_bytes("PNG", "RGB", (20 + i % 7, 18 + i % 5), _colour(i))


def _rows(n: int, bad: dict | None = None) -> dict:
    """n rows 'sample i' with image i; bad = {i: 'corrupt' (truncated bytes) | 'none' (no image) | 'empty' (blank
    caption)}."""
    bad = bad or {}
    images, captions = [], []
    for i in range(n):
        data = _png(i)
        images.append(
            None
            if bad.get(i) == "none"
            else {"bytes": data[: len(data) // 3] if bad.get(i) == "corrupt" else data, "path": None}
        )
        captions.append(" \t" if bad.get(i) == "empty" else f"sample {i}")
    return {"image": images, "caption": captions, "id": list(range(n))}


def _dataset(rows: dict, captions=None):
    import datasets

    caption = captions or datasets.Value("string")
    features = datasets.Features({"image": datasets.Image(), "caption": caption, "id": datasets.Value("int64")})
    return datasets.Dataset.from_dict(rows, features=features)


def _args(**kw) -> SimpleNamespace:
    base = {
        "dataset_name": None,
        "dataset_config_name": None,
        "train_split": "train",
        "train_file": None,
        "image_column": "image",
        "caption_column": "caption",
        "streaming": False,
    }
    return SimpleNamespace(**{**base, **kw})


def _sample(item) -> tuple[str, tuple[int, ...]]:
    """(caption, colour) of a yielded item: a flat image stays flat under any crop and resize."""
    pixels, caption, _ = item  # a uint8 crop (ClipCollator normalises)
    colour = pixels.float().mean(dim=(1, 2)).round().int()
    return caption, tuple(colour.tolist())


def _one_pass(stream: HFStream) -> list:
    """What a reader yields in its first pass (the pass field is position[2])."""
    out = []
    for item in stream:
        if item[2][2] > 0:
            return out
        out.append(item)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same 23 rows as a save_to_disk folder, a parquet folder of 3 files, and a DatasetDict folder."""
    import datasets

    root = tmp_path_factory.mktemp("hfdata")
    ds = _dataset(_rows(23))
    ds.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for k, part in enumerate(((0, 8), (8, 16), (16, 23))):
        ds.select(range(*part)).to_parquet(str(root / "parquet" / f"part-{k}.parquet"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(4))}).save_to_disk(str(root / "dict"))
    return root


# --- disjoint reads ---


@pytest.mark.parametrize("source", ["saved", "parquet", "saved-streaming", "parquet-streaming"])
def test_readers_read_disjoint_rows_that_together_are_the_dataset(folders, source):
    name, _, mode = source.partition("-")
    data = load_training_dataset(_args(dataset_name=str(folders / name), streaming=mode == "streaming"), 4)
    for readers in (2, 3, 4):  # as ranks x workers: reader r of N reads the same at any split of N
        ids = []
        for reader in range(readers):
            items = _one_pass(HFStream(data, SIZE, rank=reader, world_size=readers, seed=3, shuffle_buffer=4))
            assert items and all(item[2][0] == reader for item in items)
            ids += [int(item[1].split()[1]) for item in items]
        assert sorted(ids) == list(range(23)), (source, readers)  # each row once: disjoint, and all of them


@pytest.mark.parametrize("streaming", [False, True])
def test_dataloader_workers_are_the_readers_of_their_rank(folders, streaming):
    """Rank 1 of 2 with 2 DataLoader workers: its workers are readers 2 and 3 of 4 and read what those readers
    read in one process (datasets would split a stream again over the workers; ours is each worker's own part)."""
    data = load_training_dataset(_args(dataset_name=str(folders / "saved"), streaming=streaming), 4)
    alone = {r: _one_pass(HFStream(data, SIZE, rank=r, world_size=4, seed=3, shuffle_buffer=4)) for r in (2, 3)}
    stream = HFStream(data, SIZE, rank=1, world_size=2, seed=3, shuffle_buffer=4, num_workers=2)
    got = {2: [], 3: []}
    for item in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2):
        if item[2][2] == 0:
            got[int(item[2][0])].append(item)
        if sum(len(v) for v in got.values()) == sum(len(v) for v in alone.values()):
            break
    for r in (2, 3):
        assert [_sample(i) for i in got[r]] == [_sample(i) for i in alone[r]], r
    assert stream.decoded.value >= 12 and stream.skipped.value == 0  # counted across the workers


# --- column kinds ---


def _check_rows(data, n: int, captions=None):
    """Every row decodes to its own colour and caption (a list caption: one of the row's)."""
    items = _one_pass(HFStream(data, SIZE, seed=1, shuffle_buffer=0))
    assert len(items) == n
    for item in items:
        caption, colour = _sample(item)
        i = int(caption.split()[-1])
        assert colour == _colour(i), (caption, colour)
        if captions:
            assert caption in captions(i)


def test_an_image_feature_bytes_and_paths_all_decode_to_their_row(tmp_path):
    import datasets

    rows = _rows(6)
    _dataset(rows).to_parquet(str(tmp_path / "images.parquet"))
    raw = datasets.Dataset.from_dict({"jpg": [r["bytes"] for r in rows["image"]], "text": rows["caption"]})
    assert raw.features["jpg"].dtype == "binary"
    raw.to_parquet(str(tmp_path / "bytes.parquet"))
    (tmp_path / "img").mkdir()
    for i in range(6):
        (tmp_path / "img" / f"{i}.png").write_bytes(_png(i))
    lines = [json.dumps({"file": f"img/{i}.png", "caption": f"sample {i}"}) for i in range(6)]
    (tmp_path / "paths.jsonl").write_text("\n".join(lines))
    pd = pytest.importorskip("pandas")
    pd.DataFrame({"file": [str(tmp_path / f"img/{i}.png") for i in range(6)], "caption": rows["caption"]}).to_csv(
        tmp_path / "paths.csv", index=False
    )
    for streaming in (False, True):
        cases = [
            (_args(train_file=str(tmp_path / "images.parquet"), streaming=streaming), "image"),
            (_args(train_file=str(tmp_path / "bytes.parquet"), image_column="jpg", caption_column="text"), "bytes"),
            (_args(train_file=str(tmp_path / "paths.jsonl"), image_column="file", streaming=streaming), "path"),
            (_args(train_file=str(tmp_path / "paths.csv"), image_column="file", streaming=streaming), "path"),
        ]
        for args, kind in cases:
            data = load_training_dataset(args, 2)
            assert data.image_kind == kind and data.streaming == args.streaming
            _check_rows(data, 6)


def test_an_imagefolder_with_metadata_jsonl(tmp_path):
    folder = tmp_path / "pets"
    folder.mkdir()
    with open(folder / "metadata.jsonl", "w") as meta:
        for i in range(5):
            (folder / f"{i}.png").write_bytes(_png(i))
            meta.write(json.dumps({"file_name": f"{i}.png", "caption": f"sample {i}"}) + "\n")
    for streaming in (False, True):
        data = load_training_dataset(_args(dataset_name=str(folder), streaming=streaming), 1)
        assert data.image_kind == "image" and data.num_rows == 5  # streaming: from the split info
        _check_rows(data, 5)


def test_a_config_and_a_split_of_a_folder_are_chosen_by_name(folders, tmp_path):
    """A local folder whose README.md declares two configurations (as hub datasets do), and a DatasetDict folder."""
    rows = _rows(9)
    for name, part in (("small", range(3)), ("large", range(3, 9))):
        (tmp_path / "two" / name).mkdir(parents=True)
        _dataset(rows).select(part).to_parquet(str(tmp_path / "two" / name / "rows.parquet"))
    configs = "".join(f"- config_name: {n}\n  data_files: {n}/*.parquet\n" for n in ("small", "large"))
    (tmp_path / "two" / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    for config, ids in (("small", range(3)), ("large", range(3, 9))):
        data = load_training_dataset(_args(dataset_name=str(tmp_path / "two"), dataset_config_name=config), 1)
        assert data.num_rows == len(ids) and "(" + config + ")" in data.description
        assert sorted(int(item[1].split()[1]) for item in _one_pass(HFStream(data, SIZE))) == list(ids)
    data = load_training_dataset(_args(dataset_name=str(folders / "dict"), train_split="validation"), 1)
    assert sorted(int(item[1].split()[1]) for item in _one_pass(HFStream(data, SIZE))) == [0, 1, 2, 3]


def test_a_list_of_captions_gives_one_per_pass_drawn_from_seed_pass_and_row(tmp_path):
    import datasets

    rows = _rows(8)
    rows["caption"] = [[f"sample {i}", f"photo {i}", "", f"picture of {i}"] for i in range(8)]
    _dataset(rows, datasets.List(datasets.Value("string"))).save_to_disk(str(tmp_path / "lists"))
    options = lambda i: {f"sample {i}", f"photo {i}", f"picture of {i}"}  # noqa: E731 (the empty one never)
    data = load_training_dataset(_args(dataset_name=str(tmp_path / "lists")), 1)
    _check_rows(data, 8, options)
    passes = [item[1] for item in itertools.islice(HFStream(data, SIZE, seed=1, shuffle_buffer=0), 24)]
    again = [item[1] for item in itertools.islice(HFStream(data, SIZE, seed=1, shuffle_buffer=0), 24)]
    assert passes == again  # deterministic
    drawn = {c for c in passes if c.endswith(" 0")}
    assert len(drawn) >= 2 and drawn <= options(0)  # drawn anew each pass


# --- bad rows ---


def test_corrupt_missing_and_uncaptioned_rows_are_skipped_and_counted(tmp_path):
    bad = {1: "corrupt", 4: "none", 6: "empty"}
    data = load_training_dataset(_args(dataset_name=str(_saved(tmp_path, _rows(10, bad)))), 1)
    for streaming in (False, True):
        if streaming:
            data = load_training_dataset(_args(dataset_name=str(tmp_path / "ds"), streaming=True), 1)
        stream = HFStream(data, SIZE, seed=1, shuffle_buffer=3)
        items = _one_pass(stream)
        assert sorted(int(item[1].split()[1]) for item in items) == [0, 2, 3, 5, 7, 8, 9]
        assert stream.skipped.value == 3 and stream.decoded.value == 7 + 1  # and the next pass's first
    paths = [{"file": str(tmp_path / f"{i}.png"), "caption": f"sample {i}"} for i in range(4)]
    for i in (0, 2, 3):
        (tmp_path / f"{i}.png").write_bytes(_png(i))  # 1.png is missing
    (tmp_path / "3.png").write_bytes(b"not a png")
    (tmp_path / "paths.jsonl").write_text("\n".join(json.dumps(p) for p in paths))
    stream = HFStream(
        load_training_dataset(_args(train_file=str(tmp_path / "paths.jsonl"), image_column="file"), 1), SIZE
    )
    assert [item[1] for item in _one_pass(stream)] != [] and stream.skipped.value == 2


def _saved(tmp_path: Path, rows: dict) -> Path:
    _dataset(rows).save_to_disk(str(tmp_path / "ds"))
    return tmp_path / "ds"


@pytest.mark.parametrize("streaming", [False, True])
def test_a_reader_with_nothing_readable_raises_one_data_error(tmp_path, streaming):
    rows = _rows(4, {1: "corrupt", 3: "none"})  # reader 1 of 2 reads rows 1 and 3 (map-style), or shard 1
    data = load_training_dataset(_args(dataset_name=str(_saved(tmp_path, rows)), streaming=streaming), 2)
    if streaming:  # shard 1 of 2 holds rows 2 and 3: make both bad
        rows = _rows(4, {2: "empty", 3: "none"})
        shutil.rmtree(tmp_path / "ds")
        data = load_training_dataset(_args(dataset_name=str(_saved(tmp_path, rows)), streaming=True), 2)
    with pytest.raises(DataError, match=r"^reader 1 of 2 \(rank 1, DataLoader worker 0\) found no readable sample"):
        list(itertools.islice(HFStream(data, SIZE, rank=1, world_size=2), 5))
    assert len(list(itertools.islice(HFStream(data, SIZE, rank=0, world_size=2), 5))) == 5  # the other reader is fine


# --- resume: the stream's own seek ---


@pytest.mark.parametrize("source", ["saved", "saved-streaming", "parquet-streaming"])
@pytest.mark.parametrize("block", [1, 4, 9])
def test_a_restored_stream_yields_what_the_uninterrupted_one_does_next(folders, source, block):
    """Reader 0 of 2 (11 or 12 rows per pass; 40 = 3+ passes); the restore goes through stream_state.json."""
    name, _, mode = source.partition("-")
    data = load_training_dataset(_args(dataset_name=str(folders / name), streaming=mode == "streaming"), 2)

    def make():
        return HFStream(data, SIZE, rank=0, world_size=2, seed=5, shuffle_buffer=block)

    reference = list(itertools.islice(make(), 45))
    keys = [_sample(item) for item in reference]
    per_pass = sum(1 for item in reference if item[2][2] == 0)
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
        assert [_sample(item) for item in resumed] == keys[n : n + 10], n
        positions = [item[2][:fields].tolist() for item in resumed]
        assert positions == [item[2][:fields].tolist() for item in reference[n : n + 10]]
        assert stream.decoded.value == 10  # nothing before the position is decoded again
        # a resumed run's own positions resume it again
        again = list(itertools.islice(restored([resumed[-1][2]], n, "b"), 5))
        assert [_sample(item) for item in again] == keys[n + 10 : n + 15], n


@pytest.mark.parametrize("streaming", [False, True])
def test_a_restored_dataloader_with_workers_continues_the_uninterrupted_batches(folders, streaming, tmp_path):
    """Rank 0 of 2 with two workers, as the trainer folds and saves positions: after c batches the next comes from
    worker c mod 2, so the fresh loader's worker 0 takes that worker's place."""
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import POSITION_KEY, ClipCollator
    from disco_clip_ds.data.streams.state import as_rows, note_positions
    from disco_clip_ds.testing.launch import TOKENIZER_DIR

    data = load_training_dataset(_args(dataset_name=str(folders / "parquet"), streaming=streaming), 4)
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
    data = load_training_dataset(_args(dataset_name=str(folders / "parquet"), streaming=True), 2)
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


# --- bad input: one line, exit 2, before any training ---


def _refused(tmp_path, capsys, *source: str) -> str:
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.train.run import main

    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--model_config", str(TINY_CONFIG), *LAUNCH_COMMON, "--max_steps", "1"]
    assert run_main(main, [*argv, *source], "disco-clip train") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disco-clip train: "), err
    assert not out.exists()
    return err[0].removeprefix("disco-clip train: ")


def test_bad_sources_and_columns_are_refused_in_one_line(folders, tmp_path, capsys):
    saved = str(folders / "saved")
    say = lambda *a: _refused(tmp_path, capsys, *a)  # noqa: E731
    assert say("--dataset_name", saved, "--image_column", "img") == (
        f"--image_column img: no such column in '{saved}' (its columns: image, caption, id)"
    )
    assert say("--dataset_name", saved, "--caption_column", "text", "--streaming", "true").startswith(
        f"--caption_column text: no such column in '{saved}'"
    )
    assert say("--dataset_name", saved, "--image_column", "id") == (
        "--image_column id holds int64, neither images nor image bytes or paths"
    )
    assert say("--dataset_name", saved, "--image_column", "caption") == (
        "--image_column caption holds neither images nor paths: its first value 'sample 0' is no file (paths are "
        "read relative to the dataset's folder)"
    )
    assert say("--dataset_name", saved, "--caption_column", "id") == (
        "--caption_column id holds int64: it must hold a string or a list of strings"
    )
    for name in (folders / "dict", folders / "parquet"):
        assert say("--dataset_name", str(name), "--train_split", "test") == (
            f"--train_split test: '{name}' has no such split (its splits: "
            + ("train, validation)" if name.name == "dict" else "train)")
        )
    assert say("--dataset_name", saved, "--train_shards", saved) == (
        "give exactly one training source: --train_shards, --dataset_name or --train_file (got --train_shards and "
        "--dataset_name)"
    )
    assert say().endswith("(got none)")
    assert say("--dataset_name", saved, "--train_file", "x.csv").endswith("(got --dataset_name and --train_file)")
    assert say("--dataset_name", str(tmp_path / "nowhere")).startswith(f"--dataset_name {tmp_path / 'nowhere'}: ")
    assert (
        say("--train_file", str(tmp_path / "x.txt"))
        == f"--train_file {tmp_path / 'x.txt'}: give a .parquet, .arrow, .csv, .json or .jsonl file"
    )
    # a parquet folder never loaded whole (that would record its split sizes in the datasets cache)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(folders / "parquet" / "part-0.parquet", fresh / "part-0.parquet")
    assert say("--dataset_name", str(fresh), "--streaming", "true") == (
        f"datasets {fresh} split train, columns image/caption, streaming: its number of rows is not known: pass "
        "--train_num_samples"
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(folders / "saved", damaged)
    next(damaged.glob("*.arrow")).unlink()
    assert say("--dataset_name", str(damaged)).startswith(f"--dataset_name {damaged}: ")
    tiny = _saved(tmp_path, _rows(1))
    capsys.readouterr()
    assert say("--dataset_name", str(tiny), "--dataloader_num_workers", "2") == (
        f"datasets {tiny} split train, columns image/caption has 1 rows, fewer than the 2 readers (ranks x "
        "--dataloader_num_workers): use fewer ranks x workers, or more data"
    )


# --- launched: 2 ranks from a save_to_disk dataset (torchrun) and a streamed parquet folder (accelerate) ---

STEPS, PER_RANK = 6, 3  # 20 rows, 2 bad: 9 good per reader and pass, 18 trained per reader: passes wrap
BAD_ROWS = {3: "corrupt", 12: "empty"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The data, the initial weights, and the runs: uninterrupted and resumed from a copy of its checkpoint-3, for a
    map-style source under torchrun and a streaming one under accelerate; and 1 rank x 2 workers accumulating K=2
    over the map-style source under the deepspeed launcher."""
    from disco_clip_ds.testing.launch import REPO, SGD

    from helpers import run_to_end, save_initial_model

    root = tmp_path_factory.mktemp("hflaunch")
    ds = _dataset(_rows(20, BAD_ROWS))
    ds.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for k, part in enumerate(((0, 7), (7, 14), (14, 20))):  # 3 files, 2 readers: datasets steps through all rows
        ds.select(range(*part)).to_parquet(str(root / "parquet" / f"part-{k}.parquet"))
    model = save_initial_model(root / "tiny", 13)
    sources = {
        "map": ["--dataset_name", str(root / "saved")],
        "stream": ["--dataset_name", str(root / "parquet"), "--streaming", "true", "--train_num_samples", "20"],
    }
    launchers = {"map": "torchrun", "stream": "accelerate"}
    common = [*LAUNCH_COMMON, *SGD, "--model_name_or_path", str(model), "--max_steps", str(STEPS)]
    common += ["--per_device_train_batch_size", str(PER_RANK), "--save_steps", "3", "--shuffle_buffer", "4"]
    zero2 = ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]  # under accelerate its ZeRO-2 yaml names it
    for kind, source in sources.items():
        full, resumed = root / f"{kind}_full", root / f"{kind}_resumed"
        source = [*source, *(zero2 if launchers[kind] != "accelerate" else [])]
        rc, log = run_to_end(full, ["--output_dir", str(full), *common, *source], launcher=launchers[kind])
        assert rc == 0, log[-3000:]
        resumed.mkdir()
        shutil.copy(full / "run.json", resumed / "run.json")
        shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
        args = ["--output_dir", str(resumed), *common, *source, "--resume_from_checkpoint", "latest"]
        rc, log = run_to_end(resumed, args, launcher=launchers[kind])
        assert rc == 0, log[-3000:]
        assert "resume: the data stream seeks to where 2 readers stood" in log
    k2 = [*common, *zero2, *sources["map"], "--dataloader_num_workers", "2", "--gradient_accumulation_steps", "2"]
    rc, log = run_to_end(root / "n1_k2", ["--output_dir", str(root / "n1_k2"), *k2], launcher="deepspeed", nproc=1)
    assert rc == 0, log[-3000:]
    return root


def _results(run: Path) -> dict:
    return json.loads((run / "train_results.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_two_ranks_train_and_a_resumed_run_ends_with_the_uninterrupted_losses_and_weights(launched, kind):
    from helpers import same_weights, step_losses, weights

    full, resumed = launched / f"{kind}_full", launched / f"{kind}_resumed"
    assert same_weights(full, resumed) == 0.0
    assert step_losses(resumed) == step_losses(full)  # its log holds the checkpoint's steps, then its own
    w0 = weights(launched / "tiny")
    assert max((weights(full)[k] - w0[k]).abs().max().item() for k in w0) > 1e-3  # it trained
    # each pass holds the 2 bad rows; the full run read a second pass of both readers
    assert _results(full)["skipped_samples"] >= 2 * 2 and _results(full)["decoded_samples"] >= STEPS * 2 * PER_RANK
    assert _results(resumed)["decoded_samples"] < _results(full)["decoded_samples"]  # it sought, not re-read
    state = json.loads((full / "checkpoint-3" / "stream_state.json").read_text())
    assert state["source"] == "datasets" and sorted(state["readers"]) == ["0", "1"]
    assert all(entry["count"] == 3 * PER_RANK for entry in state["readers"].values())
    if kind == "stream":  # 9 good rows per reader (and a bad one) in blocks of 4: in block 2, at datasets' state_dict
        assert all(e["block"] == 2 and e["offset"] >= 1 for e in state["readers"].values())
        assert all(e["state_dict"]["examples_iterable"] for e in state["readers"].values())
    run = json.loads((full / "run.json").read_text())
    assert run["data"].startswith("datasets ") and "num_shards" not in run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_rank_accumulating_two_micro_batches_trains_like_two_ranks(launched):
    """1 rank x 2 DataLoader workers, K=2: its micro-batches come from readers 0 and 1, the two ranks' readers of
    map_full, and the contrastive loss over both equals the 2-rank one."""
    from helpers import assert_same_training, weights

    assert_same_training(launched / "n1_k2", launched / "map_full", weights(launched / "tiny"), steps=STEPS)


@pytest.mark.slow
def test_a_resume_with_another_dataset_is_refused_in_one_line(launched, tmp_path, capsys):
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.testing.launch import REPO, SGD
    from disco_clip_ds.train.run import main

    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(launched / "map_full" / "run.json", out / "run.json")
    shutil.copytree(launched / "map_full" / "checkpoint-3", out / "checkpoint-3")
    argv = ["--output_dir", str(out), "--model_name_or_path", str(launched / "tiny"), *LAUNCH_COMMON, *SGD]
    # one rank reading for two (2 workers, a batch of 2 x 3): only the data differs from the run's
    argv += ["--max_steps", str(STEPS), "--per_device_train_batch_size", str(2 * PER_RANK), "--save_steps", "3"]
    argv += ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"), "--dataloader_num_workers", "2"]
    argv += ["--dataset_name", str(launched / "saved"), "--caption_column", "id", "--resume_from_checkpoint", "latest"]
    assert run_main(main, argv, "disco-clip train") == 2  # first: the column is refused as it is
    capsys.readouterr()
    argv[-4:-2] = ["--image_column", "image"]
    argv += ["--train_split", "train", "--dataset_name", str(launched / "parquet"), "--train_num_samples", "20"]
    assert run_main(main, argv, "disco-clip train") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(err) == 1 and "cannot resume checkpoint-3 under changed settings: training data datasets " in err[0]
    assert f"{launched / 'saved'} split train" in err[0] and f"-> datasets {launched / 'parquet'} split" in err[0]
    assert "pass the run's --dataset_name/--train_file, split and columns, or --ignore_data_skip" in err[0]
