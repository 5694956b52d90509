#!/usr/bin/env bash
# `make test-wheel`: the test suite against the package as users get it, on the oldest torch we support.
#
#  1. builds a wheel and an sdist of this checkout (python -m build) into build/wheel-test/dist;
#  2. installs the WHEEL (not the checkout, not editable) with its `test` extra and torch==$TORCH_VERSION
#     into a fresh virtual environment, build/wheel-test/venv;
#  3. copies the tests and what they run (tests/, examples/, benchmarks/, scripts/, docs/, README.md,
#     pyproject.toml for pytest's settings; LICENSE, Makefile and .ci/, which tests/project read) into
#     build/wheel-test/tree, a directory with no anyaccel/ in it, checks that `import anyaccel` there
#     resolves into site-packages, and runs pytest from it.
#
# One run covers "the tests against the installed wheel" and "the tests on a second torch" (2.13 is
# `make test`'s): by default every unit test and the multi-process launch tests (PYTEST_ARGS=" " for
# the whole suite, slow tests included). A missing package-data file, or an import that only works from the source tree,
# fails here. First run: a few minutes to install torch (the pip cache makes later runs quicker).
#
#   TORCH_VERSION=2.9.0 PYTHON=python3 PYTEST_ARGS="-m 'not slow'" scripts/test_wheel.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUILD_PYTHON="${BUILD_PYTHON:-$ROOT/.venv/bin/python}"   # has `build` (the test extra)
TORCH_VERSION="${TORCH_VERSION:-2.9.0}"
WORK="$ROOT/build/wheel-test"
DIST="$WORK/dist" VENV="$WORK/venv" TREE="$WORK/tree"

rm -rf "$WORK"
mkdir -p "$DIST" "$TREE"

echo "test-wheel: building the wheel and the sdist"
"$BUILD_PYTHON" -m build --outdir "$DIST" "$ROOT" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
if grep -i "deprecat" "$WORK/build.log"; then
  echo "test-wheel: the build printed a deprecation warning (above); fix pyproject.toml" >&2
  exit 1
fi
WHEEL="$(ls "$DIST"/anyaccel-*.whl)"
SDIST="$(ls "$DIST"/anyaccel-*.tar.gz)"
echo "test-wheel: built $(basename "$WHEEL") and $(basename "$SDIST")"

# What must be inside the wheel (py.typed: PEP 561; LICENSE: the SPDX license-files).
"$BUILD_PYTHON" - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [n for n in ("anyaccel/py.typed", "anyaccel/__init__.py", "anyaccel/cli/__init__.py")
           if n not in names]
if not any(n.endswith("licenses/LICENSE") for n in names):
    missing.append("*.dist-info/licenses/LICENSE")
if missing:
    sys.exit(f"test-wheel: the wheel lacks {missing}")
PY

echo "test-wheel: a fresh environment with torch==$TORCH_VERSION and the wheel (+ its test extra)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "${WHEEL}[test]" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -m pip check >/dev/null || { "$VENV/bin/python" -m pip check; exit 1; }

cp -r "$ROOT/tests" "$ROOT/examples" "$ROOT/benchmarks" "$ROOT/scripts" "$ROOT/docs" "$ROOT/README.md" \
  "$ROOT/pyproject.toml" "$ROOT/LICENSE" "$ROOT/Makefile" "$ROOT/.ci" "$TREE/"  # what tests/project reads
rm -rf "$TREE/docs/_build" "$TREE/docs/reference/generated"
find "$TREE" -name __pycache__ -prune -exec rm -rf {} +

# tests/conftest.py puts its own parent (here: TREE) on PYTHONPATH for the processes it starts, so
# check the same way a worker would import anyaccel.
(cd "$TREE" && PYTHONPATH="$TREE" "$VENV/bin/python" - "$VENV" <<'PY'
import os, sys, anyaccel, torch
where = os.path.realpath(anyaccel.__file__)
print(f"test-wheel: anyaccel from {where}; torch {torch.__version__}")
if "site-packages" not in where or not where.startswith(os.path.realpath(sys.argv[1])):
    sys.exit("test-wheel: anyaccel is not imported from the installed wheel")
PY
)

echo "test-wheel: pytest from $TREE"
cd "$TREE"
if [ -n "${PYTEST_ARGS+set}" ] || [ "$#" -gt 0 ]; then   # PYTEST_ARGS: shell words, e.g. "-m 'not slow' -x"
  eval "set -- ${PYTEST_ARGS:-} \"\$@\""
  exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
fi
# The default (CI): every unit test, then the multi-process tests of the launch paths — the part
# that leans on torch's elastic internals (launch/agent.py), preemption and the notebook launcher.
# The rest of the multi-process suite runs on torch 2.13 in `make test`; PYTEST_ARGS=" " runs all.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m slow tests/multiprocess/test_launch.py \
  tests/process/test_preemption_multiprocess.py tests/multiprocess/test_notebook_launcher.py
