"""The end of an optimizer step (`train/step_flags.py`, `train/data_failure.py`): every rank's flags in one all-reduce,
the same verdict on every rank; a rank whose data loading fails trains the step on a stand-in and every rank raises
at the step's end with its one line. (The sync count of a real run: tests/launched/test_host_syncs.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from disco_clip_ds.errors import DataError
from disco_clip_ds.testing.ranks import run_ranks
from disco_clip_ds.train.data_failure import DataFailures
from disco_clip_ds.train.finite import FiniteCheck
from disco_clip_ds.train.step_flags import StepFlags, exchange

CPU = torch.device("cpu")


def test_one_process_flags_are_its_own():
    loss = torch.tensor(1.25, dtype=torch.float32)
    flags = exchange(loss, torch.tensor(3.0), torch.tensor(0.0), False, True, CPU)
    assert flags == StepFlags(1.25, 3.0, True, False, True)
    assert exchange(0.0, None, 2, True, False, CPU) == StepFlags(0.0, None, False, True, False)


def test_the_step_loss_is_summed_on_the_device_in_float64_as_python_would():
    losses = [torch.tensor(v, dtype=torch.float32) for v in (0.1, 0.7, 1e-8)]
    check = FiniteCheck()
    for loss in losses:
        check.add(loss)
    summed = check.take_loss()
    assert isinstance(summed, torch.Tensor) and summed.dtype == torch.float64
    assert summed.item() == sum(float(v) for v in losses)  # the host-side sum the check made before, bit for bit
    assert check.take_loss() == 0.0  # the next step starts afresh


def _flags(rank, world, losses, norm, bad, failed, stop):
    return exchange(torch.tensor(losses[rank]), norm, bad[rank], failed[rank], stop[rank], CPU)


@pytest.mark.slow
def test_one_ranks_flags_reach_every_rank():
    # rank 1's loss is NaN, rank 0's finite: both see the same NaN; rank 1's failure and rank 0's stop reach both
    results = run_ranks(_flags, 2, [1.0, math.nan], 2.0, [0, 0], [False, True], [True, False])
    assert all(math.isnan(f.loss) and f.grad_norm == 2.0 and f.weights_finite for f in results), results
    assert all(f.data_failed and f.stop for f in results)
    results = run_ranks(_flags, 2, [1.0, 3.0], None, [0, 1], [False, False], [False, False])
    assert results == [StepFlags(2.0, None, False, False, False)] * 2


class _Loader:
    """A fetch whose `fail_at`-th call (0-based) raises `error`."""

    def __init__(self, fail_at, error):
        self.calls, self.fail_at, self.error = 0, fail_at, error

    def __call__(self):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.error
        return [{"batch": self.calls}, {"batch": -self.calls}], None


def test_a_failed_fetch_trains_on_the_previous_updates_first_batch():
    failures, loader = DataFailures(), _Loader(1, DataError("reader 3 of rank 0: shard x.tar is truncated"))
    first = failures.fetch(loader, 2, 0, CPU)
    assert first[0] == [{"batch": 1}, {"batch": -1}] and not failures.failed
    stand_in = failures.fetch(loader, 2, 0, CPU)
    assert stand_in == ([first[0][0]] * 2, None) and stand_in[0][0] is first[0][0] and failures.failed
    with pytest.raises(DataError, match="^reader 3 of rank 0: shard x.tar is truncated$"):
        failures.raise_everywhere(0)


def test_a_failure_in_the_first_fetch_is_raised_at_once():
    failures = DataFailures()
    with pytest.raises(DataError, match="^rank 0's data loading failed: OSError: disk gone$"):
        failures.fetch(_Loader(0, DataError("rank 0's data loading failed: OSError: disk gone")), 2, 0, CPU)
    with pytest.raises(KeyError):  # a bug keeps its own type and traceback
        DataFailures().fetch(_Loader(0, KeyError("bug")), 2, 0, CPU)


def _fail_on_rank1(rank, world):
    """Three updates; rank 1's loader fails at the second. Each rank's step runs its collective on what it fetched
    (the stand-in on rank 1), then the step's flags; returns what each rank raised and how many steps it ran."""
    failures = DataFailures()
    loader = _Loader(1 if rank == 1 else None, DataError("reader 1 of rank 1: shard 00001.tar is truncated"))
    for step in range(1, 4):
        batches, _ = failures.fetch(loader, 2, rank, CPU)
        values = torch.tensor([float(b["batch"]) for b in batches])
        torch.distributed.all_reduce(values)  # the step's own collectives: no rank is missing from them
        if exchange(0.0, None, 0, failures.failed, False, CPU).data_failed:
            try:
                failures.raise_everywhere(rank)
            except DataError as error:
                return step, str(error)
    return step, None


@pytest.mark.slow
def test_a_data_failure_on_one_rank_ends_every_rank_at_that_step_with_its_line():
    results = run_ranks(_fail_on_rank1, 2)
    assert results == [(2, "reader 1 of rank 1: shard 00001.tar is truncated")] * 2
