"""The one reader of the user's text: files the user names (task lists, class names, templates, arguments files,
JSON configs) and text fields inside data (an eval shard's captions).

Text is UTF-8 (a byte-order mark is dropped, as Notepad writes one). Anything else is one line of the project's
errors naming the file or the sample, the line and the byte, and saying what to do, never a `UnicodeDecodeError`
traceback: `UsageError` for a file the user named (exit 2), `DataError` (or the class the caller picks) for text
inside data.
"""

from __future__ import annotations

import os
from pathlib import Path

from disco_clip_ds.errors import DiscoClipError, UsageError

BOM = "\ufeff"


def decode_text(data: bytes, where: str, error: type[DiscoClipError] = UsageError) -> str:
    """`data` decoded as UTF-8 (a leading byte-order mark dropped); `error` naming `where`, the line and the byte
    when it is not UTF-8."""
    try:
        return data.decode("utf-8").removeprefix(BOM)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(
            f"{where}: line {line} is not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}): save it as UTF-8"
        ) from None


def read_text(path: str | os.PathLike, what: str = "", error: type[DiscoClipError] = UsageError) -> str:
    """The text of the file at `path` (`decode_text`); a missing or unreadable file is `error` too. `what` prefixes
    the file in the message: the flag or field that named it (`--tasks`, `class names file`)."""
    shown = str(path) if str(path).isprintable() else repr(str(path))  # a newline in a name would break the line
    where = f"{what} {shown}".strip()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise error(f"{where}: no such file") from None
    except IsADirectoryError:
        raise error(f"{where}: a folder, not a text file") from None
    except OSError as e:
        raise error(f"{where}: not readable ({e.strerror or type(e).__name__})") from None
    return decode_text(data, where, error)


def read_lines(path: str | os.PathLike, what: str = "", error: type[DiscoClipError] = UsageError) -> list[str]:
    """The non-blank lines of a text file, stripped (class names, templates): `read_text`'s checks and errors."""
    return [line.strip() for line in read_text(path, what, error).splitlines() if line.strip()]
