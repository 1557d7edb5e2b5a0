"""The package's errors and the one map from an error to an exit code.

Library code raises a `DiscoClipError` subclass whose message says, in one line, what went wrong and what to do.
Every command (`disco-clip ...` and `python -m disco_clip_ds.<module>`) runs through `run_main`, which prints that
line and returns the error's exit code:

    0    done (or already finished)
    1    a run that failed (a full disk, a corrupt input, a failed download, a loss that is not finite, a lost peer)
    2    bad usage: what was passed cannot work (argparse's own code)
    75   stopped by a signal after a complete checkpoint: re-run the same command to resume (EX_TEMPFAIL)
    143  a training rank whose launcher died (as if terminated by SIGTERM along with it)

Any other exception is a bug: it propagates with its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
EXIT_LAUNCHER_GONE = 143


class DiscoClipError(Exception):
    """Base of the package's errors; the message says what to fix."""

    exit_code = EXIT_FAILED


class UsageError(DiscoClipError, ValueError):
    """Arguments or files that cannot work together."""

    exit_code = EXIT_USAGE


class PlanConfigError(UsageError):
    """A DeepSpeed config or planner input whose numbers do not add up; the message lists every problem."""


class AccumulationError(UsageError):
    """Settings under which contrastive accumulation cannot be exact."""


class DataError(DiscoClipError):
    """Data that cannot be read or prepared: unreadable inputs, missing columns, a download or shard that failed."""


class CheckpointError(DiscoClipError, RuntimeError):
    """A checkpoint that could not be written or read; the message says what is still intact."""


class TrainingDiverged(DiscoClipError, ArithmeticError):
    """A training step whose loss or gradient norm is not finite; the run stopped before saving that step."""


class ExportError(DiscoClipError):
    """A checkpoint or output folder that cannot be exported or pushed, with what to do about it."""


class PeerError(DiscoClipError):
    """The other ranks could not be reached (no master, a node that never joined) or one stopped answering within
    --ddp_timeout; the message says what to check."""


class Preempted(DiscoClipError):
    """Training stopped on a signal after saving a complete checkpoint; the message says how to resume."""

    exit_code = EXIT_PREEMPTED


def say(line: str) -> None:
    """Write `line` to stderr in one write: print() writes the text and its newline apart, and the ranks of a run
    share one pipe, so two ranks' lines would run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None, prog: str) -> int:
    """Run a command's `main(argv)`; a `DiscoClipError` becomes one line on stderr and its exit code."""
    try:
        return main(argv) or 0
    except DiscoClipError as error:
        say(f"{prog}: {error}")
        return error.exit_code
