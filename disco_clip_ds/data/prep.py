"""Data preparation over img2dataset: dataset presets, resumable downloads, verification, metadata.

`disco-clip data download` is one `img2dataset.download` call with a preset's column names, plus what
img2dataset leaves out:
- a wall-clock deadline per image (its `timeout` bounds single socket operations, so a server that
  trickles bytes holds a worker for as long as it trickles);
- resume that also redoes a shard whose tar vanished while its `_stats.json` stayed (img2dataset
  trusts the stats file alone);
- tar members rewritten in key order with a fixed mtime once a shard is done, so that a resumed run
  and an uninterrupted one give the same bytes (img2dataset writes members in completion order);
- `sizes.json` (the open_clip layout) and `summary.json` (what arrived, failures by reason), and a
  non-zero exit when nothing arrived or a shard failed for good (img2dataset exits 0 regardless);
- under `--distributor pyspark`: a Java check before any work, and a Spark session whose Python workers
  run this interpreter (so that they import this package, which carries the deadline).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import inspect
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..compat import img2dataset_fetch
from ..errors import DataError, UsageError
from .shards import IMAGE_EXTS, write_json

# Importing img2dataset pulls in albumentations, which phones home for updates unless told not to.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

_SHARD_RE = re.compile(r"^(\d+)\.tar$")
_STATS_RE = re.compile(r"^(\d+)_stats\.json$")
_OUR_JSON = ("sizes.json", "summary.json")
_CANONICAL_MTIME = 0


@dataclass(frozen=True)
class Preset:
    """Column names and image defaults of one dataset's metadata, from its reference download command."""

    input_format: str
    url_col: str
    caption_col: str
    extra_columns: tuple[str, ...] = ()
    image_size: int = 256
    resize_mode: str = "border"


PRESETS = {
    # img2dataset's dataset_examples/laion400m.md
    "laion400m": Preset("parquet", "URL", "TEXT", ("NSFW", "similarity", "LICENSE")),
    # laion/relaion2B-en-research-safe and siblings (the successors of the withdrawn LAION metadata)
    "relaion": Preset("parquet", "url", "caption", ("similarity", "punsafe", "pwatermark", "aesthetic")),
    # DataComp's download_upstream.py: 512 px, keep_ratio_largest, keeps uid
    "datacomp": Preset("parquet", "url", "text", ("uid",), image_size=512, resize_mode="keep_ratio_largest"),
    # Google's Conceptual Captions TSV, after adding the header line "caption<TAB>url"
    "cc": Preset("tsv", "url", "caption", ()),
}


# ---------------------------------------------------------------------------------------------------
# A deadline per image download
# ---------------------------------------------------------------------------------------------------


