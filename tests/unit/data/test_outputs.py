"""data/prep/outputs.py: the download's summary from img2dataset's stats, and a folder prepared for a resumed
download."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from disco_clip_ds.data.prep.outputs import prepare_output_for_resume, summarize
from disco_clip_ds.errors import UsageError


def _write_tar(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(name), 1_700_000_000
            tar.addfile(info, io.BytesIO(name.encode()))


def test_summarize_aggregates_stats_and_names_failed_shards(tmp_path):
    stats = {
        0: dict(
            count=4,
            successes=2,
            failed_to_download=1,
            failed_to_resize=1,
            status_dict={"success": 2, "HTTP Error 404: Not Found": 1, "Image decoding error\n": 1},
        ),
        2: dict(count=3, successes=3, failed_to_download=0, failed_to_resize=0, status_dict={"success": 3}),
    }
    for i, s in stats.items():
        (tmp_path / f"0000{i}_stats.json").write_text(json.dumps(s))
    _write_tar(tmp_path / "00000.tar", ["k1.txt", "k1.jpg", "k0.jpg", "k0.txt"])  # completion order
    _write_tar(tmp_path / "00002.tar", ["a.jpg", "b.jpg", "c.png"])
    # shard 3 finished by its stats, but its tar lost a sample (cut at a member boundary): redo it
    (tmp_path / "00003_stats.json").write_text(json.dumps({**stats[2], "successes": 4}))
    _write_tar(tmp_path / "00003.tar", ["a.jpg", "b.jpg", "c.jpg"])
    summary, sizes = summarize(tmp_path, n_expected=4)
    assert not (tmp_path / "00003_stats.json").exists()
    assert summary == {
        "shards": 4,
        "shards_done": 2,
        "shards_failed": ["00001", "00003"],
        "count": 7,
        "successes": 5,
        "failed_to_download": 1,
        "failed_to_resize": 1,
        "failures_by_reason": {"HTTP Error 404: Not Found": 1, "Image decoding error": 1},
        "shards_set_aside": ["00003"],
    }
    assert sizes == {"00000.tar": 2, "00002.tar": 3}
    # the damaged shard's tar is out of the shards a folder spec reads, until the re-run writes it anew
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["00000.tar", "00002.tar"]
    assert (tmp_path / "00003.tar.partial").is_file()
    with tarfile.open(tmp_path / "00000.tar") as tar:
        assert tar.getnames() == ["k0.jpg", "k0.txt", "k1.jpg", "k1.txt"]
        assert {m.mtime for m in tar.getmembers()} == {0}
        assert tar.extractfile("k1.jpg").read() == b"k1.jpg"


def test_resume_preparation_redoes_a_missing_tar_and_refuses_stray_json(tmp_path):
    for name in ("00000_stats.json", "00001_stats.json", "sizes.json", "summary.json"):
        (tmp_path / name).write_text("{}")
    _write_tar(tmp_path / "00000.tar", ["a.jpg"])
    (tmp_path / "00001.parquet").write_text("")
    assert prepare_output_for_resume(tmp_path) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.tar", "00000_stats.json"]
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(UsageError, match="notes.json"):
        prepare_output_for_resume(tmp_path)


def test_a_shard_cut_short_by_a_crash_is_set_aside_until_a_rerun_finishes_it(tmp_path):
    """A worker that crashed inside shard 1 left its tar, without stats: it stayed among the outputs, broken."""
    done = dict(count=1, successes=1, failed_to_download=0, failed_to_resize=0, status_dict={"success": 1})
    (tmp_path / "00000_stats.json").write_text(json.dumps(done))
    _write_tar(tmp_path / "00000.tar", ["a.jpg"])
    (tmp_path / "00001.tar").write_bytes(b"\0" * 700)  # half a header: what a killed writer leaves
    summary, sizes = summarize(tmp_path, n_expected=2)
    assert summary["shards_failed"] == ["00001"] and summary["shards_set_aside"] == ["00001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.tar", "00000_stats.json", "00001.tar.partial"]
    # the re-run finished it: the stale .partial goes
    (tmp_path / "00001_stats.json").write_text(json.dumps(done))
    _write_tar(tmp_path / "00001.tar", ["b.jpg"])
    summary, sizes = summarize(tmp_path, n_expected=2)
    assert summary["shards_set_aside"] == [] and not (tmp_path / "00001.tar.partial").exists()
    assert sizes == {"00000.tar": 1, "00001.tar": 1}
