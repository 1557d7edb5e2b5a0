"""train/args.py's readers of the user's files: an arguments file and a JSON that a flag names are read by the one
text reader, and every problem with them is one line naming the file (and the line)."""

from __future__ import annotations

import pytest

from disco_clip_ds.errors import UsageError
from disco_clip_ds.train.args import parse_args, read_json


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("args.yaml", b"output_dir: caf\xe9\n", "arguments file {path}: line 1 is not UTF-8 text (byte 0xe9 at column"),
        ("args.json", b'{\n"output_dir":\n "\xff"}', "arguments file {path}: line 3 is not UTF-8 text (byte 0xff"),
        ("args.yaml", b"output_dir: [unclosed\nseed: 1\n", "{path} is not a readable arguments file: while parsing"),
        ("none.yaml", None, "arguments file {path}: no such file"),
    ],
)
def test_an_arguments_file_that_cannot_be_read_is_one_line(tmp_path, name, data, message):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(UsageError) as caught:
        parse_args([str(path)])
    assert str(caught.value).startswith(message.format(path=path)) and "\n" not in str(caught.value)


def test_a_json_a_flag_names_is_read_as_utf8_text_or_one_line(tmp_path):
    (tmp_path / "c.json").write_bytes('{"name": "café"}'.encode())
    assert read_json("--model_config", str(tmp_path / "c.json")) == {"name": "café"}
    (tmp_path / "c.json").write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(
        UsageError, match=r"^--model_config .*c.json: line 1 is not UTF-8 text \(byte 0xe9 at column 14\)"
    ):
        read_json("--model_config", str(tmp_path / "c.json"))
