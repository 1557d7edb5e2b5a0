"""`data download --distributor pyspark` in Spark local mode, against the loopback image server.

The reference is the multiprocessing path on the same input: the Spark run must give the same bytes,
the same failures by reason, and keep the per-image deadline inside its executors' Python workers.
One local Spark session serves the in-process runs; the killed run is a CLI subprocess with its own.
`data filter --spark` runs on that session and on a standalone master with 2 workers (testing/spark.py), against
the one-machine filter.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from disco_clip_ds.commands.data import (
    download_main,
    download_parser,
    filter_main,
    metadata_parser,
    verify_main,
)
from disco_clip_ds.data.prep.download import parse_passthrough
from disco_clip_ds.data.prep.spark import java_problem, jobs_drained_on_failure, spark_session
from disco_clip_ds.errors import UsageError, run_main
from disco_clip_ds.testing.download import download_args, write_url_list
from disco_clip_ds.testing.images import image_bytes
from disco_clip_ds.testing.imageserver import ImageServer
from disco_clip_ds.testing.launch import REPO
from disco_clip_ds.testing.spark import cluster_env, executor_folders, standalone_cluster

from unit.data.curate.shardsets import embedded_shards, smooth_jpeg

JAVA_PROBLEM = java_problem()
needs_java = pytest.mark.skipif(JAVA_PROBLEM is not None, reason=f"no usable Java for Spark: {JAVA_PROBLEM}")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(480),
]  # a hung JVM fails the test instead of holding CI (bound for a loaded machine)

DEADLINE = 3
TRICKLE = 0.2  # seconds per byte: the trickled image alone would take minutes without the deadline
SHARD = 4


# zero bytes after the JPEG's end marker make the trickle long (decoders ignore them; it never completes anyway)
TRICKLE_BODY = image_bytes("JPEG", "RGB", (200, 200), (1, 2, 3)) + bytes(4000)
# path, server behaviour, caption: good images and the hostile cases, interleaved across shards
ROUTES = [
    ("/red.jpg", dict(body=image_bytes("JPEG", "RGB", (90, 60), (200, 30, 30))), "a red jpeg"),
    ("/gone.jpg", dict(status=404), "gone"),
    ("/wide.png", dict(body=image_bytes("PNG", "RGB", (120, 40), (20, 40, 220)), content_type="image/png"), "wide"),
    ("/hang.jpg", dict(hang=True), "never answers"),
    ("/grey.jpg", dict(body=image_bytes("JPEG", "L", (50, 50), 90)), ""),
    ("/error.jpg", dict(status=500), "server error"),
    ("/rgba.png", dict(body=image_bytes("PNG", "RGBA", (40, 40), (240, 200, 10, 255))), "naïve café 🙂"),
    ("/trickle.jpg", dict(body=TRICKLE_BODY, trickle=TRICKLE), "trickles"),
    ("/corrupt.jpg", dict(body=b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4), "corrupt"),
    ("/late.jpg", dict(body=image_bytes("JPEG", "RGB", (64, 64), (0, 90, 0)), delay=0.2), "late"),
    ("/tall.jpg", dict(body=image_bytes("JPEG", "RGB", (30, 90), (30, 160, 60))), None),
    ("/gone2.jpg", dict(status=404), "gone too"),
    ("/big.jpg", dict(body=image_bytes("JPEG", "RGB", (400, 300), (120, 0, 160))), "big"),
    ("/tiny.png", dict(body=image_bytes("PNG", "L", (6, 6), 200)), "tiny"),
]
N_SHARDS = -(-len(ROUTES) // SHARD)
EXPECTED_REASONS = {
    "HTTP Error 404: Not Found": 2,
    "HTTP Error 500: Internal Server Error": 1,
    "timed out": 1,
    f"download exceeded the {DEADLINE}s deadline": 1,
    "Image decoding error": 1,
}


@pytest.fixture(scope="session")
def spark():
    """One local Spark session (local[2]) for the in-process runs, made by prep's own session helper."""
    if JAVA_PROBLEM is not None:
        pytest.skip(f"no usable Java for Spark: {JAVA_PROBLEM}")
    with spark_session(None, processes=2) as session:
        yield session


