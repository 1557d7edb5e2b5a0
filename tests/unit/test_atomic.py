"""atomic.py: the one atomic write. Two writers of one path each publish a whole file (the issue's 27 of 600 writes
lost were two writers renaming each other's fixed `.NAME.tmp` away); a failed write leaves the old file and no
temporary one; the written file has a plain file's mode."""

from __future__ import annotations

import json
import os
import threading

import pytest

from disco_clip_ds import atomic
from disco_clip_ds.data.shards import write_json
from disco_clip_ds.testing.writers import in_another_process


def test_a_second_writer_in_the_middle_of_the_first_takes_nothing_from_it(tmp_path):
    """The interleaving that lost writes, made deterministic: writer B writes the whole file while writer A's
    temporary file is written and not yet renamed (with one fixed temporary name, B renamed A's file away and A's
    rename raised FileNotFoundError). Then B in another process, at the same point."""
    path = tmp_path / "sizes.json"
    with atomic.staged(path) as first:
        first.write_text('{"writer": "A"}')
        write_json(path, {"writer": "B"})
        assert json.loads(path.read_text()) == {"writer": "B"} and first.read_text() == '{"writer": "A"}'
        assert in_another_process(lambda: write_json(path, {"writer": "C"})) == ""
        assert json.loads(path.read_text()) == {"writer": "C"} and first.is_file()
    assert json.loads(path.read_text()) == {"writer": "A"}  # the last rename wins, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sizes.json"]


def test_concurrent_callers_lose_no_write_and_leave_a_whole_file(tmp_path):
    """3 threads x 8 writes of distinct contents to one path (and each to its own): no write fails, the final file is
    one of the written ones, whole, and no temporary file is left. (The interleaving itself: the test above.)"""
    shared = tmp_path / "shared.json"
    written, errors = [], []

    def writer(n: int) -> None:
        for i in range(8):
            record = {"writer": n, "write": i, "padding": "x" * (1000 + 37 * i)}
            try:
                write_json(shared, record)
                write_json(tmp_path / f"own-{n}.json", record)
            except OSError as error:
                errors.append(error)
            written.append(record)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(written) == 24
    assert json.loads(shared.read_text()) in written
    for n in range(3):
        assert json.loads((tmp_path / f"own-{n}.json").read_text())["write"] == 7
    assert not [p.name for p in tmp_path.iterdir() if atomic.is_leftover(p.name)]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"old": 1})
    with pytest.raises(TypeError):
        write_json(path, {"not json": object()})
    with pytest.raises(KeyboardInterrupt), atomic.staged(path) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"old": 1} and sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_a_written_file_has_a_plain_files_mode_and_its_temporary_name_is_recognised(tmp_path):
    """mkstemp makes 0600; the output is for others to read as a plain open()'s would be (0666 less the umask)."""
    atomic.write_bytes(tmp_path / "a.bin", b"x")
    (tmp_path / "plain.bin").write_bytes(b"x")
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == (tmp_path / "plain.bin").stat().st_mode & 0o777
    stage = atomic.Stage(tmp_path / "00001.tar")
    assert atomic.is_leftover(stage.tmp.name) and stage.tmp.name.startswith(".00001.tar.")
    stage.discard()
    assert not any(atomic.is_leftover(n) for n in ("00001.tar", ".00001.tar.tmp", "a.tmp", ".filter"))


def test_only_a_durable_write_is_synced_to_the_disk_before_its_rename(tmp_path, monkeypatch):
    """A checkpoint's manifest (the mark that the folder is whole) is synced before it is renamed into place, so a
    power loss cannot leave the name on empty blocks; other writes are not (their readers check their checksums)."""
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    atomic.write_text(tmp_path / "sizes.json", "{}")
    assert synced == []
    atomic.write_text(tmp_path / "manifest.json", "{}", durable=True)
    assert len(synced) == 1 and atomic.is_leftover(os.path.basename(synced[0]))  # the temporary file, before
    from disco_clip_ds.checkpoint.manifest import write_manifest

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"w")
    write_manifest(tmp_path / "ckpt")
    assert len(synced) == 2 and ".manifest.json." in synced[1]
