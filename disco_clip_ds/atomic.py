"""The package's one atomic file write: a file appears whole or not at all, and two writers of one path never take
each other's temporary file.

Each write goes to a temporary file of its own (`tempfile.mkstemp` in the target's folder: a unique name, on the
target's filesystem so that the rename is atomic), which is flushed (closed: its bytes are with the kernel, so a
killed process leaves the old file or the new one) and then renamed onto the target (`os.replace`). `durable=True`
also syncs it to the disk first, so that a power loss or a kernel crash cannot leave the new name on empty blocks:
for the mark that says other files are complete (a checkpoint's manifest). Elsewhere a torn file after such a crash
is found by the reader's checksum (sidecars, the filter's shards) and the sync's cost (milliseconds a file) is not
paid. A fixed temporary name (`.NAME.tmp`) is what this replaces: two writers of one path then rename
each other's file away (a `FileNotFoundError`, or one writer's bytes under the other's name). Two writers of one path
each publish a complete file; the last rename wins. A write that fails or is interrupted by an exception removes its
temporary file; one killed outright leaves it (`.NAME.XXXXXXXX.tmp`, which `is_leftover` recognises and a folder's
lock holder removes: distributed/runlock.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

SUFFIX = ".tmp"
_LEFTOVER = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")  # mkstemp's eight random characters
# The mode a plain open() gives a new file (0666 less the umask); mkstemp makes 0600, and the files written here are
# for others to read as any other output. Read once, at import (reading the umask means setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextlib.contextmanager
def staged(path: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """A temporary path of its own beside `path` to write (by any writer: a library that takes a file name, a tar
    writer, ...); when the block ends without an exception it is renamed onto `path` (`durable`: synced to the disk
    first), else removed. The target's folder is created if needed."""
    stage = Stage(path, durable)
    try:
        yield stage.tmp
    except BaseException:
        stage.discard()
        raise
    stage.commit()


class Stage:
    """A unique temporary file beside `path` (`tmp`), for a writer that outlives one block (a parquet written a row
    group at a time): `commit` renames it onto `path` (`durable`: synced to the disk first); `discard` removes it."""

    def __init__(self, path: str | os.PathLike, durable: bool = False):
        self.path, self.durable = Path(path), durable
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=SUFFIX, dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(name)

    def commit(self) -> None:
        """Give the (closed) temporary file a plain file's mode and rename it onto `path` (`durable`: after syncing it
        to the disk)."""
        try:
            if self.durable:
                fd = os.open(self.tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)  # the rename must not reach the disk before the bytes do
                finally:
                    os.close(fd)
            os.chmod(self.tmp, 0o666 & ~_UMASK)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove the temporary file (the target is left as it was)."""
        self.tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes, durable: bool = False) -> None:
    """Write `data` to `path` atomically (see the module's docstring)."""
    with staged(path, durable) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str, durable: bool = False) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    write_bytes(path, text.encode(), durable)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write `obj` as indented JSON (UTF-8, non-ASCII kept) to `path` atomically."""
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def is_leftover(name: str) -> bool:
    """Whether a file name is one of `staged`'s temporary files (left by a writer killed before its rename)."""
    return bool(_LEFTOVER.match(name))


def remove_leftovers(folder: str | os.PathLike) -> None:
    """Remove the temporary files killed writers left in `folder` (none of its writers may be running)."""
    for leftover in (p for p in Path(folder).iterdir() if is_leftover(p.name)):
        leftover.unlink(missing_ok=True)
