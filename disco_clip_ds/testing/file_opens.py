"""Which files a piece of code opens, as Python's audit hook sees them (the "open" event of builtins.open, io.open,
os.open and pathlib's readers; not a file a C or Rust extension opens itself): for tests that must show that a file
was not read.

    with recorded_opens() as opened:
        ...
    assert str(weights) not in opened
"""

from __future__ import annotations

import contextlib
import os
import sys

_recording: list[list[str]] = []
_installed = False


def _hook(event: str, args: tuple) -> None:
    if event == "open" and _recording and isinstance(args[0], (str, bytes, os.PathLike)):
        for seen in _recording:
            seen.append(os.path.abspath(os.fsdecode(args[0])))


@contextlib.contextmanager
def recorded_opens():
    """A list that collects the absolute path of every file opened in this process while the block runs. (An audit
    hook cannot be removed: it is installed once, and does nothing while no block records.)"""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    seen: list[str] = []
    _recording.append(seen)
    try:
        yield seen
    finally:
        _recording.remove(seen)