class _RecordingHandlerMixin:
    """Remembers the socket of each HTTP(S) connection urllib opens, so that a watchdog can shut it down.

    The socket is taken at connect time: urllib drops the connection's reference to it once the
    headers are in, while the body is still read through it.
    """

    def __init__(self, sockets: list, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sockets = sockets

    def do_open(self, http_class, req, **kwargs):
        sockets = self._sockets

        def make_connection(*a, **kw):
            conn = http_class(*a, **kw)
            connect = conn.connect

            def connect_and_record():
                connect()
                sockets.append(conn.sock)

            conn.connect = connect_and_record
            return conn

        return super().do_open(make_connection, req, **kwargs)


class _RecordingHTTPHandler(_RecordingHandlerMixin, urllib.request.HTTPHandler):
    pass


class _RecordingHTTPSHandler(_RecordingHandlerMixin, urllib.request.HTTPSHandler):
    pass


def _shutdown_sockets(sockets: list) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def fetch_with_deadline(url: str, timeout: float, deadline_s: float, headers: dict | None = None):
    """GET `url` and return `(response_headers, body)`, raising TimeoutError after `deadline_s` in all.

    `timeout` still bounds each socket operation; a watchdog shuts the socket down at the deadline,
    which unblocks a read that the server keeps alive by trickling bytes (in headers or body).
    """
    sockets: list = []
    expired = threading.Event()
    opener = urllib.request.build_opener(_RecordingHTTPHandler(sockets), _RecordingHTTPSHandler(sockets))

    def expire():
        expired.set()
        _shutdown_sockets(sockets)

    watchdog = threading.Timer(deadline_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            body = response.read()
            response_headers = response.headers
    except Exception:
        if expired.is_set():
            raise TimeoutError(f"download exceeded the {deadline_s:g}s deadline") from None
        raise
    finally:
        watchdog.cancel()
    if expired.is_set():  # a shut-down socket can also end a body without an error
        raise TimeoutError(f"download exceeded the {deadline_s:g}s deadline")
    return response_headers, body


def _download_image_with_deadline(row, timeout, user_agent_token, disallowed_header_directives, deadline_s):
    """img2dataset's `downloader.download_image`, same contract and headers, with a total deadline."""
    from img2dataset.downloader import is_disallowed

    key, url = row
    user_agent = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"
    if user_agent_token:
        user_agent += f" (compatible; {user_agent_token}; +https://github.com/rom1504/img2dataset)"
    try:
        headers, body = fetch_with_deadline(url, timeout, deadline_s, {"User-Agent": user_agent})
        if disallowed_header_directives and is_disallowed(headers, user_agent_token, disallowed_header_directives):
            return key, None, "Use of image disallowed by X-Robots-Tag directive"
        return key, io.BytesIO(body), None
    except Exception as err:  # img2dataset records str(err) as the failure reason
        return key, None, str(err)


def _download_shard(downloader, row):
    """One shard in an img2dataset worker, between the tests' fault points, canonicalized where it was written."""
    _fault_point("exit_before", row[0])
    result = downloader(row)
    _fault_point("hold_after", row[0])
    if result[0]:
        # Canonicalize here, in parallel and next to the data, rather than have the driver read and
        # rewrite every tar at the end (on a cluster, all of them over the shared filesystem).
        # Dying before this is harmless: summarize() canonicalizes whatever is left.
        with contextlib.suppress(tarfile.TarError, OSError):
            canonicalize_tar(Path(downloader.output_folder) / f"{shard_name(row[0])}.tar")
    return result


def _fault_point(point: str, shard_id: int) -> None:
    """Fault injection for the tests, at named points of a worker's shard: DISCO_CLIP_FAULT=POINT:SHARD.

    `exit_before:k` ends the worker process before shard k starts, as a crashed executor would.
    `hold_after:k` writes the worker's pid to DISCO_CLIP_FAULT_FILE once shard k is written and stops
    the worker, so that a test can kill the run in a known state.
    """
    if os.environ.get("DISCO_CLIP_FAULT") != f"{point}:{shard_id}":
        return
    if point == "exit_before":
        os._exit(3)
    Path(os.environ["DISCO_CLIP_FAULT_FILE"]).write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def _bypass_proxy_for_loopback() -> None:
    # An http_proxy variable would route 127.0.0.1 through the proxy; spawned workers inherit os.environ.
    for var in ("no_proxy", "NO_PROXY"):
        hosts = [h for h in os.environ.get(var, "").split(",") if h]
        os.environ[var] = ",".join(hosts + [h for h in ("127.0.0.1", "localhost", "::1") if h not in hosts])


# ---------------------------------------------------------------------------------------------------
# Inputs: files, columns, expected shards
# ---------------------------------------------------------------------------------------------------


def input_files(url_list: str, input_format: str) -> list[Path]:
    """The files img2dataset will read, in its order (a folder: sorted `*.{input_format}`)."""
    path = Path(url_list)
    if path.is_dir():
        files = sorted(path.glob(f"*.{input_format}"))
        if not files:
            nested = sorted({p.parent for p in path.rglob(f"*.{input_format}") if ".cache" not in p.parts})
            hint = f"; they are in {', '.join(map(str, nested[:3]))}: pass that as --url_list" if nested else ""
            raise UsageError(f"no *.{input_format} file directly in {path}{hint} (or check --input_format)")
        return files
    if not path.exists():
        raise UsageError(f"--url_list {path} does not exist")
    return [path]


def _read_table(path: Path, input_format: str):
    import pyarrow.csv as pa_csv
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    if input_format == "parquet":
        return pq.read_table(path)
    if input_format.startswith(("csv", "tsv")):
        delimiter = "\t" if input_format.startswith("tsv") else ","
        return pa_csv.read_csv(path, parse_options=pa_csv.ParseOptions(delimiter=delimiter))
    if input_format.startswith("txt"):
        return pa_csv.read_csv(path, read_options=pa_csv.ReadOptions(column_names=["url"]))
    if input_format.startswith("jsonl"):
        return pa_json.read_json(path)
    import pandas as pd
    import pyarrow as pa

    return pa.Table.from_pandas(pd.read_json(path))


@contextlib.contextmanager
def _readable(path: Path, input_format: str):
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError, ValueError) as err:
        raise DataError(f"cannot read {path} as {input_format}: {err}") from None


def input_columns(path: Path, input_format: str) -> list[str]:
    """Column names of one input file (parquet: from its schema, without reading the rows)."""
    with _readable(path, input_format):
        if input_format == "parquet":
            import pyarrow.parquet as pq

            return pq.read_schema(path).names
        return _read_table(path, input_format).column_names


def input_rows(path: Path, input_format: str) -> int:
    with _readable(path, input_format):
        if input_format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
        return _read_table(path, input_format).num_rows


def expected_shards(files: list[Path], input_format: str, samples_per_shard: int) -> int:
    """Shard count img2dataset will make: each input file starts its own run of shards."""
    return sum(math.ceil(input_rows(f, input_format) / samples_per_shard) for f in files)


# ---------------------------------------------------------------------------------------------------
# Output folder: resume repair, canonical tars, sizes.json, summary.json
# ---------------------------------------------------------------------------------------------------


def shard_name(shard_id: int) -> str:
    return f"{shard_id:05d}"


def prepare_output_for_resume(output: Path) -> list[int]:
    """Make an existing output folder safe for img2dataset's incremental mode; return shards to redo.

    img2dataset counts a shard as done when `NNNNN_stats.json` exists and parses every `*.json` in
    the folder as such, so our derived sizes.json/summary.json are removed (they are rewritten at the
    end) and a shard whose tar is gone loses its stats file so that it is downloaded again.
    """
    if not output.exists():
        return []
    for name in _OUR_JSON:
        (output / name).unlink(missing_ok=True)
    strays = [p.name for p in output.glob("*.json") if not _STATS_RE.match(p.name)]
    if strays:
        raise UsageError(
            f"{output} holds {', '.join(sorted(strays))}; img2dataset would fail on it. "
            "Move it out of the output folder, or choose another --output."
        )
    redo = []
    for stats in sorted(output.glob("*_stats.json")):
        shard_id = int(_STATS_RE.match(stats.name).group(1))
        if not (output / f"{shard_name(shard_id)}.tar").exists():
            stats.unlink()
            (output / f"{shard_name(shard_id)}.parquet").unlink(missing_ok=True)
            redo.append(shard_id)
    return redo


def done_shards(output: Path) -> dict[int, dict]:
    """`{shard_id: stats}` for every shard img2dataset finished (its `_stats.json` exists)."""
    done = {}
    for stats in output.glob("*_stats.json"):
        shard_id = int(_STATS_RE.match(stats.name).group(1))
        done[shard_id] = json.loads(stats.read_text())
    return dict(sorted(done.items()))


def canonicalize_tar(path: Path) -> int:
    """Rewrite a finished shard with members sorted by name and a fixed mtime; return its sample count.

    Leaves a tar that is already canonical untouched. The rewrite goes through a temporary file and
    an atomic rename, so an interruption never leaves a half-written shard behind.
    """
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        samples = len({n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[-1].lower() in IMAGE_EXTS})
        if names == sorted(names) and all(m.mtime == _CANONICAL_MTIME for m in members):
            return samples
        tmp = path.with_suffix(".tar.tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as out:
            for member in sorted(members, key=lambda m: m.name):
                member.mtime = _CANONICAL_MTIME
                out.addfile(member, tar.extractfile(member))
    os.replace(tmp, path)
    return samples


def summarize(output: Path, n_expected: int) -> tuple[dict, dict]:
    """Aggregate img2dataset's per-shard stats into (summary, sizes); canonicalizes finished tars."""
    done = done_shards(output)
    reasons: Counter = Counter()
    totals = Counter()
    sizes = {}
    for shard_id, stats in list(done.items()):
        tar = output / f"{shard_name(shard_id)}.tar"
        try:
            samples = canonicalize_tar(tar)
        except (tarfile.TarError, OSError) as err:
            samples, problem = None, f"unreadable tar ({err})"
        else:
            problem = f"tar holds {samples} samples, its stats say {stats['successes']}"
        if samples != stats["successes"]:  # a damaged shard: drop its stats so that a re-run redoes it
            print(f"shard {shard_name(shard_id)}: {problem}; it will be downloaded again on the next run")
            (output / f"{shard_name(shard_id)}_stats.json").unlink()
            del done[shard_id]
            continue
        sizes[tar.name] = samples
        for key in ("count", "successes", "failed_to_download", "failed_to_resize"):
            totals[key] += stats[key]
        for reason, n in stats["status_dict"].items():
            if reason != "success":
                reasons[reason.strip()] += n
    failed = [shard_name(i) for i in range(n_expected) if i not in done]
    summary = {
        "shards": n_expected,
        "shards_done": len(done),
        "shards_failed": failed,
        "count": totals["count"],
        "successes": totals["successes"],
        "failed_to_download": totals["failed_to_download"],
        "failed_to_resize": totals["failed_to_resize"],
        "failures_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
    }
    return summary, sizes


def print_summary(summary: dict, output: Path) -> None:
    print(
        f"{output}: {summary['successes']}/{summary['count']} samples in {summary['shards_done']}/{summary['shards']} "
        f"shards; failed_to_download {summary['failed_to_download']}, failed_to_resize {summary['failed_to_resize']}"
    )
    for reason, n in list(summary["failures_by_reason"].items())[:10]:
        print(f"  {n:>8}  {reason}")
    if summary["shards_failed"]:
        print(f"  shards failed for good: {', '.join(summary['shards_failed'])} (re-run the same command to retry)")


# ---------------------------------------------------------------------------------------------------
# Spark: Java check, session
# ---------------------------------------------------------------------------------------------------

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


def _active_spark_session():
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise DataError(
            "--distributor pyspark needs pyspark: pip install 'pyspark>=4.0,<4.4' (and a Java 17+ runtime)"
        ) from None
    return SparkSession.getActiveSession()


def check_spark(master: str | None) -> None:
    """Fail before any work when `--distributor pyspark` cannot start: no pyspark, no (recent) Java."""
    active = _active_spark_session()
    if active is not None:  # a JVM already runs: nothing to check, but the master must be the one asked for
        if master and active.sparkContext.master != master:
            raise UsageError(
                f"a Spark session with master {active.sparkContext.master} is already active; "
                f"--spark_master {master} cannot apply: drop the flag or stop that session"
            )
        return
    problem = java_problem()
    if problem:
        raise DataError(f"--distributor pyspark needs Java {MIN_JAVA}+; {problem}")


def _is_spark_failure(err: Exception) -> bool:
    try:
        from py4j.protocol import Py4JError
        from pyspark.errors import PySparkException
    except ImportError:
        return False
    return isinstance(err, (Py4JError, PySparkException))


@contextlib.contextmanager
def _environ(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def spark_session(master: str | None, processes: int):
    """The Spark session img2dataset's pyspark distributor will find (it uses the active one).

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
    builder = SparkSession.builder.appName("disco-clip data download")
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
    with _environ(PYSPARK_PYTHON=sys.executable) if local else contextlib.nullcontext():
        session = builder.getOrCreate()
    context = session.sparkContext
    print(f"spark: master {context.master}, default parallelism {context.defaultParallelism}", flush=True)
    try:
        yield session
    finally:
        session.stop()


# ---------------------------------------------------------------------------------------------------
# download
# ---------------------------------------------------------------------------------------------------


@dataclass
class DownloadConfig:
    """One download: the CLI's options; None means the preset's value, `extra` goes to img2dataset as is."""

    url_list: str
    output: str
    preset: str = "laion400m"
    input_format: str | None = None
    url_col: str | None = None
    caption_col: str | None = None
    save_additional_columns: list[str] | None = None
    image_size: int | None = None
    resize_mode: str | None = None
    processes: int = 1
    threads: int = 64
    samples_per_shard: int = 10000
    distributor: str = "multiprocessing"
    spark_master: str | None = None
    timeout: float = 10
    max_download_seconds: float = 60
    extra: dict = field(default_factory=dict)


_RESERVED = {
    "url_list": "--url_list",
    "output_folder": "--output",
    "output_format": "(always webdataset)",
    "incremental_mode": "(always incremental: re-run to resume)",
    "processes_count": "--processes",
    "thread_count": "--threads",
    "number_sample_per_shard": "--samples_per_shard",
}


def _img2dataset_params() -> dict[str, inspect.Parameter]:
    import img2dataset

    return dict(inspect.signature(img2dataset.download).parameters)


def _resolve_columns(cfg: DownloadConfig, preset: Preset, files: list[Path]) -> tuple[str, str, list[str]]:
    url_col = cfg.url_col or preset.url_col
    caption_col = cfg.caption_col or preset.caption_col
    columns = input_columns(files[0], cfg.input_format)
    for what, col in (("--url_col", url_col), ("--caption_col", caption_col)):
        if col not in columns:
            raise UsageError(
                f"column '{col}' ({what}, preset {cfg.preset}) is not in {files[0]}; "
                f"its columns are {columns}. Pass {what} NAME or another --preset."
            )
    if cfg.save_additional_columns is not None:
        missing = [c for c in cfg.save_additional_columns if c not in columns]
        if missing:
            raise UsageError(f"--save_additional_columns {missing} not in {files[0]} (columns: {columns})")
        extras = list(cfg.save_additional_columns)
    else:  # the preset's extras that this metadata has (releases differ in which they carry)
        extras = [c for c in preset.extra_columns if c in columns]
        absent = [c for c in preset.extra_columns if c not in columns]
        if absent:
            print(f"note: preset {cfg.preset} extra columns {absent} are not in this metadata; not kept")
    return url_col, caption_col, extras


def download(cfg: DownloadConfig) -> dict:
    """Download `cfg.url_list` to webdataset shards in `cfg.output`; return the summary.

    Resumable: finished shards (and only those) are skipped; a shard whose tar vanished is redone.
    Writes `sizes.json` and `summary.json` in the output folder.
    """
    if cfg.preset not in PRESETS:
        raise UsageError(f"unknown --preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[cfg.preset]
    cfg.input_format = cfg.input_format or preset.input_format
    if cfg.samples_per_shard < 1 or cfg.processes < 1 or cfg.threads < 1:
        raise UsageError("--samples_per_shard, --processes and --threads must be positive")
    if cfg.max_download_seconds <= 0 or cfg.timeout <= 0:
        raise UsageError("--timeout and --max_download_seconds must be positive")
    if cfg.distributor == "pyspark":
        check_spark(cfg.spark_master)
    elif cfg.spark_master:
        raise UsageError("--spark_master needs --distributor pyspark")
    files = input_files(cfg.url_list, cfg.input_format)
    url_col, caption_col, extras = _resolve_columns(cfg, preset, files)
    n_expected = expected_shards(files, cfg.input_format, cfg.samples_per_shard)

    output = Path(cfg.output)
    redo = prepare_output_for_resume(output)
    if redo:
        print(f"tar missing for shard(s) {', '.join(map(shard_name, redo))}: downloading them again")
    already = len(done_shards(output)) if output.exists() else 0
    if already:
        print(f"resuming: {already}/{n_expected} shards already done in {output}")

    _bypass_proxy_for_loopback()
    import img2dataset

    # img2dataset's own timeout counts per socket operation; keep it within the per-image deadline.
    timeout = min(cfg.timeout, cfg.max_download_seconds)
    kwargs = dict(
        url_list=str(Path(cfg.url_list).resolve()),
        output_folder=str(output.resolve()),
        output_format="webdataset",
        input_format=cfg.input_format,
        url_col=url_col,
        caption_col=caption_col,
        save_additional_columns=extras or None,
        image_size=cfg.image_size or preset.image_size,
        resize_mode=cfg.resize_mode or preset.resize_mode,
        processes_count=cfg.processes,
        thread_count=cfg.threads,
        number_sample_per_shard=cfg.samples_per_shard,
        distributor=cfg.distributor,
        timeout=timeout,
        incremental_mode="incremental",
        enable_wandb=False,
    )
    kwargs.update(cfg.extra)
    spark = cfg.distributor == "pyspark"
    session = spark_session(cfg.spark_master, cfg.processes) if spark else contextlib.nullcontext()
    fetch = functools.partial(_download_image_with_deadline, deadline_s=cfg.max_download_seconds)
    with img2dataset_fetch(fetch, run=_download_shard), session:
        try:
            img2dataset.download(**kwargs)
        except Exception as err:
            if not _is_spark_failure(err):
                raise
            # a Spark job aborts on a lost task (local mode allows one attempt); shards finished so far
            # are complete on disk: report them, and let the summary name the rest as failed (exit 1)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            cause = next((line for line in lines if "Job aborted" in line), lines[0])
            print(f"error: the Spark job failed: {cause[:400]}", file=sys.stderr)

    summary, sizes = summarize(output, n_expected)
    write_json(output / "sizes.json", sizes)
    write_json(output / "summary.json", summary)
    return summary


def _parse_passthrough(tokens: list[str]) -> dict:
    """`--name value` / `--name=value` / `--flag` pairs for img2dataset, values parsed as fire does."""
    params = _img2dataset_params()
    extra, i = {}, 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise UsageError(f"unexpected argument {token!r}")
        name, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value, i = tokens[i + 1], i + 1
            else:
                value = "True"
        i += 1
        if name in _RESERVED:
            raise UsageError(f"--{name} is set by disco-clip: use {_RESERVED[name]}")
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise UsageError(f"unknown argument --{name} (neither ours nor img2dataset.download's){hint}")
        try:
            extra[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            extra[name] = value
    return extra


def _download_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disco-clip data download",
        description="Download a dataset to webdataset shards with img2dataset. Any other img2dataset.download "
        "argument passes through (e.g. --encode_quality 90 --retries 1). Re-run the same command to resume.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), required=True, help="column names and image defaults")
    p.add_argument("--url_list", required=True, help="metadata file or folder (parquet/tsv/...)")
    p.add_argument("--output", required=True, help="output folder for NNNNN.tar shards")
    p.add_argument("--input_format", help="override the preset's input format")
    p.add_argument("--url_col", help="override the preset's URL column")
    p.add_argument("--caption_col", help="override the preset's caption column")
    p.add_argument(
        "--save_additional_columns", type=ast.literal_eval, help="python list of columns to keep; default: preset's"
    )
    p.add_argument("--image_size", type=int, help="default: the preset's (256; datacomp 512)")
    p.add_argument("--resize_mode", choices=["no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"])
    p.add_argument("--processes", type=int, default=1, help="download processes")
    p.add_argument("--threads", type=int, default=64, help="download threads per process")
    p.add_argument("--samples_per_shard", type=int, default=10000)
    p.add_argument(
        "--distributor",
        choices=["multiprocessing", "pyspark"],
        default="multiprocessing",
        help="pyspark: one Spark task per shard; without --spark_master a local[--processes] session (needs Java 17+)",
    )
    p.add_argument(
        "--spark_master",
        help="Spark master URL (spark://HOST:7077, local[N], ...); default: the active session, spark-submit's, "
        "or local[--processes]",
    )
    p.add_argument("--timeout", type=float, default=10, help="seconds per socket operation")
    p.add_argument(
        "--max_download_seconds", type=float, default=60, help="wall-clock limit per image, trickling servers included"
    )
    return p


def download_main(argv: list[str] | None = None) -> int:
    """`disco-clip data download`: see `_download_parser`."""
    args, rest = _download_parser().parse_known_args(argv)
    cfg = DownloadConfig(**vars(args), extra=_parse_passthrough(rest))
    summary = download(cfg)
    print_summary(summary, Path(cfg.output))
    if summary["successes"] == 0:
        print("error: no sample was downloaded; see failures_by_reason in summary.json", file=sys.stderr)
        return 1
    if summary["shards_failed"]:
        print(f"error: {len(summary['shards_failed'])} shard(s) failed; re-run to retry", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------------


def inspect_shard(path: Path, decode_limit: int) -> dict:
    """Read a tar to its end; count samples, decode up to `decode_limit` images, collect caption lengths.

    Uses `tarfile` directly rather than webdataset: webdataset's readers stop quietly or skip on a
    truncated stream depending on the handler, while this must see every byte and name the failure.
    """
    from PIL import Image

    keys, caption_words, decoded, errors = set(), [], 0, []
    try:
        with tarfile.open(path) as tar:
            for member in tar:  # a tar cut at a member boundary just ends early here: see below
                data = tar.extractfile(member).read() if member.isfile() else b""
                key, _, ext = member.name.rpartition(".")
                ext = ext.lower()
                if ext in IMAGE_EXTS:
                    keys.add(key)
                    if decoded < decode_limit:
                        try:
                            with Image.open(io.BytesIO(data)) as img:
                                img.load()
                            decoded += 1
                        except Exception as err:  # report which sample is undecodable, go on
                            errors.append(f"{member.name}: cannot decode ({err})")
                elif ext == "txt":
                    caption_words.append(len(data.decode("utf-8", errors="replace").split()))
            end = tar.offset
        if not _ends_with_end_of_archive(path, end):
            errors.append(f"truncated tar: no end-of-archive marker after byte {end}")
    except (tarfile.TarError, OSError, EOFError) as err:
        errors.append(f"unreadable tar: {err}")
    return {"samples": len(keys), "decoded": decoded, "caption_words": caption_words, "errors": errors}


def _ends_with_end_of_archive(path: Path, offset: int) -> bool:
    # tarfile treats a header cut short as the end of the archive; a complete tar has two zero
    # blocks (and zero padding) where its last member ends.
    with open(path, "rb") as f:
        f.seek(offset)
        rest = f.read()
    return len(rest) >= 2 * tarfile.BLOCKSIZE and not rest.strip(b"\0")


def verify(folder: Path, decode_per_shard: int = 16) -> dict:
    """Check every NNNNN.tar in `folder`; write sizes.json for the readable ones; return a report."""
    shards = sorted(p for p in folder.glob("*.tar") if _SHARD_RE.match(p.name))
    if not shards:
        raise DataError(f"no NNNNN.tar shard in {folder}")
    sizes, broken, words, decoded = {}, {}, [], 0
    for path in shards:
        result = inspect_shard(path, decode_per_shard)
        decoded += result["decoded"]
        words += result["caption_words"]
        if result["errors"]:
            broken[path.name] = result["errors"]
        else:
            sizes[path.name] = result["samples"]
    if sizes:  # only good shards: a training run reading sizes.json should not count broken ones
        write_json(folder / "sizes.json", sizes)
    return {
        "shards": len(shards),
        "broken": broken,
        "samples": sum(sizes.values()),
        "decoded": decoded,
        "caption_words": _length_stats(words),
    }


def _length_stats(lengths: list[int]) -> dict:
    if not lengths:
        return {"count": 0}
    return {
        "count": len(lengths),
        "empty": sum(1 for n in lengths if n == 0),
        "min": min(lengths),
        "median": statistics.median(lengths),
        "mean": round(statistics.fmean(lengths), 2),
        "max": max(lengths),
    }


def _verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disco-clip data verify", description="check webdataset shards, write sizes.json")
    p.add_argument("folder", type=Path)
    p.add_argument("--decode", type=int, default=16, help="images to decode per shard")
    return p


def verify_main(argv: list[str] | None = None) -> int:
    """`disco-clip data verify DIR`: non-zero exit when a shard is broken."""
    args = _verify_parser().parse_args(argv)
    if not args.folder.is_dir():
        raise UsageError(f"{args.folder} is not a folder")
    report = verify(args.folder, args.decode)
    words = report["caption_words"]
    print(
        f"{args.folder}: {report['shards']} shards, {report['samples']} samples in good shards, "
        f"{report['decoded']} images decoded; caption words {words}"
    )
    for name, errors in report["broken"].items():
        print(f"  BROKEN {name}: " + "; ".join(errors[:3]), file=sys.stderr)
    return 1 if report["broken"] else 0


# ---------------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------------


def fetch_metadata(dataset: str, output: Path, patterns: list[str], revision: str | None = None) -> list[Path]:
    """Download a dataset repo's metadata files from the HF hub into `output`; return the parquet files.

    `snapshot_download(local_dir=...)` resumes partial downloads and, offline (HF_HUB_OFFLINE=1),
    returns an already-populated folder as is.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(
            repo_id=dataset, repo_type="dataset", revision=revision, allow_patterns=patterns, local_dir=output
        )
    except LocalEntryNotFoundError as err:
        raise DataError(f"cannot fetch {dataset} (offline, or not reachable) and {output} is empty: {err}")
    except HfHubHTTPError as err:  # gated datasets (Re-LAION) need an accepted licence and a token
        raise DataError(f"the hub refused {dataset}: {err}. Gated? Accept its terms and `hf auth login`.")
    from huggingface_hub.utils import filter_repo_objects

    # the folder may hold earlier downloads: list only what the patterns select, as the hub did
    local = [p.relative_to(output).as_posix() for p in output.rglob("*.parquet") if ".cache" not in p.parts]
    files = sorted(output / p for p in filter_repo_objects(local, allow_patterns=patterns))
    if not files:
        raise UsageError(f"no parquet file in {output} matches {patterns}; check --pattern")
    return files


def _metadata_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disco-clip data metadata", description="fetch parquet metadata from the HF hub")
    p.add_argument("--dataset", required=True, help="HF dataset id, e.g. laion/relaion2B-en-research-safe")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--pattern", nargs="+", default=["*.parquet"], help="glob(s) of files to fetch")
    p.add_argument("--revision", default=None)
    return p


def metadata_main(argv: list[str] | None = None) -> int:
    """`disco-clip data metadata --dataset ID --output DIR [--pattern GLOB ...]`."""
    args = _metadata_parser().parse_args(argv)
    started = time.monotonic()
    files = fetch_metadata(args.dataset, args.output, args.pattern, args.revision)
    rows = sum(input_rows(f, "parquet") for f in files)
    print(f"{args.output}: {len(files)} parquet files, {rows} rows ({time.monotonic() - started:.1f}s)")
    print(f"columns of {files[0].name}: {input_columns(files[0], 'parquet')}")
    return 0
