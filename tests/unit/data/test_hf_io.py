"""data/hf_io.py, the one 🤗 datasets loader: each source kind (files, imagefolder, configs, splits) and column kind
(Image, bytes, paths, a string or a List / LargeList of strings) loads and decodes to its rows, and each bad input is
one line with exit code 2 before any training."""

import json
import shutil

import pytest

from disco_clip_ds.data.hf_io import load_training_dataset
from disco_clip_ds.data.streams.hf import HFStream
from disco_clip_ds.testing.launch import LAUNCH_COMMON, TINY_CONFIG

from unit.data.hfsets import SIZE, check_rows, hf_args, hf_dataset, hf_png, hf_rows, one_pass, saved_dataset


@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_image_feature_bytes_and_paths_all_decode_to_their_row(tmp_path):
    import datasets

    rows = hf_rows(6)
    hf_dataset(rows).to_parquet(str(tmp_path / "images.parquet"))
    raw = datasets.Dataset.from_dict({"jpg": [r["bytes"] for r in rows["image"]], "text": rows["caption"]})
    assert raw.features["jpg"].dtype == "binary"
    raw.to_parquet(str(tmp_path / "bytes.parquet"))
    (tmp_path / "img").mkdir()
    for i in range(6):
        (tmp_path / "img" / f"{i}.png").write_bytes(hf_png(i))
    lines = [json.dumps({"file": f"img/{i}.png", "caption": f"sample {i}"}) for i in range(6)]
    (tmp_path / "paths.jsonl").write_text("\n".join(lines))
    pd = pytest.importorskip("pandas")
    pd.DataFrame({"file": [str(tmp_path / f"img/{i}.png") for i in range(6)], "caption": rows["caption"]}).to_csv(
        tmp_path / "paths.csv", index=False
    )
    for streaming in (False, True):
        cases = [
            (hf_args(train_file=str(tmp_path / "images.parquet"), streaming=streaming), "image"),
            (hf_args(train_file=str(tmp_path / "bytes.parquet"), image_column="jpg", caption_column="text"), "bytes"),
            (hf_args(train_file=str(tmp_path / "paths.jsonl"), image_column="file", streaming=streaming), "path"),
            (hf_args(train_file=str(tmp_path / "paths.csv"), image_column="file", streaming=streaming), "path"),
        ]
        for args, kind in cases:
            data = load_training_dataset(args, 2)
            assert data.image_kind == kind and data.streaming == args.streaming
            check_rows(data, 6)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_an_imagefolder_with_metadata_jsonl(tmp_path):
    folder = tmp_path / "pets"
    folder.mkdir()
    with open(folder / "metadata.jsonl", "w") as meta:
        for i in range(5):
            (folder / f"{i}.png").write_bytes(hf_png(i))
            meta.write(json.dumps({"file_name": f"{i}.png", "caption": f"sample {i}"}) + "\n")
    for streaming in (False, True):
        data = load_training_dataset(hf_args(dataset_name=str(folder), streaming=streaming), 1)
        assert data.image_kind == "image" and data.num_rows == 5  # streaming: from the split info
        check_rows(data, 5)


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_config_and_a_split_of_a_folder_are_chosen_by_name(folders, tmp_path):
    """A local folder whose README.md declares two configurations (as hub datasets do), and a DatasetDict folder."""
    rows = hf_rows(9)
    for name, part in (("small", range(3)), ("large", range(3, 9))):
        (tmp_path / "two" / name).mkdir(parents=True)
        hf_dataset(rows).select(part).to_parquet(str(tmp_path / "two" / name / "rows.parquet"))
    configs = "".join(f"- config_name: {n}\n  data_files: {n}/*.parquet\n" for n in ("small", "large"))
    (tmp_path / "two" / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    for config, ids in (("small", range(3)), ("large", range(3, 9))):
        data = load_training_dataset(hf_args(dataset_name=str(tmp_path / "two"), dataset_config_name=config), 1)
        assert data.num_rows == len(ids) and "(" + config + ")" in data.description
        assert sorted(int(item[1].split()[1]) for item in one_pass(HFStream(data, SIZE))) == list(ids)
    data = load_training_dataset(hf_args(dataset_name=str(folders / "dict"), train_split="validation"), 1)
    assert sorted(int(item[1].split()[1]) for item in one_pass(HFStream(data, SIZE))) == [0, 1, 2, 3]


def _refused(tmp_path, capsys, *source: str) -> str:
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main

    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--model_config", str(TINY_CONFIG), *LAUNCH_COMMON, "--max_steps", "1"]
    assert run_main(main, [*argv, *source], "disco-clip train") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disco-clip train: "), err
    assert not out.exists()
    return err[0].removeprefix("disco-clip train: ")


@pytest.mark.slow  # beyond the fast tier's time budget
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
    # a stream of json lines has no count until it is read (a parquet file's footer has one)
    (tmp_path / "0.png").write_bytes(hf_png(0))
    (tmp_path / "paths.jsonl").write_text(json.dumps({"file": "0.png", "caption": "sample 0"}) + "\n")
    assert say("--train_file", str(tmp_path / "paths.jsonl"), "--image_column", "file", "--streaming", "true") == (
        f"datasets file {tmp_path / 'paths.jsonl'}, columns file/caption, streaming: its number of rows is not "
        "known: pass --train_num_samples"
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(folders / "saved", damaged)
    next(damaged.glob("*.arrow")).unlink()
    assert say("--dataset_name", str(damaged)).startswith(f"--dataset_name {damaged}: ")
    tiny = saved_dataset(tmp_path, hf_rows(1))
    capsys.readouterr()
    assert say("--dataset_name", str(tiny), "--dataloader_num_workers", "2") == (
        f"datasets {tiny} split train, columns image/caption has 1 rows, fewer than the 2 readers (ranks x "
        "--dataloader_num_workers): use fewer ranks x workers, or more data"
    )


def test_a_large_list_caption_column_trains_and_evaluates_alike(tmp_path):
    """A caption column of LargeList(string) holds captions for training as for eval (one loader, data/hf_io.py):
    load_training_dataset takes it (from the save_to_disk folder and from its .arrow file) and HFStream draws each
    row's caption from the row's own list; eval's DatasetSource reads the same lists."""
    import datasets
    from transformers import CLIPImageProcessor

    from disco_clip_ds.eval.sources import DatasetSource

    rows = hf_rows(6)
    rows["caption"] = [[f"sample {i}", f"photo {i}"] for i in range(6)]
    folder = tmp_path / "large"
    hf_dataset(rows, datasets.LargeList(datasets.Value("string"))).save_to_disk(str(folder))
    (arrow,) = folder.glob("*.arrow")
    for args in (hf_args(dataset_name=str(folder)), hf_args(train_file=str(arrow))):
        data = load_training_dataset(args, 1)
        check_rows(data, 6, lambda i: set(rows["caption"][i]))
    source = DatasetSource.open(str(folder), "zeroshot_retrieval", image_column="image", caption_column="caption")
    processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    assert [captions for _, batch in source.batches(processor, 4) for captions in batch] == rows["caption"]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_plain_bytes_path_struct_trains_and_evaluates_as_an_image_column_with_parquet_row_counts(tmp_path):
    """Parquet written without datasets' metadata (pyarrow, pandas) holds an image column as a plain
    {bytes, path} struct: training loads it as an Image column and eval finds it as the only one, each row decoding
    as the same rows stored with datasets' Image feature do; a streamed parquet folder or file counts its rows from
    the files' footers, so --streaming needs no --train_num_samples."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import CLIPImageProcessor

    from disco_clip_ds.eval.sources import DatasetSource

    rows = hf_rows(7)
    struct = [{"bytes": image["bytes"], "path": None} for image in rows["image"]]  # path: nulls only
    (tmp_path / "pq").mkdir()
    for name, part in (("a", slice(0, 4)), ("b", slice(4, 7))):  # a folder of two files written by pyarrow
        pq.write_table(
            pa.table({"image": struct[part], "caption": rows["caption"][part]}), tmp_path / f"pq/{name}.parquet"
        )
    pd = pytest.importorskip("pandas")
    paths = [{"bytes": image["bytes"], "path": f"{i}.png"} for i, image in enumerate(rows["image"])]
    pd.DataFrame({"image": paths[4:], "caption": rows["caption"][4:]}).to_parquet(tmp_path / "pandas.parquet")
    files = [*(tmp_path / "pq").iterdir(), tmp_path / "pandas.parquet"]
    assert all(b"huggingface" not in (pq.read_schema(f).metadata or {}) for f in files)
    for streaming in (True, False):  # streaming first: nothing cached by a full load tells it the count
        for args, n in (
            (hf_args(dataset_name=str(tmp_path / "pq"), streaming=streaming), 7),
            (hf_args(train_file=str(tmp_path / "pandas.parquet"), streaming=streaming), 3),
        ):
            data = load_training_dataset(args, 1)
            assert (data.image_kind, data.num_rows) == ("image", n), args
            check_rows(data, n)

    hf_dataset(rows).select_columns(["image", "caption"]).to_parquet(str(tmp_path / "featured.parquet"))
    processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    batches = {}
    for name in ("pq", "featured.parquet"):
        source = DatasetSource.open(str(tmp_path / name), "zeroshot_retrieval")  # no --image_column: found
        assert source.image_column == "image"
        batches[name] = [(pixels, captions) for pixels, captions in source.batches(processor, 4)]
    assert isinstance(datasets.load_dataset("parquet", data_files=str(tmp_path / "featured.parquet"),
                                            split="train").features["image"], datasets.Image)  # fmt: skip
    assert (
        [c for _, c in batches["pq"]]
        == [c for _, c in batches["featured.parquet"]]
        == [
            [[f"sample {i}"] for i in range(4)],
            [[f"sample {i}"] for i in range(4, 7)],
        ]
    )
    for (ours, _), (reference, _) in zip(batches["pq"], batches["featured.parquet"]):
        assert ours.equal(reference)


@pytest.mark.parametrize("kind", ["parquet_folder", "parquet_file", "save_to_disk", "jsonl", "csv_header_only"])
@pytest.mark.parametrize("streaming", [True, False])
def test_a_dataset_of_0_rows_is_refused_saying_so(tmp_path, kind, streaming):
    """datasets fails on empty data with 'list index out of range', 'StopIteration' or 'An error occurred while
    generating the dataset' (or an ArrowInvalid traceback): one line saying it has 0 rows instead."""
    from types import SimpleNamespace

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from disco_clip_ds.errors import UsageError

    table = pa.table({"image": pa.array([], pa.string()), "caption": pa.array([], pa.string())})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "train.parquet")
    datasets.Dataset.from_dict({"image": [], "caption": []}).save_to_disk(str(tmp_path / "disk"))
    (tmp_path / "e.jsonl").write_text("\n \n")
    (tmp_path / "h.csv").write_text("image,caption\n")
    source = {
        "parquet_folder": dict(dataset_name=str(tmp_path / "pq"), train_file=None),
        "parquet_file": dict(dataset_name=str(tmp_path / "pq" / "train.parquet"), train_file=None),
        "save_to_disk": dict(dataset_name=str(tmp_path / "disk"), train_file=None),
        "jsonl": dict(dataset_name=None, train_file=str(tmp_path / "e.jsonl")),
        "csv_header_only": dict(dataset_name=None, train_file=str(tmp_path / "h.csv")),
    }[kind]
    args = SimpleNamespace(train_split="train", streaming=streaming, dataset_config_name=None, image_column="image",
                           caption_column="caption", **source)  # fmt: skip
    with pytest.raises(UsageError, match=r": it has 0 rows: give a dataset that holds samples$"):
        load_training_dataset(args, 2)
