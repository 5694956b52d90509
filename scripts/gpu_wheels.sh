#!/usr/bin/env bash
# `make gpu-wheels`: downloads (here, where the package index can be reached) the wheels `make gpu-check`
# installs when they are missing, into .gpu-wheels/ (ignored by git, ~5 MB), for a GPU machine that
# cannot reach the index: copy or carry the folder there and `make gpu-check` installs from it
# (`pip install --no-index --find-links .gpu-wheels --no-deps`; never torch).
#
#   bash scripts/gpu_wheels.sh                       # for Python 3.12 on x86-64 Linux
#   GPU_PYTHON_VERSION=3.11 bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${GPU_PYTHON_VERSION:-3.12}
DEST=.gpu-wheels
mkdir -p "$DEST"
# torchao: the fp8 step; questionary and its two requirements: anyaccel's CLI imports it for the wizard.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$DEST" torchao==0.18.0 "questionary>=2.0" prompt_toolkit wcwidth
ls -1 "$DEST"
echo "gpu-wheels: $(du -sh "$DEST" | cut -f1) in $DEST for Python $VERSION"
