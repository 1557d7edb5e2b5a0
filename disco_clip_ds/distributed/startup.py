"""A stop signal during start-up: from the first line of `disco-clip train` until the trainer's `StopOnSignal` takes
over (imports, the process group, validation, the model, DeepSpeed: ~15 s), SIGTERM or SIGUSR1 ends the rank at once
with one line and exit code 75 (nothing was trained or saved by this command: re-running it is all there is to do),
instead of the default action, which kills it without a word.

Light on purpose (the standard library and errors only): it is installed before torch and transformers are imported.
The signal is seen by a thread reading the interpreter's wakeup fd (`signal.set_wakeup_fd`), not by the Python-level
handler, so that it ends the rank even while the main thread waits inside C++ (joining the process group, a
collective), where a Python handler would run only once the wait returns.

`os._exit` skips every `finally` and atexit handler, so what start-up makes that the end of the process does not undo
is undone by the watch itself before it ends the rank: rank 0's hold on run.lock (`runlock.py` registers it with
`clean_up_on_stop` while it holds it), and DeepSpeed's /dev/shm buffers. Those are named from DeepSpeed's comm set-up
until every rank has mapped them, and a peer still mapping them spins in C, holding the GIL, until each one exists: a
rank that removed them then would hang its peers, and one that left them would leak them. So the set-up is one
section (`start_deepspeed_comm`) that a stop lets finish, every rank's buffer unlinked, before the rank ends. Each
start-up stage is a fault point (`at_startup_point`), so that a test stops a rank at each one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

from disco_clip_ds import faults
from disco_clip_ds.errors import EXIT_PREEMPTED, say

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # --stop_signals' default: the arguments are not parsed yet
_wakeup_w: int | None = None  # the write end of our wakeup pipe while start-up is watched
_before: dict[int, object] = {}  # the handlers start-up's replaced, given back by `end_startup`
_cleanups: list[Callable[[], None]] = []  # run by the watch before it ends the process (`clean_up_on_stop`)
_section = threading.Lock()  # orders a stop against the DeepSpeed comm section's start and end
_stopping = False  # a stop signal was seen (set under _section)
_section_over = threading.Event()  # clear while the section runs
_section_over.set()
# How long a stop waits for the section: past it, the section is stuck on a peer that is gone (its collective waits
# out the process group's timeout), and the deepspeed launcher kills a rank 30 s after its SIGTERM.
SECTION_WAIT_S = 20

# The start-up stages, in their order: DISCO_FAULT signal_at_startup:stage=N stops a rank at stage N (faults.py).
ARGUMENTS = 0  # the arguments parsed and the process group joined (commands/train.py)
VALIDATED = 1  # every argument checked, output_dir not locked yet (train/run.py)
LOCKED = 2  # output_dir's run lock held (train/run.py)
DEEPSPEED_BUFFERS = 3  # DeepSpeed's comm up, its /dev/shm buffers named, not unlinked yet (start_deepspeed_comm)
BUILT = 4  # the model and the data built, the trainer (whose StopOnSignal takes over) not yet (train/run.py)

# What rank 0 says at each stage, so that a start-up of a minute (imports, validation, the model, DeepSpeed) is not
# silent: what is done, and what comes next.
PHASES = {
    ARGUMENTS: "the arguments read, the process group joined; next: checking the arguments, the data and the model",
    VALIDATED: "every argument checked; next: output_dir's run lock and the resume point",
    LOCKED: "output_dir locked; next: the communication backend, the model and the data",
    DEEPSPEED_BUFFERS: "DeepSpeed's communication up; next: the model and the data",
    BUILT: "the model and the data built; next: the Trainer, DeepSpeed's engine and the first step",
}
_STARTED = time.monotonic()  # this module is imported first thing by `disco-clip train`


def watch_startup(prog: str, signals: tuple[int, ...] = SIGNALS) -> bool:
    """Until `end_startup`, each of `signals` ends this process with one line (`prog: ...`) and EXIT_PREEMPTED. Only
    from the main thread, and only where no one else set a wakeup fd; returns whether it is watching."""
    global _wakeup_w
    if _wakeup_w is not None or threading.current_thread() is not threading.main_thread():
        return _wakeup_w is not None
    r, w = os.pipe()
    os.set_blocking(w, False)  # the C-level handler must never block on it
    if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:  # someone else's: leave it to them
        signal.set_wakeup_fd(-1)
        os.close(r), os.close(w)
        return False
    _wakeup_w = w
    for s in signals:
        _before[s] = signal.signal(s, _seen_by_the_watch)
    threading.Thread(target=_watch, args=(r, prog), daemon=True, name="startup-stop").start()
    return True


def _seen_by_the_watch(signum, frame) -> None:
    """The Python-level handler: nothing to do (the C-level one has written the signal to the wakeup fd), but
    installing one is what replaces the default action, death."""


def _watch(r: int, prog: str) -> None:
    global _stopping
    data = os.read(r, 1)  # blocks until a signal's number, or b"" once `end_startup` closes the write end
    if not data:
        os.close(r)
        return
    # The read end stays open until the process ends: a second signal during the stop (the launcher's, after the
    # fault's) writes to the pipe, and a closed one is an EPIPE that Python reports on stderr as a traceback.
    where = f"{prog}: [rank {os.environ.get('RANK', '0')}] {signal.Signals(data[0]).name} during start-up"
    with _section:
        _stopping = True
    _section_over.wait(SECTION_WAIT_S)
    _clean_up()
    say(
        f"{where}, before training began: stopped; nothing was trained or saved by this run, re-run the same "
        f"command (exit code {EXIT_PREEMPTED})"
    )
    os._exit(EXIT_PREEMPTED)


def clean_up_on_stop(cleanup: Callable[[], None]) -> None:
    """Have the watch run `cleanup()` before it ends the process on a stop signal (until `forget_cleanup`). It runs
    in the watch's thread while the main thread may be anywhere in start-up: it must be quick, never wait for the
    main thread, and tolerate what it undoes being half made."""
    _cleanups.append(cleanup)


def forget_cleanup(cleanup: Callable[[], None]) -> None:
    """Undo `clean_up_on_stop(cleanup)`: what it undoes is gone, or in the hands of the code after start-up."""
    with contextlib.suppress(ValueError):
        _cleanups.remove(cleanup)


def _clean_up() -> None:
    """The registered cleanups, then DeepSpeed's shm buffers of this run; a cleanup that fails is reported and the
    rest still run (the rank ends with its exit code 75 whatever happens here)."""
    for cleanup in [*_cleanups, _remove_deepspeed_shm_buffers]:
        try:
            cleanup()
        except Exception as error:  # noqa: BLE001 - the process ends next: say what was left, go on
            say(f"[rank {os.environ.get('RANK', '0')}] start-up stop: {cleanup.__qualname__} failed: {error}")


def _remove_deepspeed_shm_buffers() -> None:
    # imported here, not above: the watch is installed before anything heavy is imported (compat is light, but it
    # reads package versions at import)
    from disco_clip_ds import compat

    compat.remove_deepspeed_shm_buffers()


@contextlib.contextmanager
def _stops_wait():
    """A section that a stop lets finish: the watch ends the process once it is over, and the main thread goes no
    further (it waits there for its end)."""
    with _section:
        stopping = _stopping
        if not stopping:
            _section_over.clear()
    if stopping:  # the watch is ending the process already, and waits for no section
        threading.Event().wait()
    try:
        yield
    finally:
        with _section:
            _section_over.set()
            stopping = _stopping
        if stopping:
            threading.Event().wait()


def start_deepspeed_comm(args) -> None:
    """`compat.init_deepspeed_comm(args)` as a section that a stop lets finish (see above): its buffers are created,
    mapped by every rank and unlinked before a stop ends the rank. Its fault point, DEEPSPEED_BUFFERS, lies where
    the buffers are named."""
    from disco_clip_ds import compat  # see _remove_deepspeed_shm_buffers
    from disco_clip_ds.distributed.ranks import barrier

    with _stops_wait():
        # every rank enters before any buffer exists: a peer stopped just before the section (a stop of its own, or
        # a group's signal that found it a moment behind) ends this wait with a lost-peer error, where DeepSpeed's
        # set-up would have created this rank's buffer and then spun, in C, for the peer's, until killed
        barrier()
        compat.init_deepspeed_comm(args, at_buffers=lambda: at_startup_point(DEEPSPEED_BUFFERS))


def startup_wakeup_fd() -> int | None:
    """The wakeup fd start-up's watch reads (None: not watching): the one a taker-over may replace."""
    return _wakeup_w


