"""distributed/startup.py: a stop signal before the trainer's handlers are installed ends the process with one line
and exit code 75, even while the main thread waits in C; the trainer's StopOnSignal takes over from it. In fresh
interpreters that import only the module (no torch): a few tens of milliseconds each."""

import signal
import subprocess
import sys
import textwrap

import pytest

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
    if how == "cleanup":  # what the end of the process would not undo, undone by the watch before it ends it
        startup.clean_up_on_stop(lambda: print("cleaned up", flush=True))
        startup.clean_up_on_stop(lambda: 1 / 0)  # a cleanup that fails: said, and the others still run
        forgotten = lambda: print("forgotten", flush=True)
        startup.clean_up_on_stop(forgotten)
        startup.forget_cleanup(forgotten)
    if how == "section":  # a stop inside the section lets it finish, and the main thread goes no further
        with startup._stops_wait():
            os.kill(os.getpid(), signal.SIGTERM)
            while not startup._stopping:  # until the watch has the signal: it then waits for the section
                threading.Event().wait(0.01)
            print("section finished", flush=True)
        print("after the section", flush=True)
    if how == "fault_in_section":  # the fault point inside a section does not wait for the watch: the section ends
        with startup._stops_wait():
            startup.at_startup_point(startup.DEEPSPEED_BUFFERS)  # DISCO_FAULT=signal_at_startup:stage=3
            print("section finished", flush=True)
    if how == "fault":
        startup.at_startup_point(startup.LOCKED)  # DISCO_FAULT=signal_at_startup=SIGUSR1[:stage=2]
        print("never", flush=True)  # not stopped here
        sys.exit(0)
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


@pytest.mark.slow  # beyond the fast tier's time budget
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


def _one_line(name: str = "SIGTERM") -> str:
    return (
        f"disco-clip train: [rank 1] {name} during start-up, before training began: stopped; nothing was trained "
        "or saved by this run, re-run the same command (exit code 75)"
    )


def test_a_fault_point_fires_at_its_stage_alone():
    """signal_at_startup:stage=N stops at stage N and at no other; with no stage, at whichever comes first."""
    for fault, stopped in (("signal_at_startup:stage=2", True), ("signal_at_startup:stage=1", False)):
        done = _run("fault", fault)
        assert (done.returncode == 75) == stopped and ("never" in done.stdout) != stopped, (fault, done)


def test_the_watch_runs_the_registered_cleanups_before_it_ends_the_process():
    done = _run("cleanup")
    assert done.returncode == 75 and done.stdout == "cleaned up\n", done
    lines = done.stderr.splitlines()
    assert lines[-1] == _one_line() and len(lines) == 2 and "failed: division by zero" in lines[0], done.stderr


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_stop_inside_the_deepspeed_section_lets_it_finish_then_ends_the_process():
    """DeepSpeed's comm set-up is such a section: a rank that ended inside it would leave its shm buffers named (or
    remove them under a peer that still maps them, which then spins forever): the watch waits for its end."""
    for how, fault in (("section", ""), ("fault_in_section", "signal_at_startup:stage=3")):
        done = _run(how, fault)
        assert done.returncode == 75 and done.stdout == "section finished\n", (how, done)
        assert done.stderr.splitlines() == [_one_line()], (how, done)


def test_deepspeed_is_told_the_cpu_is_its_accelerator_only_without_a_gpu_and_a_choice(monkeypatch):
    import os

    import torch

    from disco_clip_ds.distributed import startup

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    startup.cpu_accelerator_when_no_gpu()
    assert os.environ.get("DS_ACCELERATOR") == (None if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    startup.cpu_accelerator_when_no_gpu()
    assert os.environ["DS_ACCELERATOR"] == "xpu"
