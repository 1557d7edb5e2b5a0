"""data/curate/runner.py: where the filter's tasks run. The pipe pool against the tasks' own results in task order
(tasks finishing in reverse), a task's error and a killed worker as one line; `--spark` and its refusals before any
work (an unreachable master in well under a second); the line a failed Spark job is reported by. The Spark runner's
runs are in tests/launched/test_spark.py."""

from __future__ import annotations

import os
import socket
import time

import pytest

from disco_clip_ds.commands.data import filter_main
from disco_clip_ds.data.curate import (
    pipeline,  # noqa: F401  (imported here, not inside the timed refusal)
    runner,
)
from disco_clip_ds.errors import DataError, UsageError, run_main

from unit.data.curate.pooltasks import crash, die, refuse, slow_square
from unit.data.curate.shardsets import embedded_shards


@pytest.mark.slow  # spawns worker processes
def test_the_pipe_pool_yields_in_task_order_and_raises_a_tasks_error_or_a_dead_worker_in_one_line():
    with runner.open_runner(processes=2) as pool:
        assert list(pool.map(slow_square, [(i, 6) for i in range(6)])) == [i * i for i in range(6)]
        results = pool.map(refuse, range(4))
        assert next(results) == 0 and next(results) == 1
        with pytest.raises(UsageError, match="^task 2 refused$"):  # the task's own error, as it was raised there
            next(results)
        pool.close()  # as a map abandoned with tasks in flight closes it
        with pytest.raises(RuntimeError, match="closed after a failed map"):  # no worker to wait on: no hang
            pool.map(refuse, [0])
    with runner.open_runner(processes=2) as pool:
        with pytest.raises(ZeroDivisionError, match="a bug in a task") as raised:
            list(pool.map(crash, range(3)))
        assert "crash" in str(raised.value.__cause__)  # the worker's traceback, chained
    with runner.open_runner(processes=2) as pool:
        with pytest.raises(DataError, match=r"a worker process died \(killed by SIGKILL\) in task 1; re-run"):
            list(pool.map(die, range(3)))


def test_one_process_runs_each_task_here_in_order():
    with runner.open_runner(processes=1) as pool:
        assert list(pool.map(lambda x: (x, os.getpid()), [3, 1])) == [(3, os.getpid()), (1, os.getpid())]


def test_what_spark_asks_for(monkeypatch):
    monkeypatch.delenv(runner.SPARK_SUBMIT, raising=False)
    assert runner.spark_master(None) is False  # no flag: no Spark
    assert runner.spark_master("") is None  # --spark alone: the active, spark-submit's or a local session
    assert runner.spark_master("spark://h:7077") == "spark://h:7077"
    monkeypatch.setenv(runner.SPARK_SUBMIT, "41234")  # under spark-submit: Spark, on its master
    assert runner.spark_master(None) is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_master_is_refused_at_once_in_one_line_before_any_output(tmp_path, capsys):
    embedded_shards(tmp_path / "in", 1, 2)
    port = _closed_port()
    argv = ["--shards", tmp_path / "in", "--output", tmp_path / "out", "--clip_score_min", 0.1]
    started = time.monotonic()
    code = run_main(filter_main, [str(a) for a in [*argv, "--spark", f"spark://127.0.0.1:{port}"]], "filter")
    assert time.monotonic() - started < 2.0  # a Spark driver alone retries its registration for a minute and more
    assert code == 1 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"filter: --spark spark://127.0.0.1:{port}: no Spark master answers at 127.0.0.1:{port} (Connection refused): "
        "start it, or give its URL as the master's log prints it (spark://HOST:PORT)"
    ]
    with pytest.raises(UsageError, match="give spark://HOST:PORT"):
        runner.check_spark("spark://nohost")


def test_a_failed_spark_job_is_told_by_the_tasks_python_error_else_spark_s_abort_line():
    python = (
        "An error occurred while calling o81.collectAndServe.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed 4 times\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "pipeline.py", line 9, in write_shard\n'
        "OSError: [Errno 28] No space left on device\n"
        "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n"
        "Caused by: java.io.EOFException: end of stream\n"
    )
    assert runner._spark_cause(RuntimeError(python)) == "OSError: [Errno 28] No space left on device"
    lost = "py4j.protocol.Py4JJavaError: x\n: org.apache.spark.SparkException: Job aborted due to executor loss\n"
    assert runner._spark_cause(RuntimeError(lost)) == (
        ": org.apache.spark.SparkException: Job aborted due to executor loss"
    )
