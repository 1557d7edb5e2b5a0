"""A model named on the command line (`--model`, `--teacher`, `--model_name_or_path`, `--tokenizer_name`): a local
folder or a hub id, told apart before anything loads, so that a mistyped folder is refused at once naming it in full
(transformers would take it for a hub id, retry the hub for half a minute, then say it could not connect), and a hub
id without a reachable hub is refused in one line saying so and how to work offline.
"""

from __future__ import annotations

import difflib
import functools
import os
from pathlib import Path

from disco_clip_ds.errors import UsageError

PROBE_SECONDS = 5  # the hub probe's limit: an unroutable network fails here rather than in the loader's retries


def looks_like_path(value: str) -> bool:
    """Spelled as a local path rather than a hub id (NAME or ORG/NAME): it starts with /, . or ~, holds a backslash,
    ends with / or has more than one /, or its first part is a folder here (`outputs/quickstrt` beside `outputs/`)."""
    if value.startswith(("/", ".", "~")) or "\\" in value or value.endswith("/") or value.count("/") > 1:
        return True
    return "/" in value and Path(value.split("/")[0]).is_dir()


def check_model_source(value: str, flag: str) -> None:
    """Refuse, in one UsageError, a path-like `value` that is not there (its full path named, with the nearest
    names beside it) and a hub id while the hub cannot be reached (unless HF_HUB_OFFLINE is set: transformers then
    reads the local cache and says itself what it lacks). A folder that exists, or a hub id with the hub
    reachable, is left to its loader."""
    path = Path(value).expanduser()
    if path.exists():
        return
    if looks_like_path(value):
        raise UsageError(f"{flag} {value}: no such folder: {path.resolve()}{_nearest(path)}")
    if _offline():
        return
    problem = hub_problem()
    if problem:
        from huggingface_hub import constants, try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(value, "config.json"), str) or isinstance(
            try_to_load_from_cache(value, "tokenizer_config.json"), str
        )
        offline = (
            "a copy is in the local cache: set HF_HUB_OFFLINE=1 to read it without the hub"
            if cached
            else f"to work offline, download it where the hub is reachable (`hf download {value}`), then set "
            "HF_HUB_OFFLINE=1 to read the cache, or give the path of a local copy"
        )
        raise UsageError(
            f"{flag} {value}: a hub id (there is no folder {path.resolve()}), and the hub {constants.ENDPOINT} cannot "
            f"be reached ({problem}); {offline}"
        )


@functools.lru_cache(maxsize=1)
def hub_problem() -> str | None:
    """Why the hub (HF_ENDPOINT) cannot be reached, in a few words, or None when it answers (any HTTP status): one
    request through huggingface_hub's own session (its proxies and certificates), no retries, PROBE_SECONDS at most."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_SECONDS)
    except Exception as error:  # the session's transport errors (connection refused, DNS, timeout) have no common base
        return " ".join(str(error).split()) or type(error).__name__
    return None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _nearest(path: Path) -> str:
    """'; did you mean X?' for the names nearest to the first missing part, in the deepest folder that exists."""
    path = Path(os.path.abspath(path))
    parent, missing = path.parent, path.name
    while not parent.is_dir() and parent != parent.parent:
        parent, missing = parent.parent, parent.name
    if not parent.is_dir():
        return ""
    names = sorted(p.name for p in parent.iterdir())
    close = difflib.get_close_matches(missing, names, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(str(parent / name) for name in close)}?" if close else ""
