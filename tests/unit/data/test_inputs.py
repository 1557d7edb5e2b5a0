"""data/prep/inputs.py: a preset's input files, their columns and the shards they make."""

from __future__ import annotations

from disco_clip_ds.data.prep.download import PRESETS
from disco_clip_ds.data.prep.inputs import expected_shards, input_columns


def test_cc_preset_reads_a_tsv_header(tmp_path):
    tsv = tmp_path / "cc3m.tsv"
    tsv.write_text("caption\turl\na dog\thttp://127.0.0.1:9/a.jpg\na cat\thttp://127.0.0.1:9/b.jpg\n")
    preset = PRESETS["cc"]
    assert input_columns(tsv, preset.input_format) == ["caption", "url"]
    assert expected_shards([tsv], preset.input_format, samples_per_shard=1) == 2
