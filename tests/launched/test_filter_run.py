"""Launched: `disco-clip data filter` as a user runs it (its own process, a pool of workers): its process group killed
with SIGKILL at a named point between output shards (DISCO_FAULT hold_after_output), then re-run, it gives byte for
byte the output of a run never killed, and leaves no POSIX semaphore in /dev/shm; --processes 2 gives the output of
--processes 1; with every rule, DataComp's caption rules, SemDeDup and MetaCLIP's balancing (matched in the workers'
scans) included."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from disco_clip_ds.testing.launch import finish, start
from disco_clip_ds.testing.processes import kill_group

from unit.data.curate.shardsets import embedded_shards, smooth_jpeg


def _outputs(folder) -> dict[str, str]:
    """sha256 of every file of an output folder but the resume state."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".filter" not in p.parts
    }


def _start(tmp_path, out, processes: int, fault: str = ""):
    command = [sys.executable, "-m", "disco_clip_ds.commands.data", "filter", "--shards", str(tmp_path / "in")]
    command += ["--output", str(out), "--keep_fraction", "0.75", "--dedup", "--samples_per_shard", "3"]
    command += ["--caption_words_over", "1", "--caption_language", "en"]  # DataComp's caption rules, in the scan
    # the later rules too: SemDeDup, and MetaCLIP's balancing (matched in the workers' scans, drawn in the decision)
    command += ["--semdedup_eps", "0.3", "--semdedup_clusters", "2", "--metadata", str(tmp_path / "meta.txt")]
    command += ["--balance_t", "6"]
    command += ["--processes", str(processes)]
    return start(command, tmp_path / "log.txt", DISCO_FAULT=fault)


def _run(tmp_path, out, processes: int) -> int:
    return finish(_start(tmp_path, out, processes), timeout=240, linger=10)


def _semaphores_mapped(pids) -> set[int]:
    """The inodes of the /dev/shm semaphores (sem.*) that processes `pids` (default: every process) have open."""
    mapped = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        mapped.update(int(line.split()[4]) for line in lines if "/dev/shm/sem." in line)
    return mapped


def _orphan_semaphores() -> set[str]:
    """The POSIX semaphores of /dev/shm that no live process has open: what a killed run leaves behind (a live
    process's, another test's, are open in it)."""
    mapped = _semaphores_mapped(p.name for p in Path("/proc").iterdir() if p.name.isdigit())
    found = set()
    for path in Path("/dev/shm").glob("sem.*"):
        try:
            if path.stat().st_ino not in mapped:
                found.add(path.name)
        except FileNotFoundError:  # unlinked meanwhile
            pass
    return found


def _group(pgid: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if _pgid(pid) == pgid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


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
    # kill -9 of the process group (the filter, its 2 workers, multiprocessing's resource tracker), held at shard 1
    orphans, hold = _orphan_semaphores(), tmp_path / "held.pid"
    proc = _start(tmp_path, out, 2, fault=f"hold_after_output={hold}:shard=1")
    try:
        deadline = time.monotonic() + 240
        while not hold.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hold.exists(), (tmp_path / "log.txt").read_text()
        group = _group(proc.pid)
        assert len(group) >= 3 and not _semaphores_mapped(group)  # the pool synchronises by pipes alone
    finally:
        kill_group(proc.pid)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _orphan_semaphores() - orphans == set()
    assert (out / "00001.tar").is_file() and not (out / "summary.json").exists()
    assert _run(tmp_path, out, 1) == 0, (tmp_path / "log.txt").read_text()
    assert _outputs(out) == reference
