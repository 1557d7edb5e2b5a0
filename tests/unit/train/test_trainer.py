"""DiscoTrainer (`disco_clip_ds.train.trainer`): each Trainer hook overridden once, by one class; its components."""

import json
from types import SimpleNamespace

import pytest
from transformers import Trainer

from disco_clip_ds.errors import CheckpointError
from disco_clip_ds.train.stream_state import StreamPositions
from disco_clip_ds.train.trainer import DiscoTrainer


def test_no_trainer_method_is_defined_by_two_of_the_packages_classes():
    """What one step does reads in one class: no Trainer method (hooks and __init__ alike) is defined by two of the
    package's classes in DiscoTrainer's MRO (the mixin stack this replaced overrode the same hooks from five files)."""
    ours = [c for c in DiscoTrainer.__mro__ if c.__module__.startswith("disco_clip_ds.")]
    hooks = {name for name in dir(Trainer) if callable(getattr(Trainer, name, None))} | {"__init__"}
    defined_by: dict[str, list[str]] = {}
    for cls in ours:
        for name in hooks & set(vars(cls)):
            defined_by.setdefault(name, []).append(cls.__qualname__)
    assert {name: owners for name, owners in defined_by.items() if len(owners) > 1} == {}
    # the check sees the overrides (it would not pass vacuously)
    assert {"training_step", "compute_loss", "_save_checkpoint", "_save_rng_state", "__init__"} <= set(defined_by)


def test_the_check_finds_a_hook_defined_twice():
    """The walk above, on a stack like the old one: a mixin and the subclass both overriding compute_loss."""

    class Mixin:
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    Mixin.__module__ = "disco_clip_ds.fake"

    class Stacked(Mixin, DiscoTrainer):
        pass

    ours = [c for c in Stacked.__mro__ if c.__module__.startswith("disco_clip_ds.")]
    twice = [name for name in ("compute_loss",) if sum(name in vars(c) for c in ours) > 1]
    assert twice == ["compute_loss"]


class _Stream:
    """The parts of a ReaderStream that the restore uses."""

    rank, workers = 1, 2
    reader_rank = rank  # the rank whose readers it reads (another one's when ranks share readers)

    def __init__(self):
        self.restored = None

    def positions_from(self, state, checkpoint):
        return {int(r): tuple(row[1:]) for r, row in state["readers"].items()}

    def restore(self, positions, batches):
        self.restored = (positions, batches)


def test_a_checkpoint_without_stream_state_is_refused_with_the_way_out(tmp_path):
    """No fallback to skipping batches (checkpoints without stream_state.json were never released)."""
    with pytest.raises(CheckpointError, match="has no stream_state.json.*--ignore_data_skip"):
        StreamPositions().restore(_Stream(), tmp_path, num_batches=3, per_step=1)


def test_a_restore_keeps_this_ranks_readers_positions(tmp_path):
    readers = {str(r): [r, 10 + r, 0, 0, 0, 0] for r in range(4)}
    (tmp_path / "stream_state.json").write_text(json.dumps({"readers": readers}))
    stream, state = _Stream(), StreamPositions()
    state.restore(stream, tmp_path, num_batches=3, per_step=2)
    assert stream.restored[1] == 6  # batches handed out per rank: steps x batches per step
    assert sorted(state.positions) == [2, 3]  # rank 1 of 2 workers: readers 2 and 3
    assert state.positions[3] == [3, 13, 0, 0, 0, 0]


def test_stream_state_is_written_by_rank_0_only(tmp_path):
    from disco_clip_ds.data.streams.shards import ReaderStream

    class Stream(ReaderStream):
        def __init__(self):
            self.written = None

        def __iter__(self):
            return iter(())

        def write_state(self, folder, rows):
            self.written = (folder, rows)

    state, stream = StreamPositions(), Stream()
    state.rows = "rows"
    state.write(stream, "ckpt", world_process_zero=False)
    assert stream.written is None
    state.write(stream, "ckpt", world_process_zero=True)
    assert stream.written == ("ckpt", "rows")
    state.write(SimpleNamespace(), "ckpt", world_process_zero=True)  # not a ReaderStream: nothing to write
