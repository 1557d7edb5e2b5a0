"""`disco-clip data metadata`: a dataset's parquet metadata from the Hugging Face hub."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from disco_clip_ds.data.prep.inputs import input_columns, input_rows
from disco_clip_ds.errors import DataError, UsageError


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