@pytest.fixture(scope="module")
def server():
    with ImageServer() as server:
        yield server


@pytest.fixture(scope="module")
def url_list(server, tmp_path_factory):
    rows = [(server.add(path, **behaviour), caption) for path, behaviour, caption in ROUTES]
    return write_url_list(tmp_path_factory.mktemp("spark_input") / "urls.parquet", rows)


def _argv(url_list: Path, output: Path, distributor: str, processes: int = 2) -> list[str]:
    options = dict(image_size=32, processes=processes, threads=4, samples_per_shard=SHARD, timeout=2)
    return download_args(url_list, output, **options, max_download_seconds=DEADLINE, distributor=distributor)


@pytest.fixture(scope="module")
def references(spark, server, url_list, tmp_path_factory):
    """The same input downloaded by the multiprocessing path and by Spark; (mp dir, spark dir, seconds, hits)."""
    tmp = tmp_path_factory.mktemp("spark_runs")
    assert download_main(_argv(url_list, tmp / "mp", "multiprocessing")) == 0
    hits_before = dict(server.hits)
    started = time.monotonic()
    assert download_main(_argv(url_list, tmp / "spark", "pyspark")) == 0
    seconds = time.monotonic() - started
    hits = {p: n - hits_before.get(p, 0) for p, n in server.hits.items()}
    return tmp / "mp", tmp / "spark", seconds, hits


def _is_canonical(path: Path) -> bool:
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    return [m.name for m in members] == sorted(m.name for m in members) and {m.mtime for m in members} == {0}


def _outputs(folder: Path) -> dict[str, bytes]:
    names = [f"{i:05d}.tar" for i in range(N_SHARDS)] + ["sizes.json", "summary.json"]
    return {name: (folder / name).read_bytes() for name in names}


@needs_java
def test_session_is_local_with_this_interpreter(spark):
    assert spark.sparkContext.master == "local[2]"
    assert spark.sparkContext.pythonExec == sys.executable


@needs_java
def test_spark_shards_are_byte_identical_to_multiprocessing(references):
    mp, sp, _, _ = references
    assert _outputs(sp) == _outputs(mp)
    summary = json.loads((sp / "summary.json").read_text())
    assert summary["shards_done"] == N_SHARDS and summary["shards_failed"] == []
    assert summary["successes"] == 8  # red, wide, grey, rgba, late, tall, big, tiny
    assert summary["failures_by_reason"] == dict(sorted(EXPECTED_REASONS.items(), key=lambda kv: (-kv[1], kv[0])))
    # the per-shard metadata img2dataset writes next to each tar (rows in completion order): same rows
    for i in range(N_SHARDS):
        spark_rows, mp_rows = (pq.read_table(d / f"{i:05d}.parquet").sort_by("key") for d in (sp, mp))
        assert spark_rows.equals(mp_rows)


@needs_java
def test_trickle_is_cut_by_the_deadline_inside_an_executor(references):
    *_, seconds, hits = references
    # the reason is the deadline watchdog's own message: only the fetch that prep installs in the Python
    # worker raises it (img2dataset's per-read timeout never fires on a byte every 0.2 s)
    reasons = json.loads((references[1] / "summary.json").read_text())["failures_by_reason"]
    assert reasons[f"download exceeded the {DEADLINE}s deadline"] == 1
    assert hits["/trickle.jpg"] == 1 and hits["/hang.jpg"] == 1
    # and the run ended long before the trickle would have (a wide margin: this may run on a loaded machine)
    assert seconds < len(TRICKLE_BODY) * TRICKLE / 2, (seconds, len(TRICKLE_BODY) * TRICKLE)


@needs_java
def test_verify_accepts_the_spark_shards(references, capsys):
    sp = references[1]
    sizes = (sp / "sizes.json").read_bytes()
    assert verify_main([str(sp)]) == 0
    assert f"{N_SHARDS} shards" in capsys.readouterr().out
    assert (sp / "sizes.json").read_bytes() == sizes


