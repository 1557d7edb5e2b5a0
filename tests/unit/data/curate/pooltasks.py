"""Tasks for the pipe pool's test (test_runner.py), in a module of their own: a spawned worker imports the module of
the task it runs, and this one imports nothing heavy."""

from __future__ import annotations

import os
import signal
import time

from disco_clip_ds.errors import UsageError


def slow_square(task: tuple[int, int]) -> int:
    value, of = task
    time.sleep(0.05 * (of - value))  # the first task ends last
    return value * value


def refuse(value: int) -> int:
    if value == 2:
        raise UsageError(f"task {value} refused")
    return value


def crash(value: int) -> int:
    if value == 1:
        raise ZeroDivisionError("a bug in a task")
    return value


def die(value: int) -> int:
    if value == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return value
