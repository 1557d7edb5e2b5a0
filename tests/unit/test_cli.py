"""`disco-clip`: every level answers --help without importing torch; bad usage exits 2; library errors exit 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disco_clip_ds.cli import COMMANDS, main

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
