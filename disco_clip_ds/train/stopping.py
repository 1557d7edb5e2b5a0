"""The Trainer side of stop signals: a `StopOnSignal` callback on every rank, DataLoader workers that leave the
signals to their rank (disco_clip_ds.distributed.preemption has the signal handling itself)."""

from __future__ import annotations

import atexit
import signal

from disco_clip_ds.distributed.preemption import StopOnSignal


class StopSignals:
    """Stop signals for the Trainer: `stopper`, a `StopOnSignal` callback made before the DataLoader forks its
    workers, stops training on them; `leave_to_rank` makes the DataLoader's workers ignore them (the rank handles
    them; a worker killed by SIGTERM would abort the run)."""

    def __init__(self, signals: tuple[int, ...] = ()):
        self.signals = tuple(signals)
        self.stopper = StopOnSignal(self.signals)

    def leave_to_rank(self, loader):
        """The training DataLoader, its workers set to ignore the stop signals."""
        base = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper iterates the DataLoader it holds
        if self.signals and getattr(base, "num_workers", 0) > 0:
            base.worker_init_fn = _IgnoreSignals(self.signals, base.worker_init_fn)
            atexit.register(_kill_workers)
        return loader


class _IgnoreSignals:
    """worker_init_fn: ignore the stop signals, then run the previous init (picklable, for spawn)."""

    def __init__(self, signals, then):
        self.signals, self.then = signals, then

    def __call__(self, worker_id):
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def _kill_workers() -> None:
    # Workers that ignore SIGTERM would make multiprocessing's exit handler (terminate, then join) wait forever
    # when the rank leaves on an error; at exit they hold nothing worth keeping.
    import multiprocessing

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # not torch's handler: a killed worker is no error now
    for worker in multiprocessing.active_children():
        worker.kill()
        worker.join(timeout=5)
