"""The Trainer side of the stream state: where each reader of the training stream stands, kept from the batches
trained on, saved in every checkpoint (stream_state.json) and restored on resume, so that a resumed run seeks each
reader to its place instead of reading and decoding the batches trained on (the state's schema is in
disco_clip_ds.data.streams.state)."""

from __future__ import annotations

import logging

import torch

from disco_clip_ds.data.streams.base import ReaderStream
from disco_clip_ds.data.streams.state import (
    POSITION_FIELDS,
    STATE_FILE,
    as_rows,
    note_positions,
    read_stream_state,
    skipped_samples,
)
from disco_clip_ds.errors import CheckpointError

logger = logging.getLogger("disco_clip_ds.train")


class StreamPositions:
    """This rank's readers' newest positions (`note` each batch's), gathered from every rank before a checkpoint
    is written (`gather`), written into it by rank 0 (`write`), and restored from one on resume (`restore`)."""

    # Batches whose positions wait on the device before they are folded in (a bound on the memory they hold)
    MAX_PENDING = 1024

    def __init__(self):
        self.positions: dict[int, list[int]] = {}  # reader -> newest position trained on
        self.pending: list[torch.Tensor] = []  # batches' position rows not yet read on the host
        self.rows = None  # every rank's positions, gathered for the checkpoint being saved

    def note(self, batch_positions) -> None:
        """The positions a batch carried (its POSITION_KEY), or None. Kept as they are (on the device): reading
        them is a host sync, left to `fold`."""
        if batch_positions is not None:
            self.pending.append(batch_positions)
        if len(self.pending) >= self.MAX_PENDING:
            self.fold()

    def fold(self) -> None:
        """Read the pending positions on the host, in one copy (DiscoTrainer calls it at a logging step, where the
        Trainer reads its loss on the host anyway, and before a save)."""
        if self.pending:
            rows, self.pending = torch.cat(self.pending), []
            note_positions(self.positions, rows)

    def gather(self, stream, num_workers: int, accelerator, device) -> None:
        """Every rank's newest positions, gathered before anything of a checkpoint is written: a collective inside
        the save would hang when one rank's write fails before it."""
        self.fold()
        width = len(getattr(stream, "position_fields", POSITION_FIELDS))
        rows = as_rows(self.positions, max(1, num_workers), width)
        self.rows = accelerator.gather(rows.to(device)).cpu()

    def figures(self, stream, num_workers: int, accelerator, device) -> dict[str, int]:
        """{"skipped_samples": n} and, for a weighted mixture, the samples trained on from each source
        ({"samples_seen_source{i}": n}, i the i-th '::' source), over every rank's readers: each reader's newest
        position counts its skips and its draws per source (data/mix.py), so both continue across a resume and do not
        depend on what the readers prefetched. A collective: every rank calls it at the same step."""
        self.fold()
        width = len(getattr(stream, "position_fields", POSITION_FIELDS))
        rows = accelerator.gather(as_rows(self.positions, max(1, num_workers), width).to(device)).cpu()
        newest: dict[int, list[int]] = {}
        note_positions(newest, rows[rows[:, 0] >= 0])  # a reader two split ranks share counts once
        figures = {"skipped_samples": skipped_samples(newest)}
        if hasattr(stream, "seen_per_source"):
            figures.update({f"samples_seen_source{i}": n for i, n in enumerate(stream.seen_per_source(newest))})
        return figures

    def write(self, stream, output_dir: str, world_process_zero: bool) -> None:
        """stream_state.json in the checkpoint folder being saved (rank 0 writes what every rank gathered)."""
        if world_process_zero and self.rows is not None and isinstance(stream, ReaderStream):
            stream.write_state(output_dir, self.rows)

    def restore(self, stream: ReaderStream, checkpoint, num_batches: int, per_step: int) -> None:
        """Seek `stream` to where each reader stood in `checkpoint` after `num_batches` optimizer steps
        (`per_step`: the batches a rank's loader hands out per step)."""
        state = read_stream_state(checkpoint)
        if state is None:
            raise CheckpointError(
                f"{checkpoint} has no {STATE_FILE}, so the data stream cannot continue where it stood: pass "
                "--ignore_data_skip to restart the data stream (samples seen before are seen again)"
            )
        positions = stream.positions_from(state, checkpoint)
        stream.restore(positions, num_batches * per_step)
        # this rank's readers stand there until their next batch: a save before it must keep their positions
        mine = range(stream.reader_rank * stream.workers, (stream.reader_rank + 1) * stream.workers)
        self.positions.update({r: [r, *pos] for r, pos in positions.items() if r in mine})
        logger.info("resume: the data stream seeks to where %d readers stood in %s", len(positions), checkpoint)
