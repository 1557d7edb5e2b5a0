"""`disco-clip`: every level answers --help without importing torch; bad usage exits 2; library errors exit 1."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from disco_clip_ds.cli import COMMANDS, DefaultsOnce, main

PROBE = r"""
import sys
from disco_clip_ds.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers", "deepspeed", "img2dataset", "numpy") if m in sys.modules)
print("HEAVY", heavy, "CODE", code)
"""


@pytest.mark.parametrize("words", [[], ["data"], ["bench"]], ids=["top", "data", "bench"])
def test_every_level_has_help_without_heavy_imports(words):
    proc = subprocess.run([sys.executable, "-c", PROBE, *words, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY [] CODE 0" in proc.stdout, proc.stdout[-500:]  # answered by argparse alone
    names = [name for (group, name) in COMMANDS if group == (words[0] if words else None)]
    assert names and all(name in proc.stdout for name in names)


@pytest.mark.parametrize("argv", [["nope"], ["data"], ["data", "nope"], ["bench", "nope"]])
def test_unknown_or_missing_command_is_bad_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err or "arguments are required: COMMAND" in err, err


def test_a_command_gets_every_word_after_it(capsys):
    # --help after a command belongs to that command's own parser (here export's, which names its positionals)
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    assert "checkpoint_dir" in capsys.readouterr().out


def test_library_errors_become_exit_codes_with_the_message(tmp_path, capsys):
    assert main(["data", "verify", str(tmp_path)]) == 1  # a failed run: the library raised DataError
    assert "disco-clip data verify: no NNNNN.tar shard in" in capsys.readouterr().err
    assert main(["data", "verify", str(tmp_path / "nowhere")]) == 2  # bad usage: UsageError
    assert "is not a folder" in capsys.readouterr().err


def test_an_error_is_one_write_of_one_line(monkeypatch):
    """The ranks of a run share one stderr pipe: a line written in two pieces (text, then newline, as print() does)
    runs into another rank's line."""
    from disco_clip_ds.errors import UsageError, run_main

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    def fails(argv):
        raise UsageError("what to fix")

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert run_main(fails, [], "disco-clip train") == 2
    assert writes == ["disco-clip train: what to fix\n"]


def _option_helps(help_text: str) -> dict[str, str]:
    """Each option's (and positional's) entry of a --help text, its lines joined: first word -> entry."""
    options = help_text.split("\noptions:\n", 1)[-1]
    entries = [" ".join(entry.split()) for entry in re.split(r"\n  (?=\S)", "\n" + options) if entry.strip()]
    return {entry.split()[0]: entry for entry in entries}


# train's parser imports the Trainer, DeepSpeed and accelerate: too slow for the fast tier
VERBS = [
    pytest.param([*filter(None, key)], id=" ".join(filter(None, key)), marks=[pytest.mark.slow] * (key[1] == "train"))
    for key in COMMANDS
]


@pytest.mark.parametrize("words", VERBS)
def test_every_commands_help_states_each_default_once(words, capsys):
    """HfArgumentParser's formatter appended "(default: None)" to help that states the default in its own words
    ("(default: its only one) (default: None)"): each option's entry says "(default" once at most."""
    with pytest.raises(SystemExit) as exit_:
        main([*words, "--help"])
    assert exit_.value.code == 0
    helps = _option_helps(capsys.readouterr().out)
    assert len(helps) > 1 and not [entry for entry in helps.values() if entry.lower().count("(default") > 1]


def test_eval_help_states_its_defaults_in_its_own_words_or_argparses(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    helps = _option_helps(capsys.readouterr().out)
    assert helps["--split"].endswith("split of a datasets dataset (default: its only one)")  # not also None
    assert helps["--model"].endswith("or hub id")  # required: no default to state
    assert helps["--batch_size"].endswith("--batch-size BATCH_SIZE (default: 64)")  # no help of its own
    assert helps["--device"].endswith("torch device, e.g. cpu or cuda (default: cpu)")


def test_the_formatter_states_a_default_only_where_there_is_one_to_state(capsys):
    parser = argparse.ArgumentParser(prog="p", formatter_class=DefaultsOnce)
    parser.add_argument("--needed", required=True, help="required")
    parser.add_argument("--none", help="unset")
    parser.add_argument("--own", help="its own words (default: the other one's)")
    parser.add_argument("--after", type=int, default=4, help="a count; default: the other one's")
    parser.add_argument("--bare", type=int, default=3)
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("--rate", type=float, default=0.5, help="a rate")
    parser.print_help()
    helps = _option_helps(capsys.readouterr().out)
    names = ("needed", "none", "own", "after", "bare", "rate")
    assert [helps[f"--{name}"].split(maxsplit=2)[2] for name in names] == [
        "required",
        "unset",
        "its own words (default: the other one's)",
        "a count; default: the other one's",
        "(default: 3)",
        "a rate (default: 0.5)",
    ]
    assert helps["--flag"] == "--flag a switch"


def test_the_data_group_names_every_data_command_in_the_top_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("data ")]
    assert line.split(None, 1)[1] == "datasets: download, metadata, verify, embed, filter, demo"


@pytest.mark.parametrize(
    "argv, suggested",
    [
        (["trian"], "did you mean train?"),
        (["data", "filtr"], "did you mean filter?"),
        (["data", "verify", "x", "--decdoe", "2"], "unrecognized arguments: --decdoe 2; did you mean --decode?"),
        (["export", "a", "b", "--eml"], "did you mean --ema?"),
    ],
)
def test_an_unknown_command_or_option_gets_the_nearest_one(argv, suggested, capsys):
    assert _exit_code(argv) == 2 and suggested in capsys.readouterr().err


def test_an_option_near_none_gets_no_suggestion(capsys):
    assert _exit_code(["data", "verify", "x", "--zzzzqqq"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err


def _exit_code(argv) -> int:
    """The exit code of `disco-clip ARGV`: argparse's exit for the command words, run_main's for a command's."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code
