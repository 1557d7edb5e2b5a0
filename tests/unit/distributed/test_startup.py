"""distributed/startup.py: a stop signal before the trainer's handlers are installed ends the process with one line
and exit code 75, even while the main thread waits in C; the trainer's StopOnSignal takes over from it. In fresh
interpreters that import only the module (no torch): a few tens of milliseconds each."""

import signal
import subprocess
import sys
import textwrap

from disco_clip_ds.testing.launch import REPO

_PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, threading
    from disco_clip_ds.distributed import startup

    how = sys.argv[1]
    if how != "unwatched":
        assert startup.watch_startup("disco-clip train")
    if how == "handed_over":  # as StopOnSignal does: its handler first, then the hand-over
        signal.signal(signal.SIGTERM, lambda *a: print("the trainer's handler", flush=True))
        startup.end_startup(keep=(signal.SIGTERM,))
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # not kept: what it was before
        os.kill(os.getpid(), signal.SIGTERM)
        sys.exit(0)
    if how == "fault":
        startup.at_startup_point()  # DISCO_FAULT=signal_at_startup=SIGUSR1
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(60)  # the main thread waits in C: the watch ends the process from its own thread
    print("never", flush=True)
    """
)


def _run(how: str, fault: str = "") -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "DISCO_FAULT": fault, "RANK": "1"}
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM, how], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_stop_signal_during_startup_is_one_line_and_exit_75():
    unwatched = _run("unwatched")
    assert unwatched.returncode == -signal.SIGTERM and unwatched.stderr == ""  # the default: killed without a word
    for how, fault, name in (("signal", "", "SIGTERM"), ("fault", "signal_at_startup=SIGUSR1", "SIGUSR1")):
        done = _run(how, fault)
        assert done.returncode == 75 and "never" not in done.stdout, done
        assert done.stderr.splitlines() == [
            f"disco-clip train: [rank 1] {name} during start-up, before training began: stopped; nothing was trained "
            "or saved by this run, re-run the same command (exit code 75)"
        ]


def test_the_trainers_handlers_take_over_from_the_startup_watch():
    done = _run("handed_over")
    assert (done.returncode, done.stdout, done.stderr) == (0, "the trainer's handler\n", "")
