"""The inputs of a download: the metadata files img2dataset will read, their columns and rows, the shards they make."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

from disco_clip_ds.errors import DataError, UsageError


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
