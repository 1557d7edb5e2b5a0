"""Launched: `disco-clip data filter` as a user runs it (its own process, a pool of workers): killed with SIGKILL at
a named point between output shards (DISCO_FAULT kill_after_output), then re-run, it gives byte for byte the output
of a run never killed; and --processes 2 gives the output of --processes 1; with every rule, SemDeDup and MetaCLIP's
balancing (matched in the workers' scans) included."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from disco_clip_ds.testing.launch import finish, start

from unit.data.curate.shardsets import embedded_shards, smooth_jpeg


def _outputs(folder) -> dict[str, str]:
    """sha256 of every file of an output folder but the resume state."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".filter" not in p.parts
    }


def _run(tmp_path, out, processes: int, fault: str = "") -> int:
    command = [sys.executable, "-m", "disco_clip_ds.commands.data", "filter", "--shards", str(tmp_path / "in")]
    command += ["--output", str(out), "--keep_fraction", "0.75", "--dedup", "--samples_per_shard", "3"]
    command += ["--caption_words_over", "1", "--caption_language", "en"]  # DataComp's caption rules, in the scan
    # the later rules too: SemDeDup, and MetaCLIP's balancing (matched in the workers' scans, drawn in the decision)
    command += ["--semdedup_eps", "0.3", "--semdedup_clusters", "2", "--metadata", str(tmp_path / "meta.txt")]
    command += ["--balance_t", "6"]
    command += ["--processes", str(processes)]
    return finish(start(command, tmp_path / "log.txt", DISCO_FAULT=fault), timeout=240, linger=10)


@pytest.mark.slow  # spawns the filter and its workers four times
def test_a_filter_killed_between_shards_resumes_to_the_same_bytes_at_any_processes(tmp_path):
    images = [smooth_jpeg(i % 28) for i in range(32)]  # samples 28..31 repeat 0..3: exact copies for --dedup
    # each sample with a DataComp uid in its .json; samples 5 and 13 captioned in one word, 9 in German
    captions = {5: "image", 13: "picture", 9: "ein Bild von einem Hund"}
    samples = [
        {
            "jpg": data,
            "txt": captions.get(i, f"an image of thing {i}" if i % 2 else f"a photo of thing {i}"),
            "json": json.dumps({"uid": f"{i:032x}"}),
        }
        for i, data in enumerate(images)
    ]
    embedded_shards(tmp_path / "in", 4, 8, samples=samples)
    (tmp_path / "meta.txt").write_text("image\nphoto\n", encoding="utf-8")
    out = tmp_path / "out"
    assert _run(tmp_path, out, 1) == 0, (tmp_path / "log.txt").read_text()
    reference = _outputs(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"] == 32
    assert summary["dropped"]["caption_language"] == 1 and summary["dropped"]["caption_words"] == 2
    assert summary["dropped"]["semdedup"] > 0 and summary["dropped"]["balance"] > 0  # each later rule drops some
    kept = pq.read_table(out / "filter.parquet").to_pydict()["dropped_by"]
    uids = [(0, i) for i, reason in enumerate(kept) if reason is None]  # DataComp's pairs of the kept samples
    assert np.load(out / "kept_uids.npy").tolist() == uids and "kept_uids.npy" in reference
    shards = sum(name.endswith(".tar") for name in reference)
    assert shards == -(-len(uids) // 3) >= 3  # so that the kill after shard 1 comes before the end
    shutil.rmtree(out)
    assert _run(tmp_path, out, 2) == 0, (tmp_path / "log.txt").read_text()
    assert _outputs(out) == reference
    shutil.rmtree(out)
    assert _run(tmp_path, out, 2, fault="kill_after_output:shard=1") == -signal.SIGKILL
    assert (out / "00001.tar").is_file() and not (out / "summary.json").exists()
    assert _run(tmp_path, out, 1) == 0, (tmp_path / "log.txt").read_text()
    assert _outputs(out) == reference
