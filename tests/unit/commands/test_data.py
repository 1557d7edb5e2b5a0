"""`disco-clip data download|metadata` (commands/data.py): arguments checked before any work; metadata offline."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disco_clip_ds.commands.data import (
    download_main,
    metadata_main,
)
from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.testing.download import download_args, write_url_list


@pytest.mark.slow  # beyond the fast tier's time budget
def test_download_arguments_are_checked_before_any_work(tmp_path):
    url_list = write_url_list(tmp_path / "urls.parquet", [("http://127.0.0.1:9/x.jpg", "x")])
    base = download_args(url_list, tmp_path / "out")
    with pytest.raises(UsageError, match="did you mean --encode_quality"):
        download_main(base + ["--encode_qualty", "90"])
    with pytest.raises(UsageError, match="use --output"):
        download_main(base + ["--output_folder", "elsewhere"])
    with pytest.raises(UsageError, match=r"column 'url' .*\['URL', 'TEXT'\].*--url_col"):
        download_main(base[:1] + ["datacomp"] + base[2:])
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="cannot read .*broken.parquet as parquet"):
        download_main(base[:2] + ["--url_list", str(tmp_path / "broken.parquet")] + base[4:])
    with pytest.raises(UsageError, match="does not exist"):
        download_main(["--preset", "cc", "--url_list", str(tmp_path / "nope.tsv"), "--output", str(tmp_path)])
    assert not (tmp_path / "out").exists()


def test_metadata_offline_on_a_local_folder(tmp_path, capsys):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    folder = tmp_path / "relaion"
    (folder / "part").mkdir(parents=True)
    for i, n in enumerate((3, 4)):
        pq.write_table(pa.table({"url": ["u"] * n, "caption": ["c"] * n}), folder / "part" / f"part-{i:05d}.parquet")
    (folder / "README.md").write_text("card")
    argv = ["--dataset", "laion/relaion2B-en-research-safe", "--output", str(folder)]
    assert metadata_main(argv + ["--pattern", "part/*.parquet"]) == 0
    assert "2 parquet files, 7 rows" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no parquet file"):
        metadata_main(argv + ["--pattern", "other/*.parquet"])
    with pytest.raises(DataError, match="cannot fetch"):
        metadata_main(["--dataset", "laion/relaion2B-en-research-safe", "--output", str(tmp_path / "empty")])


def test_every_data_option_states_its_default_in_help():
    """A user reads each default off `--help`: argparse states it (DefaultsOnce), or the help says it in words; a
    flag that takes no value is off unless given."""
    from disco_clip_ds.cli import DefaultsOnce
    from disco_clip_ds.commands import data

    parsers = [data.download_parser, data.verify_parser, data.embed_parser, data.filter_parser]
    parsers += [data.metadata_parser, data.demo_parser]
    silent = []
    for parser in (make() for make in parsers):
        formatter = parser.formatter_class(parser.prog)
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.required:
                continue
            if not (DefaultsOnce._states_default(formatter, action) or "default" in (action.help or "")):
                silent.append(f"{parser.prog} {action.option_strings[0]}")
    assert silent == []
