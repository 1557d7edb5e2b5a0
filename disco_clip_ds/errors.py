"""One error class per layer. Library code raises these; only the CLI turns them into exit codes
(2: bad usage, what the user passed cannot work; 1: a run that failed)."""

from __future__ import annotations


class DiscoClipError(Exception):
    """Base of the package's errors; the message says what to fix."""

    exit_code = 1


class UsageError(DiscoClipError, ValueError):
    """Arguments or files that cannot work together (exit code 2)."""

    exit_code = 2


class DataError(DiscoClipError):
    """Data preparation: unreadable inputs, missing columns, a download or shard that failed."""


class ExportError(DiscoClipError):
    """A checkpoint or output folder that cannot be exported or pushed, with what to do about it."""
