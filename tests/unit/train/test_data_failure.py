"""train/data_failure.py: a DataLoader worker killed as the kernel's out-of-memory killer kills it (SIGKILL, sent by
the DISCO_FAULT point `kill_worker_at_step`) is one line naming the cause, the flags that lower the memory and the
resume command; torch's own error is the reference (a real worker, really killed). (Launched, with a resume:
launched/test_faults_and_preemption.py.)"""

import time

import pytest
import torch

from disco_clip_ds import faults
from disco_clip_ds.errors import DataError
from disco_clip_ds.train.data_failure import DataFailures, worker_lost


class _Endless(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(2)


def _killed_worker_error(monkeypatch) -> tuple[RuntimeError, int]:
    """torch's error for a DataLoader worker killed through the fault point, and the worker's pid."""
    loader = iter(torch.utils.data.DataLoader(_Endless(), batch_size=1, num_workers=1, prefetch_factor=1))
    next(loader)
    (worker,) = loader._workers
    monkeypatch.setenv(faults.ENV, "kill_worker_at_step:step=3")
    faults.at_step_end(2)
    assert worker.is_alive()  # the fault fires at its step only
    # torch's SIGCHLD handler may raise in this thread at any point once the worker is dead: all of it is inside
    with pytest.raises(RuntimeError) as error:
        faults.at_step_end(3)
        worker.join(timeout=10)
        time.sleep(0.2)  # the prefetched batch is taken first; then torch notices
        for _ in range(10):
            next(loader)
    worker.join(timeout=10)
    assert worker.exitcode == -9
    loader._shutdown_workers()
    return error.value, worker.pid


def test_a_killed_worker_is_one_line_with_its_cause_and_the_resume_command(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train", "--output_dir", "run"])
    error, pid = _killed_worker_error(monkeypatch)
    assert "DataLoader worker (pid" in str(error) and str(pid) in str(error)  # torch's words, the reference
    lost = worker_lost(error, 1)
    assert isinstance(lost, DataError) and "\n" not in str(lost)
    assert str(lost).startswith(f"rank 1: DataLoader worker (pid {pid}) ")
    assert "lower --dataloader_num_workers, --shuffle_buffer or --per_device_train_batch_size" in str(lost)
    assert "re-run the same command with --resume_from_checkpoint latest" in str(lost)
    # the fetch's path: every rank raises the one line, not the traceback
    failures = DataFailures()
    failures.error = error
    with pytest.raises(DataError, match=rf"^rank 1: DataLoader worker \(pid {pid}\)"):
        failures.raise_everywhere(1)


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "DataLoader worker (pid 12) is killed by signal: Killed. ",
            "was killed by signal Killed, most often by the kernel's out-of-memory killer",
        ),
        (
            "DataLoader worker (pid 12) is killed by signal: Bus error. It is possible",
            "most often out of shared memory",
        ),
        (
            "DataLoader worker (pid(s) 12, 13) exited unexpectedly",
            "(pid 12, 13) exited unexpectedly, killed, most often by the kernel's out-of-memory killer",
        ),
    ],
)
def test_each_of_torchs_words_for_a_dead_worker_is_recognised(monkeypatch, text, said):
    monkeypatch.setattr("sys.argv", ["train", "--resume_from_checkpoint", "latest"])
    lost = str(worker_lost(RuntimeError(text), 0))
    assert said in lost and lost.endswith("then re-run the same command; the last complete checkpoint stays usable")
    segv = str(worker_lost(RuntimeError("DataLoader worker (pid 9) is killed by signal: Segmentation fault. "), 0))
    assert "Segmentation fault, a crash whose words are lost with it (--dataloader_num_workers 0" in segv
    assert worker_lost(RuntimeError("CUDA out of memory"), 0) is None and worker_lost(ValueError(text), 0) is None
