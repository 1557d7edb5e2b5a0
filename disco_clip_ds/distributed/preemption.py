"""Stopping cleanly: on a stop signal (SIGTERM, SIGUSR1 by default) every rank stops at the next step boundary with
a complete checkpoint and `disco-clip train` raises `Preempted`; a rank whose launcher died exits at once instead of
training on unsupervised; a finished run stays finished.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path

from transformers import TrainerCallback

from disco_clip_ds import faults
from disco_clip_ds.distributed import startup
from disco_clip_ds.distributed.ranks import rank
from disco_clip_ds.errors import EXIT_LAUNCHER_GONE, Preempted, UsageError, say


def parse_signals(names: str) -> tuple[int, ...]:
    """'SIGTERM,SIGUSR1' -> signal numbers; '' or 'none' -> ()."""
    if names.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(
            signal.Signals[n.strip().upper() if n.strip().upper().startswith("SIG") else "SIG" + n.strip().upper()]
            for n in names.split(",")
        )
    except KeyError as e:
        raise UsageError(f"--stop_signals {names}: unknown signal {e}; e.g. SIGTERM,SIGUSR1") from None


class StopOnSignal(TrainerCallback):
    """On a stop signal at any rank, every rank stops at the next step boundary (the flag rides the trainer's one
    all-reduce at the step's end: `requested`, then `stop`), the Trainer saves a checkpoint, and `stopped` names the
    signal. Installs the handlers at once, so that
    DataLoader workers forked later inherit them before their init ignores them.

    Also watches the launcher: a rank whose launcher died without a stop signal exits at once (EXIT_LAUNCHER_GONE)
    instead of training on unsupervised. Its last complete checkpoint stays usable."""

    def __init__(self, signals: tuple[int, ...], watch_launcher: bool = True, poll_s: float = 0.5):
        self.signals, self.received, self.stopped = signals, None, None
        self._wakeup_r = None
        if signals and threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            for s in signals:  # first, so that a signal now is start-up's stop or ours, never the default death
                signal.signal(s, self._on_signal)
            if signal.set_wakeup_fd(w, warn_on_full_buffer=False) in (-1, startup.startup_wakeup_fd()):
                self._wakeup_r = r  # the C-level handler writes here at once, even while Python is busy in C
        startup.end_startup(keep=signals)  # the start-up's stop hands over (the signals not kept: their default)
        self._watch_done, self._watch = threading.Event(), None
        if watch_launcher and os.environ.get("LOCAL_RANK") is not None and Path("/proc").is_dir():
            self._watch = threading.Thread(
                target=self._watch_launcher, args=(poll_s,), daemon=True, name="launcher-watch"
            )
            self._watch.start()
            atexit.register(self.stop_watching)  # whatever ends the run: no thread of ours left at exit

    def _on_signal(self, signum, frame):
        # Nothing said yet: a step whose peer died never ends (the launcher then kills this rank), so a promise of a
        # checkpoint here could be false. `stop` says it once the step ended and every rank agreed to stop.
        if self.received is None:
            self.received = signum

    def _signal_seen(self) -> bool:
        if self.received is not None:
            return True
        if self._wakeup_r is not None:
            try:
                return bool(os.read(self._wakeup_r, 64))
            except BlockingIOError:
                return False
        return False

    def _watch_launcher(self, poll_s: float) -> None:
        # The deepspeed command runs launch.py, which runs the ranks: killing the command alone leaves launch.py
        # and the ranks running, so watch the grandparent too. torchrun and accelerate are the parent.
        parent = os.getppid()
        chain = [parent]
        if b"deepspeed.launcher.launch" in _read_proc(parent, "cmdline"):
            chain.append(_ppid(parent))
        while not self._watch_done.wait(poll_s):
            if self._signal_seen():
                return  # a stop is under way: it saves and exits on its own, whatever the launcher does
            if os.getppid() != parent or (len(chain) > 1 and _ppid(parent) != chain[1]):
                say(
                    f"[rank {rank()}] launcher (pid {chain[-1]}) is gone: exiting, the last complete checkpoint "
                    "stays usable"
                )
                os._exit(EXIT_LAUNCHER_GONE)

    def stop_watching(self) -> None:
        """Stop the launcher watch and wait for it: once training ends, its work is done."""
        self._watch_done.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=5)

    def on_train_end(self, args, state, control, **kwargs):
        self.stop_watching()

    def on_step_end(self, args, state, control, **kwargs):
        faults.at_step_end(state.global_step)

    def requested(self) -> bool:
        """Whether this rank received a stop signal: DiscoTrainer carries it to every rank in the step's one
        all-reduce (train/step_flags.py) and hands the verdict to `stop`."""
        return bool(self.signals) and self._stop_requested()

    def stop(self, state, control, signalled: bool) -> bool:
        """Stop at this step with a checkpoint when any rank was `signalled`; whether it stops. At max_steps the run
        ends and saves anyway: finished, not preempted."""
        if not signalled or state.global_step >= state.max_steps:
            return False
        self.stopped = self.received or "a signal on another rank"
        control.should_save = control.should_training_stop = True
        if self.received is not None:  # the rank that got it says so, now that it is what happens
            say(f"[rank {rank()}] {self.describe()}: stopping at step {state.global_step}, saving a checkpoint")
        return True

    def _stop_requested(self) -> bool:
        # a call of its own: CPython runs pending signal handlers on entering a function, so a signal this rank
        # sent itself just before is seen here, deterministically
        return self.received is not None

    def describe(self) -> str:
        """The name of the signal that stopped the run (or that it came from another rank)."""
        return self.stopped if isinstance(self.stopped, str) else signal.Signals(self.stopped).name


def _read_proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    stat = _read_proc(pid, "stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else -1


# --- a finished run stays finished ---


def finished_message(step: int | None, max_steps: int, checkpoint: str | os.PathLike = "") -> str | None:
    """A message when the checkpoint resumed from (`checkpoint`, saved at optimizer step `step`; None: there is
    none) has already reached max_steps (re-running would train past the end). The caller reads the step
    (checkpoint.layout.checkpoint_step): that room is above this one."""
    if step is None:
        return None
    if step < max_steps:
        return None
    return (
        f"run finished: {Path(checkpoint).name} reached step {step} of --max_steps {max_steps}; nothing to do "
        f"(raise --max_steps to train on)"
    )


def resume_hint(output_dir: str, signame: str, step: int) -> str:
    """What a run stopped by `signame` saved, and the command that resumes it."""
    return (
        f"stopped by {signame} at step {step}: checkpoint-{step} saved in {output_dir}; resumable: "
        f"{resume_command()} (exit code {Preempted.exit_code})"
    )


def resume_command() -> str:
    """How to resume this command's run from its newest complete checkpoint: 're-run the same command', with
    --resume_from_checkpoint latest when it has no --resume_from_checkpoint."""
    again = "" if "--resume_from_checkpoint" in " ".join(sys.argv[1:]) else " with --resume_from_checkpoint latest"
    return f"re-run the same command{again}"


# --- a launched rank's exit ---


def exit_without_finalization(code: int) -> None:
    """Make this process, once it exits, end with `code` without interpreter finalization: the atexit handlers
    still run (all of them, in their order) and the standard streams are flushed, then `os._exit(code)`. Call in a
    launched rank whose outcome is decided (`code`: what `sys.exit` will be given) and process group destroyed.

    Why: DeepSpeed ties the data-parallel process group to every model parameter (`param._dp_group`), so
    `destroy_process_group()` cannot free it and its gloo worker threads (C++) live on into finalization, as may
    our launcher watch. A C++ thread that needs the GIL there (to release a tensor a finished collective held) is
    ended by CPython with `pthread_exit`, which aborts the whole process through a noexcept frame ("terminate
    called without an active exception", SIGABRT: exit 250 under the deepspeed launcher), after the checkpoint
    was saved and the exit code decided (pytorch/pytorch#38228). Without finalization no thread is ended so."""

    def exit_now():
        atexit.unregister(exit_now)
        atexit._run_exitfuncs()  # the other handlers: DataLoader workers, multiprocessing's finalizers, logging
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    atexit.register(exit_now)  # registered last, so it runs first
