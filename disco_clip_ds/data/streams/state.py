"""Where each reader of the training stream stands, saved with every checkpoint (`stream_state.json`) so that a
resumed run seeks there instead of reading and decoding the stream from its start.

Each training sample carries its reader's position (`POSITION_FIELDS`) through its batch; the trainer
keeps the newest position per reader of the batches it trained on (`note_positions`), gathers them from every rank
at a save, and rank 0 writes them. Positions are keyed by global reader (rank * workers + worker), so a resume that
splits the same readers differently over ranks and workers (2 ranks x 1 worker -> 1 rank x 2 workers) finds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from disco_clip_ds.data.shards import write_json
from disco_clip_ds.errors import UsageError

# A sample's place in its reader's stream, carried through the batch (`pipeline.POSITION_KEY`) so that the trainer knows
# where each reader stands after the batches it has trained on: the reader (rank * workers + worker), the samples it
# has produced so far, the pass over its shards, the block's first raw sample (the shard's index in that pass's
# order and the sample's index in the shard), and how many entries of the block's permutation are done.
POSITION_FIELDS = ("reader", "count", "epoch", "shard", "member", "offset")
STATE_FILE = "stream_state.json"
_COUNT = POSITION_FIELDS.index("count")


def note_positions(newest: dict[int, list[int]], rows: torch.Tensor | None) -> None:
    """Fold a batch's position rows into `newest` ({reader: row}), keeping each reader's row of highest count."""
    if rows is None:
        return
    for row in rows.tolist():
        reader = row[0]
        if row[_COUNT] > newest.get(reader, [0] * (_COUNT + 1))[_COUNT]:
            newest[reader] = row


def as_rows(newest: dict[int, list[int]], num_rows: int, width: int = len(POSITION_FIELDS)) -> torch.Tensor:
    """`newest` as a (num_rows, width) tensor padded with -1 rows: the same shape on every rank, to gather
    (`width`: the stream's fields per row; a `datasets` stream has its own, data/hf.py)."""
    rows = torch.full((num_rows, width), -1, dtype=torch.int64)
    for i, row in enumerate(sorted(newest.values())[:num_rows]):
        rows[i] = torch.tensor(row)
    return rows


def write_stream_state(folder: str | Path, rows: torch.Tensor, num_readers: int, seed: int, block: int) -> None:
    """Write the newest position of each reader found in the gathered `rows` to FOLDER/stream_state.json."""
    newest: dict[int, list[int]] = {}
    note_positions(newest, rows[rows[:, 0] >= 0])
    state = {
        "num_readers": num_readers,
        "seed": seed,
        "shuffle_buffer": block,
        "fields": list(POSITION_FIELDS),
        "readers": {str(reader): row for reader, row in sorted(newest.items())},
    }
    write_json(Path(folder) / STATE_FILE, state)


def read_stream_state(checkpoint: str | Path | None) -> dict | None:
    """The stream state saved in CHECKPOINT, or None when it has none (saved by an older version)."""
    path = Path(checkpoint) / STATE_FILE if checkpoint else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def positions_to_restore(state: dict, num_readers: int, seed: int, block: int, checkpoint) -> dict[int, tuple]:
    """{reader: (count, epoch, shard, member, offset)} from a saved state, once it fits this run's stream; a
    UsageError says what differs (positions mean nothing under another split of the shards, seed or block size)."""
    saved = (state["num_readers"], state["seed"], state["shuffle_buffer"])
    if saved != (num_readers, seed, block):
        raise UsageError(
            f"{checkpoint} was saved reading with {saved[0]} readers (ranks x dataloader workers), seed {saved[1]} "
            f"and shuffle buffer {saved[2]}; this run has {num_readers}, {seed} and {block}: resume with the same, "
            "or pass --ignore_data_skip to start the data stream afresh"
        )
    if state.get("fields", list(POSITION_FIELDS)) != list(POSITION_FIELDS):
        raise UsageError(f"{checkpoint}/{STATE_FILE} has fields {state['fields']}, not {list(POSITION_FIELDS)}")
    return {int(reader): tuple(row[1:]) for reader, row in state["readers"].items()}
