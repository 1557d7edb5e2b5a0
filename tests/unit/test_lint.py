"""The tree stays as `ruff format` writes it and passes `ruff check` (pyproject.toml: lines <= 120, imports sorted)."""

import subprocess
import sys

from disco_clip_ds.testing.launch import REPO

PATHS = ["disco_clip_ds", "tests", "bench", "recipes", "data_prep"]


def test_ruff_check_and_format_are_clean():
    for command in (["check"], ["format", "--check"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, *PATHS], cwd=REPO, capture_output=True, text=True
        )
        assert result.returncode == 0, (
            f"ruff {' '.join(command)} (fix: ruff {command[0]} {' '.join(PATHS)}):\n{result.stdout}"
        )
