"""A rank whose data loading fails ends every rank, with one line, without a collective of its own every step.

The other ranks are already on their way into the step's collectives (the loss's gathers, the gradient reduction)
when one rank's loader raises. So that nobody waits on it, the failed rank trains the step on a stand-in (the previous
update's first micro-batch: the same shapes, already on the device), and its failure rides the step's flags
(train/step_flags.py): at the step's end, before anything of it is logged or saved, every rank raises. The run's
first fetch has no earlier batch to stand in: there, and only there, every rank learns of a failure in a collective
of its own.

A DataLoader worker that dies (SIGKILL from the kernel's out-of-memory killer, most often) is torch's RuntimeError
with the worker's pid, raised in the fetch or, from torch's SIGCHLD handler, anywhere in the step: `worker_lost` makes
it one line that names the likely cause, the flags that lower the memory, and the command that resumes.
"""

from __future__ import annotations

import re

import torch

from disco_clip_ds.data.streams.base import error_message
from disco_clip_ds.distributed.preemption import resume_command
from disco_clip_ds.distributed.ranks import any_true
from disco_clip_ds.errors import DataError


class DataFailures:
    """Wraps the Trainer's fetch of an update's batches (`fetch`); `failed` says whether this rank's fetch failed
    since the last step end, `raise_everywhere` raises on every rank (collective)."""

    def __init__(self):
        self.error: BaseException | None = None
        # Held until the next update's fetch succeeds, while the Trainer holds that update's batches anyway: one
        # micro-batch of inputs more during the step.
        self.stand_in = None
        self._first = True

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fetch(self, fetch_batches, num_batches: int, process_index: int, device):
        """fetch_batches() (the Trainer's get_batch_samples), or on failure the stand-in `num_batches` times."""
        first, self._first = self._first, False
        try:
            batches = fetch_batches()
        except Exception as error:  # every rank must learn of it: see raise_everywhere
            self.error = error
            stand_in = [] if self.stand_in is None else [self.stand_in] * num_batches
            batches = (stand_in, None)
        if first and any_true(self.failed, device):  # no stand-in yet: every rank learns of a failure now
            self.raise_everywhere(process_index)
        if not self.failed and batches[0]:
            self.stand_in = batches[0][0]
        return batches

    def raise_everywhere(self, process_index: int):
        """Raise on every rank once any rank's data loading failed (collective): its DataError as one line (the same on
        every rank); any other error, a bug, with its traceback on the rank that hit it."""
        failure, mine = worker_lost(self.error, process_index) or self.error, None
        if failure is not None:  # a DataError names its reader and rank; anything else gets the rank put first
            mine = error_message(failure).splitlines()[0] if isinstance(failure, DataError) else None
            mine = mine or f"rank {process_index}'s data loading failed: {type(failure).__name__}: {failure}"
            mine = mine.splitlines()[0]
        messages = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            messages = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(messages, mine)
        if failure is not None and not isinstance(failure, DataError):
            raise failure
        raise DataError(next(m for m in messages if m is not None)) from failure


# torch's words for a worker that died: "DataLoader worker (pid 123) is killed by signal: Killed." (its SIGCHLD
# handler), "DataLoader worker (pid(s) 123, 124) exited unexpectedly" (the fetch)
_WORKER_DIED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: ([^.]+)|exited unexpectedly)"
)
_OOM = "most often by the kernel's out-of-memory killer (see `dmesg`)"
_CAUSES = {None: _OOM, "Killed": _OOM, "Bus error": "most often out of shared memory (/dev/shm)"}


def worker_lost(error: BaseException | None, process_index: int) -> DataError | None:
    """The DataError, in one line, for torch's error of a DataLoader worker that died (None for any other error):
    its pid and signal, the likely cause, what lowers the memory, and the resume command."""
    match = _WORKER_DIED.search(str(error)) if isinstance(error, RuntimeError) else None
    if match is None:
        return None
    pids, signame = match.group(1).strip(), match.group(2)
    # "exited unexpectedly" (found dead by the fetch) says no more: a worker that raised would have said why, so a
    # kill is the likely cause there too
    died = f"was killed by signal {signame}" if signame else "exited unexpectedly, killed"
    cause = _CAUSES.get(signame, "a crash whose words are lost with it (--dataloader_num_workers 0 would show them)")
    return DataError(
        f"rank {process_index}: DataLoader worker (pid {pids}) {died}, {cause}: lower --dataloader_num_workers, "
        f"--shuffle_buffer or --per_device_train_batch_size, then {resume_command()}; the last complete checkpoint "
        "stays usable"
    )
