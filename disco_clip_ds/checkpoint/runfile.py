"""run.json: the facts of a run's set-up (world size, batch, loss, ZeRO stage, data, versions), written when
training starts and extended at each resume; what resume checks and the exported model card states. The one reader
of it, with one rule for a file that is absent or unreadable: no facts (None)."""

from __future__ import annotations

import json
import os
from pathlib import Path

RUN_FILE = "run.json"


def read_run_file(folder: str | os.PathLike) -> dict | None:
    """FOLDER/run.json (None when absent or unreadable)."""
    try:
        return json.loads((Path(folder) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_file_of(checkpoint: str | os.PathLike) -> dict | None:
    """The run.json that holds for `checkpoint`: its own (a final model's run folder, or a checkpoint copied with
    its run.json), else the run folder's beside it, where training writes it. None when neither reads."""
    checkpoint = Path(checkpoint)
    return read_run_file(checkpoint) or read_run_file(checkpoint.parent)
