"""preemption.py in one process: the signal names, a finished run, the resume hint, the launcher watch's end, a
rank's exit without finalization. (Stopping ranks on a signal, and the launcher watch, under real launchers:
test_checkpoints.py; 10 stops in a row: test_exits.py.)"""

import json
import signal
from types import SimpleNamespace

import pytest

from disco_clip_ds.checkpoint.layout import checkpoint_step
from disco_clip_ds.distributed.preemption import StopOnSignal, finished_message, parse_signals, resume_hint
from disco_clip_ds.errors import UsageError


def test_stop_signals_are_named_with_or_without_sig():
    assert parse_signals("SIGTERM, usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == parse_signals(" ") == ()
    with pytest.raises(UsageError, match="--stop_signals SIGFOO: unknown signal"):
        parse_signals("SIGFOO")


def test_a_checkpoint_at_max_steps_is_a_finished_run(tmp_path):
    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    step = checkpoint_step(checkpoint)
    assert finished_message(None, 10) is None
    assert finished_message(step, 11, checkpoint) is None
    assert "run finished: checkpoint-10 reached step 10 of --max_steps 10" in finished_message(step, 10, checkpoint)


def test_the_resume_hint_names_the_checkpoint_and_the_exit_code(monkeypatch):
    monkeypatch.setattr("sys.argv", ["train.py", "--max_steps", "9"])
    hint = resume_hint("out", "SIGUSR1", 3)
    assert hint.startswith("stopped by SIGUSR1 at step 3: checkpoint-3 saved in out")
    assert "with --resume_from_checkpoint latest (exit code 75)" in hint
    monkeypatch.setattr("sys.argv", ["train.py", "--resume_from_checkpoint", "latest"])
    assert "with --resume" not in resume_hint("out", "SIGTERM", 3)


def test_the_launcher_watch_ends_with_training(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under a launcher
    stopper = StopOnSignal((), poll_s=0.05)
    assert stopper._watch.is_alive()
    stopper.on_train_end(None, None, None)
    assert not stopper._watch.is_alive()


def test_a_signal_is_announced_only_once_the_stop_is_decided(capsys):
    """A rank whose peer died gets the launcher's SIGTERM inside a step that never ends, and is killed without a
    checkpoint: it said "stopping after this step, with a checkpoint" at once. Now it says nothing until the step
    ended and the ranks agreed to stop, and then what it does."""
    stopper = StopOnSignal((), watch_launcher=False)
    stopper._on_signal(signal.SIGTERM, None)
    assert capsys.readouterr().err == ""  # the handler promises nothing
    state, control = SimpleNamespace(global_step=7, max_steps=10), SimpleNamespace()
    assert stopper.stop(state, control, signalled=True)
    assert capsys.readouterr().err == "[rank 0] SIGTERM: stopping at step 7, saving a checkpoint\n"
    assert control.should_save and control.should_training_stop
    other = StopOnSignal((), watch_launcher=False)  # stopped by another rank's signal: that rank says so
    assert other.stop(state, SimpleNamespace(), signalled=True) and capsys.readouterr().err == ""
