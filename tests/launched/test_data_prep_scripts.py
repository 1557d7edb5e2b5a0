"""Launched: each data_prep script runs through, every `disco-clip` call in it parsing as our CLI does."""

from __future__ import annotations

import os
import subprocess

import pytest

from disco_clip_ds.commands.data import (
    download_parser,
    embed_parser,
    filter_parser,
    metadata_parser,
    verify_parser,
)
from disco_clip_ds.data.prep.download import PRESETS, parse_passthrough
from disco_clip_ds.testing.launch import REPO


@pytest.mark.parametrize(
    "script, args",
    [("relaion400m.sh", []), ("datacomp.sh", ["small"]), ("datacomp.sh", ["medium"]), ("cc3m.sh", ["GCC.tsv"])],
)
@pytest.mark.slow
def test_data_prep_scripts_run_through_with_valid_arguments(script, args, tmp_path):
    """Each data_prep script, with `disco-clip` replaced by a recorder: every call parses as our CLI does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "disco-clip"
    shim.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> "$CALLS"; printf "\\n" >> "$CALLS"\n')
    shim.chmod(0o755)
    (tmp_path / "GCC.tsv").write_text("a dog\thttp://example.invalid/a.jpg\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}
    script_path = REPO / "data_prep" / script
    subprocess.run(["bash", str(script_path), *args], cwd=tmp_path, env=env, check=True, timeout=30)
    calls = [line.split("\0")[:-1] for line in (tmp_path / "calls").read_text().splitlines() if line]
    assert [c[:2] for c in calls][-2:] == [["data", "download"], ["data", "verify"]]
    for call in calls:
        rest = call[2:]
        if call[1] == "download":
            known, unknown = download_parser().parse_known_args(rest)
            parse_passthrough(unknown)
            assert known.preset in PRESETS
        elif call[1] == "metadata":
            assert metadata_parser().parse_args(rest).pattern
        else:
            verify_parser().parse_args(rest)
    if script == "cc3m.sh":
        assert (tmp_path / "data/cc3m/metadata/cc3m.tsv").read_text().startswith("caption\turl\na dog")


@pytest.mark.slow
def test_datacomp_goes_on_with_embed_and_filter_when_a_teacher_is_named(tmp_path):
    """datacomp.sh with TEACHER set: after verify, `data embed` and `data filter` of the downloaded shards, each call
    parsing as our CLI does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "disco-clip"
    shim.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> "$CALLS"; printf "\\n" >> "$CALLS"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"), "TEACHER": "t"}
    script = REPO / "data_prep" / "datacomp.sh"
    subprocess.run(["bash", str(script), "small"], cwd=tmp_path, env=env, check=True, timeout=30)
    calls = [line.split("\0")[:-1] for line in (tmp_path / "calls").read_text().splitlines() if line]
    assert [c[:2] for c in calls][-3:] == [["data", "verify"], ["data", "embed"], ["data", "filter"]]
    embed, filtered = embed_parser().parse_args(calls[-2][2:]), filter_parser().parse_args(calls[-1][2:])
    assert embed.teacher == ["t"] and filtered.teacher == "t" and embed.shards == filtered.shards  # embed: an ensemble
    assert filtered.keep_fraction == 0.3 and filtered.output == "data/datacomp_small/clip_score"
