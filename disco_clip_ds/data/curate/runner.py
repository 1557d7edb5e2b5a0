"""Where `disco-clip data filter` runs its per-shard tasks (pipeline.py's scans, cluster assignments and writes).

A runner's `map(fn, tasks)` runs `fn(task)` once for each task and yields the results in task order; a task that
raises one of the project's errors (a UsageError, a DataError: a refusal that a retry cannot mend) has that error
raised here, as it was raised there. What a task does and returns is the caller's: a runner only moves it.

- `--processes 1`: every task in this process, in order.
- `--processes N`: N spawned worker processes, each fed its tasks over a pipe of its own. Not a
  `multiprocessing.Pool` or `concurrent.futures.ProcessPoolExecutor`: their queues synchronise through POSIX named
  semaphores (/dev/shm/sem.mp-*) that multiprocessing's resource tracker unlinks when the run ends, and a kill -9 of
  the process group kills the tracker with the run, leaving them behind. Processes and pipes leave nothing.
- `--spark`: one Spark task per task (a partition each), collected in task order. Spark runs a task again when its
  Python worker or executor is lost (up to spark.task.maxFailures attempts): the filter's tasks write their files
  atomically and keep a result already complete, so a task run twice writes the same bytes once. The tasks read and
  write the input and output folders by path: on a cluster those are on a filesystem every executor mounts alike.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import re
import signal
import socket
import traceback
from multiprocessing.connection import wait

from disco_clip_ds import faults
from disco_clip_ds.errors import DataError, DiscoClipError, UsageError

SPARK_SUBMIT = "PYSPARK_GATEWAY_PORT"  # set by spark-submit in the driver it starts
_PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): ")
_JVM_PACKAGES = ("org.", "java.", "scala.", "py4j.", "Caused by")
MASTER_CONNECT_S = 5.0  # a master that does not accept a connection by then is not reachable


class _Serial:
    """--processes 1: each task here, in order."""

    def map(self, fn, tasks):
        return map(fn, tasks)


class _RemoteTraceback(Exception):
    """A worker's traceback, chained to the error it raised, so that a bug shows where it happened."""


def _serve(conn) -> None:
    """A worker's loop: receive (fn, task), send back ('ok', result) or ('error', exception, traceback); None ends."""
    while True:
        try:
            item = conn.recv()
        except EOFError:  # the parent has gone
            return
        if item is None:
            return
        fn, task = item
        try:
            outcome = ("ok", fn(task))
        except Exception as error:
            outcome = ("error", error, traceback.format_exc())
        try:
            conn.send(outcome)
        except Exception as error:  # a result or an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(error).__name__}: {error}"), traceback.format_exc()))


class _Pipes:
    """--processes N: spawned workers (forking a process that holds faiss' and torch's threads can hang), each on a
    duplex pipe of its own; tasks go to whichever worker is free, results come back in task order."""

    def __init__(self, processes: int):
        context = multiprocessing.get_context("spawn")
        self.workers = []
        for _ in range(processes):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child,), daemon=True)
            process.start()
            child.close()  # the worker's end is the worker's alone: its death is then our end's EOF
            self.workers.append((process, parent))

    def map(self, fn, tasks):
        if not self.workers:  # closed by a map abandoned with tasks in flight: waiting on no worker would never end
            raise RuntimeError("the --processes pool was closed after a failed map")
        return self._map(fn, list(tasks))

    def _map(self, fn, tasks: list):
        pending, busy, done, next_out = iter(enumerate(tasks)), {}, {}, 0
        try:
            for _, conn in self.workers:
                self._give(conn, fn, pending, busy)
            while next_out < len(tasks):
                while next_out not in done:
                    for conn in wait(list(busy)):
                        index = busy.pop(conn)
                        done[index] = self._receive(conn, index)
                        self._give(conn, fn, pending, busy)
                yield _result(done.pop(next_out))
                next_out += 1
        finally:
            if busy:  # abandoned with tasks in flight (an error, or the caller stopped reading): no reuse
                self.close()

    @staticmethod
    def _give(conn, fn, pending, busy) -> None:
        index, task = next(pending, (None, None))
        if index is not None:
            conn.send((fn, task))
            busy[conn] = index

    def _receive(self, conn, index: int):
        try:
            return conn.recv()
        except EOFError:
            process = next(p for p, c in self.workers if c is conn)
            process.join(timeout=5)
            code = process.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise DataError(
                f"--processes: a worker process died ({how}) in task {index}; re-run the same command to resume"
            ) from None

    def close(self) -> None:
        for process, conn in self.workers:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
            conn.close()
        for process, _ in self.workers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.workers = []


