"""`disco-clip data download`: dataset presets and one `img2dataset.download` call with a preset's column names,
plus what img2dataset leaves out, each in a module of its own:
- fetch.py: a wall-clock deadline per image (its `timeout` bounds single socket operations, so a server that
  trickles bytes holds a worker for as long as it trickles);
- inputs.py: the input files and their columns checked before any work;
- outputs.py: resume that also redoes a shard whose tar vanished while its `_stats.json` stayed (img2dataset
  trusts the stats file alone); tar members rewritten in key order with a fixed mtime once a shard is done, so that
  a resumed run and an uninterrupted one give the same bytes (img2dataset writes members in completion order);
  `sizes.json` (the open_clip layout) and `summary.json` (what arrived, failures by reason);
- here: a non-zero exit when nothing arrived or a shard failed for good (img2dataset exits 0 regardless);
- spark.py, under `--distributor pyspark`: a Java check before any work, and a Spark session whose Python workers
  run this interpreter (so that they import this package, which carries the deadline).
`disco-clip data verify` and `data metadata` are verify.py and metadata.py.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import functools
import inspect
import os
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from disco_clip_ds import faults
from disco_clip_ds.compat import end_img2dataset_logger, img2dataset_fetch
from disco_clip_ds.data.decode import MAX_ASPECT
from disco_clip_ds.data.prep.fetch import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    bypass_proxy_for_loopback,
    download_image_with_deadline,
)
from disco_clip_ds.data.prep.inputs import expected_shards, input_columns, input_files
from disco_clip_ds.data.prep.outputs import (
    canonicalize_tar,
    done_shards,
    prepare_output_for_resume,
    shard_name,
    summarize,
)
from disco_clip_ds.data.prep.spark import check_spark, is_spark_failure, jobs_drained_on_failure, spark_session
from disco_clip_ds.data.shards import write_json
from disco_clip_ds.errors import UsageError

# img2dataset's resize modes that scale the short side to --image_size: the long side follows, unbounded
SHORT_SIDE_MODES = ("keep_ratio", "center_crop")

# Importing img2dataset pulls in albumentations, which phones home for updates unless told not to.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")


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


def _download_shard(downloader, row):
    """One shard in an img2dataset worker, between the tests' fault points, canonicalized where it was written."""
    faults.before_shard(row[0])
    result = downloader(row)
    faults.after_shard(row[0])
    if result[0]:
        # Canonicalize here, in parallel and next to the data, rather than have the driver read and
        # rewrite every tar at the end (on a cluster, all of them over the shared filesystem).
        # Dying before this is harmless: summarize() canonicalizes whatever is left.
        with contextlib.suppress(tarfile.TarError, OSError):
            canonicalize_tar(Path(downloader.output_folder) / f"{shard_name(row[0])}.tar")
    return result


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
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
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
    if not (cfg.max_download_seconds > 0 and cfg.timeout > 0):  # nan too
        raise UsageError("--timeout and --max_download_seconds must be positive")
    if cfg.max_image_bytes < 1 or cfg.max_image_pixels < 1:
        raise UsageError("--max_image_bytes and --max_image_pixels must be positive")
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

    bypass_proxy_for_loopback()
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
    fetch = functools.partial(
        download_image_with_deadline,
        deadline_s=cfg.max_download_seconds,
        max_bytes=cfg.max_image_bytes,
        max_pixels=cfg.max_image_pixels,
        max_aspect=MAX_ASPECT if kwargs["resize_mode"] in SHORT_SIDE_MODES else None,
    )
    with img2dataset_fetch(fetch, run=_download_shard), session as active:
        try:
            with jobs_drained_on_failure(active) if spark else contextlib.nullcontext():
                img2dataset.download(**kwargs)
        except Exception as err:
            if not is_spark_failure(err):
                raise
            # a Spark job aborts on a lost task (local mode allows one attempt); shards finished so far
            # are complete on disk: report them, and let the summary name the rest as failed (exit 1)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            cause = next((line for line in lines if "Job aborted" in line), lines[0])
            print(f"error: the Spark job failed: {cause[:400]}", file=sys.stderr)
            end_img2dataset_logger()  # before sizes.json is written: it reads every *.json of the folder

    summary, sizes = summarize(output, n_expected)
    write_json(output / "sizes.json", sizes)
    write_json(output / "summary.json", summary)
    return summary


def parse_passthrough(tokens: list[str]) -> dict:
    """`--name value` / `--name=value` / `--flag` pairs for img2dataset, values parsed as fire does."""
    params = _img2dataset_params() if tokens else {}  # importing img2dataset takes seconds: not before a Java check
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
