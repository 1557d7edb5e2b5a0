"""Where each reader of the training stream stands, saved with every checkpoint (`stream_state.json`) so that a
resumed run seeks there instead of reading and decoding the stream from its start.

Each training sample carries its reader's position (a stream's `position_fields`) through its batch; the trainer
keeps the newest position per reader of the batches it trained on (`note_positions`), gathers them from every rank
at a save, and rank 0 writes them. Positions are keyed by global reader (rank * workers + worker), so a resume that
splits the same readers differently over ranks and workers (2 ranks x 1 worker -> 1 rank x 2 workers) finds them.

One schema for every stream, read and written here only: the stream's facts (those a position means nothing
without: readers, seed, block size, and what a `datasets` stream reads), the field names, and per reader its
position as {field: value} (plus what the stream adds, e.g. a `datasets` streaming state_dict as the JSON it is).
A weighted mixture (data/mix.py) names per source its draws and that source's place, and adds its sources and
weights to the facts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from disco_clip_ds.data.shards import write_json
from disco_clip_ds.errors import UsageError

# A webdataset sample's place in its reader's stream: the reader (rank * workers + worker), the samples it has
# produced so far, the samples it has skipped so far, the pass over its shards, the block's first raw sample (the
# shard's index in that pass's order and the sample's index in the shard), and how many entries of the block's
# permutation are done. Every stream's rows begin with (reader, count, skipped).
POSITION_FIELDS = ("reader", "count", "skipped", "epoch", "shard", "member", "offset")
STATE_FILE = "stream_state.json"
_COUNT = POSITION_FIELDS.index("count")
_SKIPPED = POSITION_FIELDS.index("skipped")


def note_positions(newest: dict[int, list[int]], rows: torch.Tensor | None) -> None:
    """Fold a batch's position rows into `newest` ({reader: row}), keeping each reader's row of highest count."""
    if rows is None:
        return
    for row in rows.tolist():
        reader = row[0]
        if row[_COUNT] > newest.get(reader, [0] * (_COUNT + 1))[_COUNT]:
            newest[reader] = row


def skipped_samples(newest: dict[int, list[int]]) -> int:
    """The samples the readers skipped before the newest positions `newest` ({reader: row}): what a run skipped in the
    data it trained on, the same however often it stopped and resumed."""
    return sum(row[_SKIPPED] for row in newest.values())


def as_rows(newest: dict[int, list[int]], num_rows: int, width: int = len(POSITION_FIELDS)) -> torch.Tensor:
    """`newest` as a (num_rows, width) tensor padded with -1 rows: the same shape on every rank, to gather
    (`width`: the stream's fields per row)."""
    rows = torch.full((num_rows, width), -1, dtype=torch.int64)
    for i, row in enumerate(sorted(newest.values())[:num_rows]):
        rows[i] = torch.tensor(row)
    return rows


def write_stream_state(
    folder: str | Path,
    rows: torch.Tensor,
    facts: dict,
    fields: tuple[str, ...],
    extra: Callable[[list[int]], dict] | None = None,
) -> None:
    """Write the newest position of each reader found in the gathered `rows` to FOLDER/stream_state.json: the
    stream's `facts`, its `fields`, and per reader {field: value} (the ints past `fields` as `extra` names them)."""
    newest: dict[int, list[int]] = {}
    note_positions(newest, rows[rows[:, 0] >= 0])
    readers = {}
    for reader, row in sorted(newest.items()):
        entry = dict(zip(fields[1:], row[1 : len(fields)]))
        readers[str(reader)] = {**entry, **(extra(row[len(fields) :]) if extra else {})}
    write_json(Path(folder) / STATE_FILE, {**facts, "fields": list(fields), "readers": readers})


def read_stream_state(checkpoint: str | Path | None) -> dict | None:
    """The stream state saved in CHECKPOINT, or None when it has none (saved by an older version)."""
    path = Path(checkpoint) / STATE_FILE if checkpoint else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def _shown(value) -> str:
    return "none" if value is None else str(value)


def positions_to_restore(
    state: dict,
    facts: dict,
    fields: tuple[str, ...],
    checkpoint,
    extra: Callable[[dict], list[int]] | None = None,
) -> dict[int, tuple[int, ...]]:
    """{reader: position past the reader field} from a saved state, once it was saved by a stream with these
    `facts` and `fields` (positions mean nothing under another split of the data, seed or block size); else a
    UsageError says what differs. `extra` turns an entry's added values back into ints."""
    # every fact either side has: a mixture's sources and weights, absent from a plain stream's facts, count too
    keys = [*facts, *(k for k in state if k not in facts and k not in ("fields", "readers"))]
    saved, now = {k: state.get(k) for k in keys}, {k: facts.get(k) for k in keys}
    if saved != now:
        differ = ", ".join(f"{k} {_shown(saved[k])} -> {_shown(now[k])}" for k in keys if saved[k] != now[k])
        raise UsageError(
            f"{checkpoint} was saved reading the data differently ({differ}): resume with the same, or pass "
            "--ignore_data_skip to start the data stream afresh"
        )
    saved_fields = state.get("fields", list(fields))
    if saved_fields not in (list(fields), [f for f in fields if f != "skipped"]):  # the latter: saved before it
        raise UsageError(f"{checkpoint}/{STATE_FILE} has fields {state['fields']}, not {list(fields)}")
    positions = {}
    for reader, entry in state["readers"].items():
        if isinstance(entry, list):  # written before the one schema: the whole row, reader field first
            legacy = len(entry) == len(saved_fields) - 1 and "skipped" in saved_fields  # and before the skips
            entry = dict(zip([f for f in saved_fields if f != "skipped"] if legacy else saved_fields, entry))
        values = [entry.get(name, 0) if name == "skipped" else entry[name] for name in fields[1:]]
        positions[int(reader)] = tuple(values + (extra(entry) if extra else []))
    return positions
