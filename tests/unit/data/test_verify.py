"""data/prep/verify.py (through `disco-clip data verify`): an undecodable image is reported."""

from __future__ import annotations

from disco_clip_ds.commands.data import (
    verify_main,
)
from disco_clip_ds.errors import run_main
from disco_clip_ds.testing.images import image_bytes


def test_verify_reports_an_undecodable_image(tmp_path, capsys):
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        sink.write({"__key__": "a", "jpg": image_bytes("JPEG", "RGB", (8, 8), (1, 2, 3)), "txt": "one two"})
        sink.write({"__key__": "b", "jpg": b"not a jpeg", "txt": "three"})
    assert run_main(verify_main, [str(tmp_path)], "disco-clip data verify") == 1
    err = capsys.readouterr().err
    assert "b.jpg: cannot decode" in err
