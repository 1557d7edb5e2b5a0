"""data/prep/demo.py (through `disco-clip data demo`): an output folder that is a file, a foreign folder or the other
format's build is refused before any work."""

from __future__ import annotations


def test_output_that_is_a_file_or_a_foreign_folder_is_refused_before_any_work(tmp_path, capsys):
    from disco_clip_ds import cli

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    foreign = tmp_path / "photos"
    (foreign / "holiday").mkdir(parents=True)
    for output, message in ((a_file, "is a file"), (foreign, "holds holiday, which is not a demo build")):
        assert cli.main(["data", "demo", "--output", str(output)]) == 2
        assert message in capsys.readouterr().err
    assert a_file.read_text() == "mine" and [p.name for p in foreign.iterdir()] == ["holiday"]


def test_format_hf_and_shards_refuse_each_others_build(tmp_path, capsys):
    """A demo folder of one format is not rebuilt in the other (the two would mix in train/ and eval/); a shards
    build, whose train/ holds img2dataset's NNNNN.parquet beside the tars, stays one to resume."""
    from disco_clip_ds import cli
    from disco_clip_ds.data.prep.demo import check_output_folder

    shards, hf = tmp_path / "shards", tmp_path / "hf"
    (shards / "train").mkdir(parents=True)
    (shards / "train" / "00000.tar").write_bytes(b"")
    (shards / "train" / "00000.parquet").write_bytes(b"")
    (hf / "eval").mkdir(parents=True)
    (hf / "eval" / "test-00000-of-00002.parquet").write_bytes(b"")
    assert cli.main(["data", "demo", "--format", "hf", "--output", str(shards)]) == 2
    assert "holds a --format shards demo: give another folder for hf" in capsys.readouterr().err
    assert cli.main(["data", "demo", "--output", str(hf)]) == 2
    assert "holds a --format hf demo: give another folder for shards" in capsys.readouterr().err
    check_output_folder(shards, "shards")  # no error: its own earlier output
    check_output_folder(hf, "hf")


def test_caption_noise_outside_0_to_1_is_refused(tmp_path, capsys):
    from disco_clip_ds import cli

    for noise in ("1", "-0.1"):
        assert cli.main(["data", "demo", "--caption_noise", noise, "--output", str(tmp_path / "demo")]) == 2
        assert (
            f"--caption_noise {noise}: give a fraction of the captions, at least 0 and below 1"
            in capsys.readouterr().err
        )
    assert not (tmp_path / "demo").exists()
