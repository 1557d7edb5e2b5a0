"""A stop signal during start-up: from the first line of `disco-clip train` until the trainer's `StopOnSignal` takes
over (imports, the process group, validation, the model, DeepSpeed: ~15 s), SIGTERM or SIGUSR1 ends the rank at once
with one line and exit code 75 (nothing was trained or saved by this command: re-running it is all there is to do),
instead of the default action, which kills it without a word.

Light on purpose (the standard library and errors only): it is installed before torch and transformers are imported.
The signal is seen by a thread reading the interpreter's wakeup fd (`signal.set_wakeup_fd`), not by the Python-level
handler, so that it ends the rank even while the main thread waits inside C++ (joining the process group, a
collective), where a Python handler would run only once the wait returns.
"""

from __future__ import annotations

import os
import signal
import threading

from disco_clip_ds import faults
from disco_clip_ds.errors import EXIT_PREEMPTED, say

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # --stop_signals' default: the arguments are not parsed yet
_wakeup_w: int | None = None  # the write end of our wakeup pipe while start-up is watched
_before: dict[int, object] = {}  # the handlers start-up's replaced, given back by `end_startup`


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
    data = os.read(r, 1)  # blocks until a signal's number, or b"" once `end_startup` closes the write end
    os.close(r)
    if not data:
        return
    where = f"{prog}: [rank {os.environ.get('RANK', '0')}] {signal.Signals(data[0]).name} during start-up"
    say(
        f"{where}, before training began: stopped; nothing was trained or saved by this run, re-run the same "
        f"command (exit code {EXIT_PREEMPTED})"
    )
    os._exit(EXIT_PREEMPTED)


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


def at_startup_point() -> None:
    """The fault point of start-up, once the arguments are parsed and the process group joined (`commands/train.py`):
    DISCO_FAULT `signal_at_startup[=SIG][:rank=R]` sends SIGTERM (or SIG) to this rank there."""
    spec = faults.fault("signal_at_startup")
    if spec:
        name = (spec.value or "SIGTERM").upper()
        os.kill(os.getpid(), signal.Signals[name if name.startswith("SIG") else "SIG" + name])
        if _wakeup_w is not None:  # the watch ends the process: wait for it here, so that nothing else runs first
            threading.Event().wait(60)
