#!/usr/bin/env bash
# The test command: sets up .venv at the repo root when missing, then runs pytest.
# Idempotent: a second run only re-installs when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=$VENV/bin/python

[ -x "$PY" ] || python3 -m venv "$VENV"
# torch first: a bare `torch` requirement pulls a multi-GB CUDA build on a machine without one.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
stamp=$VENV/.disco-clip-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$PY" -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
# timm's optimizer files, the reference of tests/unit/train/test_lamb.py, in a folder of their own off the import path
# (testing/timm_reference.py): without timm's dependencies, since its torchvision requirement would replace this CPU
# torch with a CUDA build, and not in the venv, where `accelerate launch` would import it and fail without torchvision
if [ ! -d "$VENV/peers/timm-ref/timm/optim" ]; then
  "$PY" -m pip install -q --no-deps --target "$VENV/peers/timm-ref" "timm>=1.0,<2"
fi
# DeepSpeed JIT-compiles its CPU shared-memory comm op (~1 min on 2 cores) at the first multi-rank launch; build it
# once here so that no launch inside a test's time limit pays for it. The build cache is keyed by name only and its
# build file names this venv's paths: a cache shared with another checkout's venv is rebuilt whenever the other one
# runs, so each venv keeps its own.
export TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch_extensions"
if [ ! -f "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
  DS_ACCELERATOR=cpu "$PY" -c "from deepspeed.accelerator import get_accelerator as a
a().create_op_builder('ShareMemCommBuilder').load(verbose=False)" >/dev/null 2>&1 || echo "note: DeepSpeed's shm comm op did not build; launches will try again"
fi
export HF_HUB_OFFLINE=1 NO_ALBUMENTATIONS_UPDATE=1 TOKENIZERS_PARALLELISM=false
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
# Two pytest workers (pytest-xdist), each given whole test files (--dist loadfile: a file's module fixtures, its
# reference runs, are built once): a launched test spends much of its time waiting (a launcher's start-up, a barrier,
# a timeout it provokes), which the other worker's test fills. DISCO_TEST_WORKERS=0 runs in one process; a -n or
# -p no:xdist among the arguments wins.
case " $* " in
  *" -n "*|*" -n"[0-9]*|*" --numprocesses"*|*"no:xdist"*) ;;
  *) set -- -n "${DISCO_TEST_WORKERS:-2}" --dist loadfile "$@" ;;
esac
exec "$PY" -m pytest "$@"
