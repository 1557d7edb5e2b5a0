"""timm's own optimizer files as a reference, without importing the `timm` package.

`import timm` imports torchvision (timm.layers), which the project does not install: on PyPI it would pull a CUDA
torch. Nor may timm sit in the venv: `accelerate` imports it whenever it is installed (its `estimate` command, which
every `accelerate launch` loads), and fails without torchvision. So tests/run.sh installs timm with `--no-deps` into
a folder of its own, `VENV/peers/timm-ref`, off the import path, and this loads `timm/optim/<name>.py` (and the
helpers it imports relatively) from there as a package of its own, leaving timm's __init__ unrun."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

_PACKAGE = "_timm_optim_reference"


FOLDER = Path(sys.prefix) / "peers" / "timm-ref"  # pip install --no-deps --target FOLDER 'timm>=1.0,<2'


def timm_optim(name: str) -> types.ModuleType:
    """timm's `timm.optim.<name>` module (e.g. "lamb"), loaded from timm's files in FOLDER; ImportError when they are
    not there (tests/run.sh puts them there)."""
    optim_dir = FOLDER / "timm" / "optim"
    if not optim_dir.is_dir():
        raise ImportError(f"timm's files are not in {FOLDER}: pip install --no-deps --target {FOLDER} 'timm>=1.0,<2'")
    if _PACKAGE not in sys.modules:
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [str(optim_dir)]  # submodules found there; its __init__ (every optimizer) never runs
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.{name}")
