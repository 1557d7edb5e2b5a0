"""`--distributor pyspark`: the Java check before any work, and the Spark session img2dataset's distributor uses."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from disco_clip_ds.data.prep.fetch import environ
from disco_clip_ds.errors import DataError, UsageError

MIN_JAVA = 17  # pyspark 4.x runs on Java 17 or newer
_JAVA_INSTALL = f"install a Java {MIN_JAVA}+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)"


def java_problem(env: dict | None = None) -> str | None:
    """Why pyspark cannot start a JVM under `env` (default os.environ), or None when it can.

    Finds java as pyspark's `spark-class` launcher does: `$JAVA_HOME/bin/java`, else `java` on PATH.
    """
    env = os.environ if env is None else env
    if env.get("JAVA_HOME"):
        java = str(Path(env["JAVA_HOME"]) / "bin" / "java")
        where = f"JAVA_HOME={env['JAVA_HOME']}"
        if not os.access(java, os.X_OK):
            return f"{where} has no bin/java: {_JAVA_INSTALL} and point JAVA_HOME at it"
    else:
        java = shutil.which("java", path=env.get("PATH", ""))
        where = "PATH"
        if java is None:
            return f"no java on PATH and JAVA_HOME is unset: {_JAVA_INSTALL}, or set JAVA_HOME"
    try:
        out = subprocess.run([java, "-version"], check=False, capture_output=True, text=True, timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{java} (from {where}) does not run ({err}): {_JAVA_INSTALL}"
    # `java -version` prints e.g. `openjdk version "17.0.15" 2025-04-15` or `java version "1.8.0_392"`
    found = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if found is None:
        return f"cannot read the version of {java} (from {where}): {_JAVA_INSTALL}"
    major = int(found.group(2) if found.group(1) == "1" else found.group(1))
    if major < MIN_JAVA:
        return f"{java} (from {where}) is Java {major}; pyspark 4 needs Java {MIN_JAVA}+: {_JAVA_INSTALL}"
    return None


def _active_spark_session(flag: str):
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise DataError(f"{flag} needs pyspark: pip install 'pyspark>=4.0,<4.4' (and a Java 17+ runtime)") from None
    return SparkSession.getActiveSession()


def check_spark(master: str | None, flag: str = "--distributor pyspark", master_flag: str = "--spark_master") -> None:
    """Fail before any work when `flag` (a verb's way to ask for Spark) cannot start: no pyspark, no (recent) Java,
    or an active session on another master than `master_flag` asks for."""
    active = _active_spark_session(flag)
    if active is not None:  # a JVM already runs: nothing to check, but the master must be the one asked for
        if master and active.sparkContext.master != master:
            raise UsageError(
                f"a Spark session with master {active.sparkContext.master} is already active; "
                f"{master_flag} {master} cannot apply: drop the flag or stop that session"
            )
        return
    problem = java_problem()
    if problem:
        raise DataError(f"{flag} needs Java {MIN_JAVA}+; {problem}")


def is_spark_failure(err: Exception) -> bool:
    try:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException
    except ImportError:
        return False
    return isinstance(err, (Py4JError, PySparkException))


@contextlib.contextmanager
def spark_session(master: str | None, processes: int, app: str = "disco-clip data download", conf: dict | None = None):
    """The Spark session img2dataset's pyspark distributor will find (it uses the active one), or the filter's (`app`
    names it; `conf`: Spark settings for a session made here).

    Reuses an active session (a notebook's, or one made by a caller) and leaves it running. Otherwise
    creates one and stops it on exit: on `master` when given; on the master `spark-submit` chose when
    run under it; else `local[processes]`. img2dataset would create the local session itself, but with
    the `python3` on PATH for its Python workers, which need not have this package: the workers must
    run this interpreter, which imports the deadline-bounded fetch. On a cluster the workers' Python
    comes from the shipped environment (`spark.pyspark.python`, see data_prep/README.md).
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    builder = SparkSession.builder.appName(app)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # spark-submit sets that, and the master
        master = f"local[{processes}]"
    if master:
        builder = builder.master(master)
    local = bool(master and master.startswith("local"))
    if local:
        # The driver JVM only relays (status, shard) pairs; images go from Python workers to disk.
        builder = builder.config("spark.driver.memory", "1g")
    # The Python-side SparkContext takes its workers' interpreter from PYSPARK_PYTHON when it starts
    # (default `python3` on PATH; the spark.pyspark.python conf is read by spark-submit only).
    with environ(PYSPARK_PYTHON=sys.executable) if local else contextlib.nullcontext():
        session = builder.getOrCreate()
    context = session.sparkContext
    print(f"spark: master {context.master}, default parallelism {context.defaultParallelism}", flush=True)
    try:
        yield session
    finally:
        session.stop()


@contextlib.contextmanager
def jobs_drained_on_failure(session, timeout_s: float = 120.0, what: str = "disco-clip data download"):
    """Run the Spark jobs started inside as one job group; when they fail, return only once none of their
    tasks still runs.

    A job aborts on its first lost task while its other tasks run on: each finishes its shard, or has
    its Python worker killed `spark.python.task.killTimeout` after the abort. Were the failed run to
    return at once, a re-run could start downloading a shard that a stray worker is still writing, and
    the two writers would interleave in one tar. On success every task has ended already. `what`: the
    verb, the job group's description.
    """
    context = session.sparkContext
    group = f"{what.replace('disco-clip data ', 'disco-clip-')}-{uuid.uuid4().hex[:12]}"
    keys = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    before = {key: context.getLocalProperty(key) for key in keys}
    # interruptOnCancel stays False: an interrupted task thread would end while its Python worker, no
    # longer watched, writes on; uninterrupted, the task ends only when its worker has ended or been killed
    context.setJobGroup(group, what, interruptOnCancel=False)
    try:
        yield
    except Exception:
        running = _wait_for_tasks(context, group, timeout_s)
        if running:
            print(
                f"warning: {running} task(s) of the failed Spark job still run after {timeout_s:.0f}s; "
                "let them end before re-running into the same --output",
                file=sys.stderr,
            )
        raise
    finally:
        for key, value in before.items():
            context.setLocalProperty(key, value)


def _wait_for_tasks(context, group: str, timeout_s: float) -> int:
    """Poll Spark's status tracker until no task of `group` runs; return how many still do at the timeout."""
    tracker = context.statusTracker()
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [info for info in map(tracker.getJobInfo, tracker.getJobIdsForGroup(group)) if info is not None]
        stages = [stage for job in jobs for stage in job.stageIds]
        running = sum(info.numActiveTasks for info in map(tracker.getStageInfo, stages) if info is not None)
        if running == 0 or time.monotonic() > deadline:
            return running
        time.sleep(0.2)
