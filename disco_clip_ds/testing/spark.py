"""A Spark standalone cluster on 127.0.0.1 for tests and benchmarks: a master and N workers started from this venv's
pyspark (`spark-class`, as data_prep/relaion2b_spark.sh starts them on a cluster), their executors' Python workers
running this interpreter."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from disco_clip_ds.testing.ranks import free_port


def cluster_env(work: Path) -> dict[str, str]:
    """The environment of the daemons (and of a driver that joins them): Spark found through pyspark, loopback only,
    Python workers on this interpreter; every JVM (daemons, executors, driver) on the JIT's first tier and the serial
    collector, as short-lived JVMs on a small machine spend most of their start-up CPU in the optimising compiler and
    the parallel collector's threads."""
    import pyspark

    return {
        **os.environ,
        "JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        "SPARK_HOME": str(Path(pyspark.__file__).parent),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(work),
    }


def wait_for_log(path: Path, text: str, seconds: float, count: int = 1) -> None:
    """Wait until `text` appears `count` times in the log at `path`; a TimeoutError with the log's tail otherwise."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text(errors="replace").count(text) >= count:
            return
        time.sleep(0.2)
    tail = path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"
    raise TimeoutError(f"'{text}' not {count} time(s) in {path} after {seconds}s:\n{tail}")


@contextlib.contextmanager
def standalone_cluster(
    folder: Path, workers: int = 1, cores: int = 2, memory: str = "2G", env: dict[str, str] | None = None
) -> Iterator[str]:
    """A master and `workers` workers (`cores` and `memory` each) started at once, their logs and work folders under
    `folder` (the executors' under folder/work/app-*/ID); yields the master URL once every worker registered, and
    stops the daemons (and so their executors) at the end. `env`: more variables for the daemons and executors."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    master = f"spark://127.0.0.1:{port}"
    daemon_env = {**cluster_env(folder / "work"), **(env or {})}
    spark_class = str(Path(sys.executable).parent / "spark-class")
    commands = [["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port)]]
    commands += [["org.apache.spark.deploy.worker.Worker", "--cores", str(cores), "--memory", memory, master]] * workers
    daemons = []
    try:
        for i, command in enumerate(commands):  # a worker retries its registration until the master is up
            with open(folder / f"daemon{i}.log", "w") as log:
                daemons.append(
                    subprocess.Popen(
                        [spark_class, *command, "--webui-port", str(free_port())],
                        env=daemon_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        wait_for_log(folder / "daemon0.log", "Registering worker", 240, count=workers)
        yield master
    finally:
        for proc in reversed(daemons):
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def executor_folders(folder: Path) -> list[Path]:
    """The folders of the executors a `standalone_cluster` in `folder` launched (one per executor, replacements of
    lost ones included)."""
    return sorted((folder / "work").glob("app-*/*/"))
