"""`python -m disco_clip_ds.train`, as every launcher runs it, in a fresh interpreter."""

import subprocess
import sys

import pytest

from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import REPO

MODEL = ["--model_config", str(REPO / "recipes/models/tiny.json")]


@pytest.mark.slow  # a fresh interpreter
def test_python_m_train_exits_with_the_errors_code_and_one_line(tmp_path):
    """`python -m disco_clip_ds.train` maps errors as `disco-clip train` does."""
    write_shards(tmp_path / "data", num_shards=2, per_shard=4)
    argv = ["--output_dir", str(tmp_path / "out"), "--train_shards", str(tmp_path / "data"), *MODEL]
    result = subprocess.run(
        [sys.executable, "-m", "disco_clip_ds.train", *argv], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 2
    assert "disco-clip train: training from --model_config needs --tokenizer_name" in result.stderr
    assert "Traceback" not in result.stderr
