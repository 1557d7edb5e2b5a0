"""run.json: the facts of a run's set-up (world size, batch, loss, ZeRO stage, data, versions), written when
training starts and extended at each resume; what resume checks and the exported model card states."""

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