@needs_java
def test_killed_spark_run_resumes_to_the_same_bytes(references, url_list, tmp_path):
    """A CLI run on its own local[1] session, killed once shard 1 is written; then re-run in-process."""
    out, hold, log = tmp_path / "out", tmp_path / "held.pid", tmp_path / "run.log"
    env = {**os.environ, "DISCO_FAULT": f"hold_after={hold}:shard=1"}
    # --processes 3 with --spark_master local[1]: the master wins, so tasks (shards) run one at a time
    cli = [
        sys.executable,
        "-m",
        "disco_clip_ds.cli",
        "data",
        "download",
        *_argv(url_list, out, "pyspark", processes=3),
        "--spark_master",
        "local[1]",
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cli, env=env, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while not hold.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hold.exists(), f"the run never reached shard 1 (rc {proc.poll()}):\n{log.read_text()[-3000:]}"
        # Spark's Python daemon puts its workers in a group of their own: take the held one's while it is held
        worker_group = os.getpgid(int(hold.read_text()))
        assert worker_group != os.getpgrp()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # driver and JVM
        proc.wait()
    # the daemon may already have killed its workers on losing the JVM; if not, kill the held one's group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker_group, signal.SIGKILL)
    assert "spark: master local[1]" in log.read_text()

    done = sorted(p.name for p in out.glob("*_stats.json"))
    assert done == ["00000_stats.json", "00001_stats.json"], done  # one task at a time, killed after shard 1
    # the worker canonicalizes a tar after the hold point: shard 0's is, shard 1's is left to the re-run
    assert _is_canonical(out / "00000.tar") and not _is_canonical(out / "00001.tar")
    before = {name: (out / name).read_text() for name in done}

    assert download_main(_argv(url_list, out, "pyspark")) == 0
    assert {name: (out / name).read_text() for name in done} == before  # not redone
    assert _outputs(out) == _outputs(references[1]) == _outputs(references[0])


@needs_java
def test_crashed_executor_fails_the_run_with_exit_1_and_a_rerun_completes(spark, references, url_list, tmp_path, capfd):
    out = tmp_path / "out"
    # the session's Python workers take their environment from SparkContext.environment, not os.environ
    spark.sparkContext.environment["DISCO_FAULT"] = "exit_before:shard=2"
    try:
        assert run_main(download_main, _argv(url_list, out, "pyspark"), "disco-clip data download") == 1
    finally:
        del spark.sparkContext.environment["DISCO_FAULT"]
    # the run is over when it returns: no task of it still runs (shard 1's outlives the crash of shard 2 by
    # about a second, the trickle's deadline), so nothing writes into the folder after its summary
    assert [e.numRunningTasks for e in spark.sparkContext.statusTracker().getExecutorInfos()] == [0]
    out_text, err = capfd.readouterr()  # the file descriptors: img2dataset's logger is a process of its own
    assert "error: the Spark job failed" in err and "shard(s) failed; re-run to retry" in err
    # its logger, left running by img2dataset after the failure, read sizes.json as a stats file: a traceback
    from img2dataset.logger import LoggerProcess  # ended before sizes.json was written, not left to read it

    assert not [p for p in multiprocessing.active_children() if isinstance(p, LoggerProcess)]
    said = out_text + err
    assert "invalid literal for int()" not in said and "logger error" not in said, said[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "00002" in summary["shards_failed"] and not (out / "00002.tar").exists()
    assert len(summary["shards_failed"]) + summary["shards_done"] == N_SHARDS
    assert sorted(p.name for p in out.glob("*_stats.json")) == sorted(
        f"{i:05d}_stats.json" for i in range(N_SHARDS) if f"{i:05d}" not in summary["shards_failed"]
    )
    assert download_main(_argv(url_list, out, "pyspark")) == 0
    assert _outputs(out) == _outputs(references[1])


@needs_java
def test_exit_1_when_nothing_arrives(spark, server, tmp_path, capsys):
    rows = [(server.add(f"/nothing{i}.jpg", status=404), "x") for i in range(3)]
    url_list = write_url_list(tmp_path / "urls.parquet", rows)
    assert run_main(download_main, _argv(url_list, tmp_path / "out", "pyspark"), "disco-clip data download") == 1
    assert "no sample was downloaded" in capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failures_by_reason"] == {"HTTP Error 404: Not Found": 3}


@needs_java
def test_spark_master_is_checked_before_any_work(spark, url_list, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="--spark_master needs --distributor pyspark"):
        download_main(_argv(url_list, out, "multiprocessing") + ["--spark_master", "local[2]"])
    with pytest.raises(UsageError, match=r"master local\[2\] is already active; --spark_master spark://"):
        download_main(_argv(url_list, out, "pyspark") + ["--spark_master", "spark://nowhere:7077"])
    assert not out.exists()


# --- no Spark session needed ----------------------------------------------------------------------


class _StuckContext:
    """The few SparkContext calls jobs_drained_on_failure makes; one task of its job group never ends."""

    def __init__(self):
        self.properties = {"spark.jobGroup.id": "the notebook's group"}

    def getLocalProperty(self, key):
        return self.properties.get(key)

    def setLocalProperty(self, key, value):
        if value is None:
            self.properties.pop(key, None)
        else:
            self.properties[key] = value

    def setJobGroup(self, group, description, interruptOnCancel=False):
        self.properties.update({"spark.jobGroup.id": group, "spark.job.description": description})

    def statusTracker(self):
        jobs = {7: SimpleNamespace(stageIds=[3])}
        return SimpleNamespace(
            getJobIdsForGroup=lambda group: [7] if group.startswith("disco-clip-download-") else [],
            getJobInfo=jobs.get,
            getStageInfo=lambda stage: SimpleNamespace(numActiveTasks=1),
        )


def test_a_task_outliving_the_wait_is_named_and_the_callers_job_group_restored(capsys):
    context = _StuckContext()
    with pytest.raises(RuntimeError, match="job aborted"):
        with jobs_drained_on_failure(SimpleNamespace(sparkContext=context), timeout_s=0.3):
            raise RuntimeError("job aborted")
    err = capsys.readouterr().err
    assert "1 task(s) of the failed Spark job still run after 0s" in err and "before re-running" in err
    assert context.properties == {"spark.jobGroup.id": "the notebook's group"}


def test_missing_java_stops_the_cli_before_any_work(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(empty_bin)
    url_list = write_url_list(tmp_path / "urls.parquet", [("http://127.0.0.1:9/a.jpg", "a")])
    cli = [sys.executable, "-m", "disco_clip_ds.cli", "data", "download", *_argv(url_list, tmp_path / "out", "pyspark")]
    result = subprocess.run(cli, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs Java 17+" in lines[0] and "openjdk-17-jre-headless" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_java_problem_names_an_old_or_absent_java(tmp_path):
    fake = tmp_path / "jdk11" / "bin"
    fake.mkdir(parents=True)
    (fake / "java").write_text("#!/bin/sh\necho 'openjdk version \"11.0.21\" 2023-10-17' >&2\n")
    (fake / "java").chmod(0o755)
    assert "is Java 11; pyspark 4 needs Java 17+" in java_problem({"PATH": str(fake)})
    assert "is Java 11" in java_problem({"JAVA_HOME": str(tmp_path / "jdk11"), "PATH": ""})
    (fake / "java").write_text("#!/bin/sh\necho 'java version \"1.8.0_392\"' >&2\n")
    assert "is Java 8;" in java_problem({"PATH": str(fake)})
    assert "has no bin/java" in java_problem({"JAVA_HOME": str(tmp_path), "PATH": str(fake)})
    assert "no java on PATH and JAVA_HOME is unset" in java_problem({"PATH": str(tmp_path)})
    (fake / "java").write_text("#!/bin/sh\necho 'openjdk version \"21.0.2\" 2024-01-16' >&2\n")
    assert java_problem({"PATH": str(fake)}) is None


def test_cluster_recipe_download_step_submits_a_valid_command(tmp_path):
    """data_prep/relaion2b_spark.sh download, with spark-submit and disco-clip replaced by recorders."""
    env_dir = tmp_path / "env"
    (env_dir / "bin").mkdir(parents=True)
    for tool in ("disco-clip", "spark-submit"):
        shim = env_dir / "bin" / tool
        shim.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" {tool} "$@" >> "$CALLS"; printf "\\n" >> "$CALLS"\n')
        shim.chmod(0o755)
    (env_dir / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (env_dir / "bin" / "python").chmod(0o755)
    script = REPO / "data_prep" / "relaion2b_spark.sh"
    env = {
        **os.environ,
        "ENV_DIR": str(env_dir),
        "CALLS": str(tmp_path / "calls"),
        "MASTER": "spark://10.0.0.1:7077",
        "OUT": str(tmp_path / "shards"),
        "PARTS": "part-0000[0-1]-*",
    }
    subprocess.run(["bash", str(script), "download"], cwd=tmp_path, env=env, check=True, timeout=60)
    calls = [line.split("\0")[:-1] for line in (tmp_path / "calls").read_text().splitlines() if line]
    assert [c[0] for c in calls] == ["disco-clip", "spark-submit", "disco-clip"]
    assert metadata_parser().parse_args(calls[0][3:]).pattern == ["part-0000[0-1]-*"]
    submit = calls[1]
    app = next(i for i, a in enumerate(submit) if a.endswith("cli.py"))
    assert Path(submit[app]).resolve() == REPO / "disco_clip_ds" / "cli.py"
    assert submit[app + 1 : app + 3] == ["data", "download"]
    known, unknown = download_parser().parse_known_args(submit[app + 3 :])
    assert parse_passthrough(unknown) == {"retries": 0}
    assert (known.distributor, known.preset, known.output) == ("pyspark", "relaion", str(tmp_path / "shards"))
    assert (known.threads, known.samples_per_shard) == (64, 10000)
    options = submit[1:app]
    assert options[options.index("--master") + 1] == "spark://10.0.0.1:7077"
    confs = dict(options[i + 1].split("=", 1) for i, a in enumerate(options) if a == "--conf")
    assert confs["spark.pyspark.python"] == f"{env_dir}/bin/python"
    assert confs["spark.task.maxFailures"] == "100" and confs["spark.executor.memory"] == "16G"
    assert calls[2][1:] == ["data", "verify", str(tmp_path / "shards")]
    assert subprocess.run(["bash", str(script), "nonsense"], check=False, env=env, capture_output=True).returncode == 2


# --- `data filter --spark` ----------------------------------------------------------------------------------------


def _filter_outputs(folder: Path) -> dict[str, bytes]:
    """Every file of a filter's output folder but its resume state (.filter/); the folder is then removed, for the
    next run to write the same path (a path is in the sidecars' names and in filter.json)."""
    outputs = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if ".filter" not in p.parts}
    shutil.rmtree(folder)
    return outputs


@needs_java
def test_the_filter_on_spark_writes_the_one_machine_bytes_even_with_an_executor_killed(spark, tmp_path):
    """The one-machine run against a local[2] session (this module's) and a standalone master with 2 workers whose
    executor writing output shard 1 is killed (kill -9 of its JVM, on the task's first attempt): Spark runs the task
    again on a new executor, and the output is the same bytes."""
    images = [smooth_jpeg(i % 20) for i in range(24)]  # samples 20..23 repeat 0..3: copies for --dedup
    embedded_shards(tmp_path / "in", 4, 6, images=images)
    embedded_shards(tmp_path / "target", 1, 2, seed=1)
    out = tmp_path / "out"
    rules = ["--keep_fraction", "0.75", "--dedup", "--target", tmp_path / "target", "--clusters", "3"]
    argv = [str(a) for a in ["--shards", tmp_path / "in", *rules, "--samples_per_shard", "4", "--output", out]]
    assert run_main(filter_main, argv, "filter") == 0
    reference = _filter_outputs(out)
    assert sum(name.endswith(".tar") for name in reference) == 3

    assert run_main(filter_main, [*argv, "--spark", "local[2]"], "filter") == 0
    assert _filter_outputs(out) == reference

    cluster = tmp_path / "cluster"
    with standalone_cluster(cluster, workers=2, cores=1, memory="1G") as master:
        cli = [sys.executable, "-m", "disco_clip_ds.cli", "data", "filter", *argv, "--spark", master]
        env = {**cluster_env(cluster / "work"), "DISCO_FAULT": "kill_in_write=executor:shard=1,attempt=0"}
        run = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=420)
        executors = executor_folders(cluster)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"spark: master {master}" in run.stdout
    # the two first executors and the one launched in place of the killed one
    assert len(executors) == 3, executors
    assert _filter_outputs(out) == reference
