#!/usr/bin/env bash
# Create (or complete) the virtual environment used by the XLA tests: torch + torch-xla pinned
# together, the few runtime/test dependencies, and anyaccel installed editable from this checkout
# (unless PYTHONPATH already puts this checkout first, as `make test-xla` does).
#
#   scripts/setup_xla_venv.sh                 # -> .venv-xla (about 5 min and 7 GB the first time)
#   XLA_VENV=/path/to/venv scripts/setup_xla_venv.sh   # `make test-xla`: ~/.cache/anyaccel/venv-xla,
#                                             # kept across clones (then a few seconds)
#   PYTHON=python3.11 scripts/setup_xla_venv.sh
#
# Idempotent: a complete environment is left as it is (a few seconds). Then run
#   PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest tests/xla -m xla
# (tests/xla/test_xla.py sets PJRT_DEVICE=CPU itself when it is unset).
#
# The torch wheel comes from PyPI (the CUDA build: torch-xla 2.9 wheels on PyPI are built against
# it). Set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get the smaller CPU build where
# that index is reachable.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${XLA_VENV:-$ROOT/.venv-xla}"
TORCH_VERSION="2.9.0"
TORCH_XLA_VERSION="2.9.0"
DEPS=(pyyaml psutil safetensors numpy questionary tqdm pytest pytest-timeout)

if [ -z "${PYTHON:-}" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PYTHON="$candidate"; break; fi
  done
fi
if [ -z "${PYTHON:-}" ]; then
  echo "setup_xla_venv: no python3 found; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup_xla_venv: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
VPY="$(cd "$VENV" && pwd)/bin/python"  # absolute: the check below runs from /

# Are the pinned versions and every dependency already there?
if "$VPY" - "$TORCH_VERSION" "$TORCH_XLA_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
torch_v, xla_v = sys.argv[1], sys.argv[2]
assert md.version("torch").split("+")[0] == torch_v
assert md.version("torch-xla").split("+")[0] == xla_v
for dist in ("pyyaml", "psutil", "safetensors", "numpy", "questionary", "tqdm", "pytest", "pytest-timeout"):
    md.version(dist)
PY
then
  echo "setup_xla_venv: torch==$TORCH_VERSION torch-xla==$TORCH_XLA_VERSION already installed"
else
  echo "setup_xla_venv: installing torch==$TORCH_VERSION torch-xla==$TORCH_XLA_VERSION (first time: several minutes)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$VPY" -m pip install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  fi
  "$VPY" -m pip install "torch==$TORCH_VERSION" "torch-xla==$TORCH_XLA_VERSION" "${DEPS[@]}"
fi

# anyaccel from this checkout (editable, without touching the pinned torch), unless the caller's
# PYTHONPATH already puts this checkout first (`make test-xla` does: then an editable install would
# only rewrite the cached environment's link to whichever clone ran last, and pip would build it in
# an isolated environment, fetching setuptools from the index: ~13 CPU-s in every fresh clone).
FROM_ROOT="import anyaccel, os, sys; sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(anyaccel.__file__))) == sys.argv[1] else 1)"
if [ -n "${PYTHONPATH:-}" ] && (cd / && "$VPY" -c "$FROM_ROOT" "$ROOT") >/dev/null 2>&1; then  # from /: -c puts the cwd first
  echo "setup_xla_venv: anyaccel comes from $ROOT through PYTHONPATH (no editable install)"
elif ! "$VPY" -I -c "$FROM_ROOT" "$ROOT" >/dev/null 2>&1; then
  echo "setup_xla_venv: installing anyaccel (editable) from $ROOT"
  "$VPY" -m pip install --quiet --no-deps -e "$ROOT"
fi

"$VPY" -c "import torch, importlib.metadata as md; print('setup_xla_venv: ready:', 'torch', torch.__version__, '| torch-xla', md.version('torch-xla'))"