class _Spark:
    """--spark: a Spark job per map, a partition per task; the project's errors come back as results (Spark would
    retry a task that raised them, and they would only be raised again), anything else fails the task (retried)."""

    def __init__(self, session):
        self.session = session

    def map(self, fn, tasks):
        from disco_clip_ds.data.prep.spark import is_spark_failure, jobs_drained_on_failure

        tasks = list(tasks)
        if not tasks:
            return iter(())
        context = self.session.sparkContext
        try:
            with jobs_drained_on_failure(self.session, what="disco-clip data filter"):
                outcomes = context.parallelize(tasks, len(tasks)).map(functools.partial(_spark_task, fn)).collect()
        except Exception as error:
            if not is_spark_failure(error):
                raise
            raise DataError(
                f"the Spark job failed: {_spark_cause(error)}; re-run the same command to resume"
            ) from error
        return (_result(outcome) for outcome in outcomes)


def _spark_task(fn, task):
    try:
        return ("ok", fn(task))
    except DiscoClipError as error:
        return ("error", error, traceback.format_exc())


def _result(outcome):
    if outcome[0] == "ok":
        return outcome[1]
    _, error, text = outcome
    if isinstance(error, DiscoClipError):
        raise error
    raise error from _RemoteTraceback(f"\n{text}")


def _spark_cause(error: Exception) -> str:
    """The line of a failed Spark job that says why: the task's last Python error line, else Spark's abort line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    python = [line for line in lines if _PYTHON_ERROR.match(line) and not line.startswith(_JVM_PACKAGES)]
    return (python[-1] if python else next((line for line in lines if "Job aborted" in line), lines[0]))[:400]


def spark_master(spark: str | None) -> str | None | bool:
    """What `--spark` asks for: False (no Spark), None (the active session's, spark-submit's or local[--processes]
    master) or a master URL. Under spark-submit the filter runs on Spark without the flag."""
    if spark is None:
        return None if SPARK_SUBMIT in os.environ else False
    return spark or None


def check_spark(master: str | None) -> None:
    """Refuse at once what cannot start: a spark:// master that no host of the URL answers (one line, in seconds, as
    a Spark driver would otherwise retry its registration for a minute and more), no pyspark, no Java 17+."""
    if master and master.startswith("spark://"):
        _check_reachable(master)
    from disco_clip_ds.data.prep.spark import check_spark as check_java

    check_java(master, flag="--spark", master_flag="--spark")


def _check_reachable(master: str) -> None:
    problems = []
    for address in master.removeprefix("spark://").split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--spark {master}: give spark://HOST:PORT (a standalone master's URL)")
        try:
            socket.create_connection((host, int(port)), timeout=MASTER_CONNECT_S).close()
            return
        except OSError as error:
            problems.append(f"{address} ({error.strerror or error})")
    raise DataError(
        f"--spark {master}: no Spark master answers at {', '.join(problems)}: start it, or give its URL as the "
        "master's log prints it (spark://HOST:PORT)"
    )


@contextlib.contextmanager
def open_runner(processes: int, spark: str | None | bool = False):
    """The runner for `--processes` and `--spark` (spark_master's value); torn down on exit (a Spark session this
    made is stopped, an active one left running)."""
    if spark is not False:
        from disco_clip_ds.data.prep.spark import spark_session

        conf = {f"spark.executorEnv.{faults.ENV}": os.environ[faults.ENV]} if os.environ.get(faults.ENV) else {}
        with spark_session(spark, processes, app="disco-clip data filter", conf=conf) as session:
            yield _Spark(session)
        return
    if processes == 1:
        yield _Serial()
        return
    pool = _Pipes(processes)
    try:
        yield pool
    finally:
        pool.close()
