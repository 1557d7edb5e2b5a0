"""`disco-clip data metadata`: a dataset's parquet metadata from the Hugging Face hub."""

from __future__ import annotations

from pathlib import Path

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
