"""timm's own optimizer files as a reference, without importing the `timm` package.

`import timm` imports torchvision (timm.layers), which the project does not install: on PyPI it would pull a CUDA
torch. timm's optimizers themselves need only torch, so tests/run.sh installs timm with `--no-deps` and this loads
`timm/optim/<name>.py` (and the helpers it imports relatively) as a package of its own, leaving timm's __init__
unrun."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

_PACKAGE = "_timm_optim_reference"


def timm_optim(name: str) -> types.ModuleType:
    """timm's `timm.optim.<name>` module (e.g. "lamb"), loaded from the installed timm's files; ImportError when timm
    is not installed (tests/run.sh installs it)."""
    spec = importlib.util.find_spec("timm")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("timm is not installed: pip install --no-deps 'timm>=1.0,<2' (tests/run.sh does)")
    if _PACKAGE not in sys.modules:
        optim_dir = Path(next(iter(spec.submodule_search_locations))) / "optim"
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [str(optim_dir)]  # submodules found there; its __init__ (every optimizer) never runs
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.{name}")
