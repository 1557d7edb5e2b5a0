"""Inputs of `disco-clip data download`: a URL list file and the command's arguments."""

from __future__ import annotations

from pathlib import Path


def write_url_list(path: Path, rows) -> Path:
    """Write (url, caption) rows as a parquet file with LAION's URL and TEXT columns; returns `path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    pq.write_table(pa.table({"URL": [u for u, _ in rows], "TEXT": [c for _, c in rows]}), path)
    return path


def download_args(url_list: Path, output: Path, **options) -> list[str]:
    """`data download` arguments for a LAION-layout URL list: the laion400m preset, --url_list, --output, then
    each option as --NAME VALUE (None: left out), e.g. download_args(urls, out, image_size=32, threads=4)."""
    args = ["--preset", "laion400m", "--url_list", str(url_list), "--output", str(output)]
    for name, value in options.items():
        if value is not None:
            args += [f"--{name}", str(value)]
    return args
