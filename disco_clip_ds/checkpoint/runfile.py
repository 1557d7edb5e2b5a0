"""run.json: the facts of a run's set-up (world size, batch, loss, ZeRO stage, data, versions), written when
training starts and extended at each resume; what resume checks and the exported model card states. The one reader
of it, with one rule for a file that is absent or unreadable: no facts (None)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from disco_clip_ds.data.redact import describe_path, redact_text

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


def describe_model_source(source: str) -> str:
    """A model named on the command line (`--teacher`, `--teacher_embeddings`) as run.json and the model card show
    it, by `--train_shards`' rule (data/redact.py): a local path by its last component, so that neither names the
    machine it was read on; a hub id (org/name, no such folder here) as given, as it is public; secrets hidden."""
    source = str(source)
    local = source.startswith(("/", "./", "../", "~")) or source.count("/") > 1 or Path(source).expanduser().exists()
    return describe_path(source.rstrip("/")) if local else redact_text(source)


_DISTILLATION = re.compile(
    r"^from (?P<teacher>.+?), weight (?P<rest>.*?)"
    r"(?:, (?P<how>its embeddings stored in|crops replayed from) (?P<stored>[^;]+))?(?P<reinforced>; .*)?$"
)


def public_distillation(text: str) -> str:
    """run.json's `distillation` (checkpoint/resume.py's `distillation_setting`) with its teacher and embeddings named
    by `describe_model_source`; a run.json written before, which holds the paths as given, is shown alike."""
    match = _DISTILLATION.match(text)
    if match is None:
        return redact_text(text)
    stored = match["stored"] and f", {match['how']} {describe_model_source(match['stored'])}"
    teachers = " + ".join(describe_model_source(t) for t in match["teacher"].split(" + "))  # an ensemble's each
    return f"from {teachers}, weight {match['rest']}{stored or ''}{match['reinforced'] or ''}"
