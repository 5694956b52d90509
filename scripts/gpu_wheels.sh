#!/usr/bin/env bash
# `make gpu-wheels`: downloads (here, where the package index can be reached) the wheels `make gpu-check`
# installs when they are missing, into .gpu-wheels/ (ignored by git, ~9 MB), for a GPU machine that
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
# torchft and what it needs besides torch (GPU_CHECK_STEPS=fault: the extra fault-tolerance step), at the
# versions the CPU tests run with
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$DEST" torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-proto==1.45.2 protobuf==7.36.2 \
    googleapis-common-protos==1.76.0 requests urllib3 idna charset-normalizer certifi typing-extensions
ls -1 "$DEST"
echo "gpu-wheels: $(du -sh "$DEST" | cut -f1) in $DEST for Python $VERSION"