def end_startup(keep: tuple[int, ...] = ()) -> None:
    """Stop watching: the signals of `keep` keep the handlers a taker-over has installed by now; the others get
    back what they had before (the default action, death, in a fresh process). Call after installing the handlers
    that take over, so that no signal falls between; and at the end of an in-process run that never got there."""
    global _wakeup_w
    if _wakeup_w is None or threading.current_thread() is not threading.main_thread():
        return
    current = signal.set_wakeup_fd(-1)
    if current != _wakeup_w:  # the taker-over's: keep it
        signal.set_wakeup_fd(current, warn_on_full_buffer=False)
    for s, before in _before.items():
        if s not in keep and signal.getsignal(s) is _seen_by_the_watch:
            signal.signal(s, before)
    _before.clear()
    os.close(_wakeup_w)  # the watch reads b"" and ends
    _wakeup_w = None


def at_startup_point(stage: int = ARGUMENTS) -> None:
    """The fault point of start-up stage `stage` (ARGUMENTS ... BUILT above): DISCO_FAULT
    `signal_at_startup[=SIG][:stage=N][,rank=R]` sends SIGTERM (or SIG) to this rank there (no stage: at the first).
    Rank 0 says the stage's line of PHASES with the seconds since start."""
    if os.environ.get("RANK", "0") == "0":
        print(f"start-up ({time.monotonic() - _STARTED:.0f} s): {PHASES[stage]}", flush=True)
    spec = faults.fault("signal_at_startup", stage=stage)
    if spec:
        name = (spec.value or "SIGTERM").upper()
        os.kill(os.getpid(), signal.Signals[name if name.startswith("SIG") else "SIG" + name])
        # the watch ends the process: wait for it here, so that nothing else runs first; in a section, which a
        # stop lets finish, the section's end waits instead
        if _wakeup_w is not None and _section_over.is_set():
            threading.Event().wait(60)


def cpu_accelerator_when_no_gpu() -> None:
    """DS_ACCELERATOR=cpu (inherited by child processes) when no GPU is visible and no accelerator is named: DeepSpeed
    would warn in each process that it found none and took the CPU, which is what a machine without a GPU means."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
