"""checkpoint.runfile: the one reader of run.json, and which run.json holds for a checkpoint."""

from __future__ import annotations

import json

from disco_clip_ds.checkpoint.runfile import RUN_FILE, read_run_file, run_file_of


def test_run_json_absent_or_unreadable_is_no_facts(tmp_path):
    assert read_run_file(tmp_path) is None
    (tmp_path / RUN_FILE).write_text("{not json")
    assert read_run_file(tmp_path) is None
    (tmp_path / RUN_FILE).write_text(json.dumps({"world_size": 2}))
    assert read_run_file(tmp_path) == {"world_size": 2}


def test_a_checkpoint_takes_its_own_run_json_else_its_run_folders(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    assert run_file_of(checkpoint) is None
    (checkpoint.parent / RUN_FILE).write_text(json.dumps({"world_size": 2}))
    assert run_file_of(checkpoint) == {"world_size": 2}
    (checkpoint / RUN_FILE).write_text(json.dumps({"world_size": 4}))  # copied with the checkpoint
    assert run_file_of(checkpoint) == {"world_size": 4}
