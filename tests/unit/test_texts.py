"""texts.py, the one reader of the user's text: UTF-8 or one line naming the file (or sample), the line and the
byte; hand-checked cases, then any bytes at all against an independent reference (each line decoded on its own)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disco_clip_ds.errors import DataError, UsageError
from disco_clip_ds.texts import decode_text, read_lines, read_text


def test_utf8_text_and_its_lines(tmp_path):
    path = tmp_path / "names.txt"
    path.write_bytes("\ufeffcafé\n\n  two words \r\n\t\n☃".encode())  # a byte-order mark, blank lines, CRLF
    assert read_text(path) == "café\n\n  two words \r\n\t\n☃"
    assert read_lines(path) == ["café", "two words", "☃"]
    assert read_lines(tmp_path / "names.txt", "x") == read_lines(str(path))


@pytest.mark.parametrize(
    "data, message",
    [
        (b"ok\ncaf\xe9\n", "--classnames F: line 2 is not UTF-8 text (byte 0xe9 at column 4): save it as UTF-8"),
        (b"\xff", "--classnames F: line 1 is not UTF-8 text (byte 0xff at column 1): save it as UTF-8"),
        (b"a\nb\nab\xc3(", "--classnames F: line 3 is not UTF-8 text (byte 0xc3 at column 3): save it as UTF-8"),
        ("\ufeff".encode("utf-16"), "--classnames F: line 1 is not UTF-8 text (byte 0xff at column 1)"),
    ],
)
def test_text_that_is_not_utf8_is_one_line_naming_the_line_and_byte(tmp_path, data, message):
    (tmp_path / "F").write_bytes(data)
    with pytest.raises(UsageError) as caught:
        read_text(tmp_path / "F", "--classnames")
    assert str(caught.value).replace(str(tmp_path / "F"), "F").startswith(message)


def test_missing_folder_and_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^--tasks .*none.yml: no such file$"):
        read_text(tmp_path / "none.yml", "--tasks")
    with pytest.raises(UsageError, match=r": a folder, not a text file$"):
        read_lines(tmp_path)
    with pytest.raises(UsageError) as caught:  # a newline in the name would break the one line: shown escaped
        read_text(tmp_path / "a\nb<i>.txt", "--templates")
    assert str(caught.value) == f"--templates {str(tmp_path / 'a') + chr(10) + 'b<i>.txt'!r}: no such file"
    with pytest.raises(DataError, match=r"^sample s1, its .txt: line 1 is not UTF-8"):  # text inside data
        decode_text(b"\x80", "sample s1, its .txt", DataError)


def _reference(data: bytes) -> tuple[int, int] | None:
    """(line, column) of the first byte that is not UTF-8, found line by line (no UTF-8 sequence holds a newline
    byte): the longest prefix of the first bad line that decodes ends just before it; None when all decode."""
    for number, line in enumerate(data.split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            good = max(j for j in range(len(line) + 1) if _decodes(line[:j]))
            return number, good + 1
    return None


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


PIECES = st.sampled_from(
    [b"\n", b"\r\n", b"\xef\xbb\xbf", "é".encode(), "☃".encode(), b"\xc3", b"\xe9", b"\xff", b"\x00"]
)
BYTES = st.lists(st.one_of(PIECES, st.binary(max_size=6), st.text(max_size=6).map(str.encode)), max_size=10)


@settings(max_examples=50, derandomize=True, deadline=None)
@given(BYTES.map(b"".join))
def test_any_bytes_are_text_or_one_line_naming_the_right_line_and_column(data):
    expected = _reference(data)
    try:
        text = decode_text(data, "F")
    except UsageError as error:
        assert expected is not None, data
        line, column = expected
        byte = data.split(b"\n")[line - 1][column - 1]
        assert (
            str(error) == f"F: line {line} is not UTF-8 text (byte 0x{byte:02x} at column {column}): save it as UTF-8"
        )
        assert "\n" not in str(error)
    else:
        assert expected is None and text == data.decode("utf-8").removeprefix("\ufeff")
