"""data/prep/demo.py (through `disco-clip data demo`): an output folder that is a file, a foreign folder or the other
format's build is refused before any work; the synthetic captions added to a training shard, and training's stream
unaffected by them."""

from __future__ import annotations

import tarfile


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


def _digit_shard(path, labels, captions):
    """An img2dataset-like training shard (key.jpg/.txt/.json, the json holding the label), members sorted as the
    download leaves them."""
    import json

    import webdataset as wds

    from disco_clip_ds.data.prep.outputs import canonicalize_tar
    from disco_clip_ds.testing.images import image_bytes

    with wds.TarWriter(str(path)) as sink:
        for i, (label, caption) in enumerate(zip(labels, captions)):
            color = (20 * i, 255 - 20 * i, 7 * label)
            sink.write(
                {
                    "__key__": f"00000{i:04d}",
                    "jpg": image_bytes("JPEG", "RGB", (40 + i, 50), color),
                    "txt": caption.encode(),
                    "json": json.dumps({"label": label, "source_index": 100 + i}).encode(),
                }
            )
    canonicalize_tar(path)


def test_synthetic_captions_are_extra_members_naming_the_true_digit(tmp_path):
    """Each sample gains key.syn0.txt and key.syn1.txt, written out by hand here: the digit of its label even where its
    real caption names another (caption noise), members sorted, the real members' bytes untouched; a second call
    leaves the shard's bytes as they are (a resumed build)."""
    from disco_clip_ds.data.prep.demo import add_synthetic_captions
    from disco_clip_ds.data.streams.tar_samples import raw_samples

    labels = [3, 7, 0]
    captions = ["a photo of the number three.", "a photo of the number two.", "handwritten digit 0"]  # 7 mislabelled
    shard = tmp_path / "00000.tar"
    _digit_shard(shard, labels, captions)
    before = list(raw_samples(str(shard)))
    add_synthetic_captions(shard)
    after = list(raw_samples(str(shard)))
    want = [
        ("a handwritten digit 3", "a black and white picture of the digit three"),
        ("a handwritten digit 7", "a black and white picture of the digit seven"),
        ("a handwritten digit 0", "a black and white picture of the digit zero"),
    ]
    assert [(s["syn0.txt"].decode(), s["syn1.txt"].decode()) for s in after] == want
    assert [{k: v for k, v in s.items() if not k.startswith("syn")} for s in after] == before
    with tarfile.open(shard) as tar:
        names = tar.getnames()
        assert names == sorted(names) and len({m.mtime for m in tar.getmembers()}) == 1
    written = shard.read_bytes()
    add_synthetic_captions(shard)
    assert shard.read_bytes() == written


def test_training_reads_the_real_caption_of_a_shard_with_synthetic_captions(tmp_path):
    """The training stream over the shard with synthetic captions yields what it yields without them: the same
    pixels and the real caption (key.txt), sample for sample."""
    import shutil

    import torch

    from disco_clip_ds.data.prep.demo import add_synthetic_captions
    from disco_clip_ds.data.streams.shards import ShardStream

    captions = ["a photo of the number three.", "a photo of the number two.", "handwritten digit 0"]
    plain, synthetic = tmp_path / "plain" / "00000.tar", tmp_path / "syn" / "00000.tar"
    plain.parent.mkdir()
    synthetic.parent.mkdir()
    _digit_shard(plain, [3, 7, 0], captions)
    shutil.copy(plain, synthetic)
    add_synthetic_captions(synthetic)

    def one_pass(url):
        stream = iter(ShardStream([str(url)], 32, shuffle_buffer=2, seed=5))
        return [next(stream) for _ in range(3)]

    for (pixels, caption, _), (pixels_syn, caption_syn, _) in zip(one_pass(plain), one_pass(synthetic), strict=True):
        assert caption_syn == caption and caption in captions
        assert torch.equal(pixels_syn, pixels)
    assert sorted(c for _, c, _ in one_pass(synthetic)) == sorted(captions)
