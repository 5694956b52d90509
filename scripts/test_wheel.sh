#!/usr/bin/env bash
# `make test-wheel`: the package as users get it, on the oldest torch we support.
#
#  1. builds an sdist of this checkout and a wheel from that sdist (python -m build) into
#     build/wheel-test/dist, and checks what they hold (scripts/check_dist.py contents): every
#     module, py.typed, the license and the console script in the wheel; every tracked file of
#     anyaccel/, tests/, examples/ and docs/ in the sdist;
#  2. installs the WHEEL (not the checkout, not editable) with torch==$TORCH_VERSION and the test
#     runner into a fresh virtual environment, build/wheel-test/venv (`pip check`), and asks pip
#     whether the wheel's `test` extra resolves with that torch (a dry run, beside step 4). torch and what it
#     requires are hard-linked from the XLA environment ($XLA_VENV, made by `make test-xla`) when
#     it has that torch (scripts/link_installed.py: seconds instead of minutes of download and
#     unpacking 3 GB of CUDA wheels); else pip installs them;
#  3. copies the tests and what they run into build/wheel-test/tree, a directory with no anyaccel/
#     in it, and checks there that `import anyaccel` resolves into site-packages, that every
#     module of the installed package imports on this torch and that the console script answers
#     (scripts/check_dist.py installed);
#  4. runs the tests marked `torch_versions` (tests/project/test_torch_versions.py lists the code
#     that depends on torch's version or internals, and the tests that run it): the unit tests of
#     that code, and the multi-process tests of the launch paths (torch's elastic agent,
#     preemption, the notebook launcher); WHEEL_PYTEST_WORKERS=2 on two pytest-xdist workers.
#     The rest of the suite runs on torch 2.13 in `make test`:
#     running it a second time here would test the same code again.
#
# PYTEST_ARGS=" " installs the test extra and runs the whole suite here instead (about as long as
# `make test`'s pytest); PYTEST_ARGS="-m 'not slow'" the unit tests; TORCH_VERSION=... another torch.
# First run: a few minutes to download torch (the pip cache makes later runs quicker).
#
#   TORCH_VERSION=2.9.0 PYTHON=python3 PYTEST_ARGS="-m 'not slow'" scripts/test_wheel.sh
set -euo pipefail
# A PYTHONPATH from the caller (a checkout's, as the contributing guide suggests) would make pip see
# anyaccel as installed (it skipped the wheel: "No module named 'anyaccel'" in the check below) and
# pytest import the checkout instead of the wheel: the wheel is tested alone.
unset PYTHONPATH

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUILD_PYTHON="${BUILD_PYTHON:-$ROOT/.venv/bin/python}"   # has `build` (the test extra)
TORCH_VERSION="${TORCH_VERSION:-2.9.0}"
WORK="$ROOT/build/wheel-test"
XLA_VENV="${XLA_VENV:-$HOME/.cache/anyaccel/venv-xla}"  # `make test-xla`'s (torch 2.9 is linked from it)
took() { echo "$SECONDS s"; }  # seconds since the start, printed after each phase
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
echo "test-wheel: built $(basename "$WHEEL") and $(basename "$SDIST") ($(took))"

"$BUILD_PYTHON" "$ROOT/scripts/check_dist.py" contents "$WHEEL" "$SDIST"

# Beyond the wheel and torch, what the torch_versions tests import and what runs them on several
# processes (WHEEL_PYTEST_WORKERS; the full test extra: PYTEST_ARGS)
RUNNER=(pytest pytest-timeout pytest-xdist psutil numpy)
FULL=""
if [ -n "${PYTEST_ARGS+set}" ] || [ "$#" -gt 0 ]; then FULL="[test]"; fi
echo "test-wheel: a fresh environment with torch==$TORCH_VERSION and the wheel${FULL:+ (+ its test extra)} ($(took))"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch and what it requires: hard-linked from the XLA environment when that has this torch
# (`make test-xla` made it just before, in CI; scripts/link_installed.py), else pip downloads it.
# Either way pip then installs the wheel and the runner into this environment, and `pip check` runs.
if [ -x "$XLA_VENV/bin/python" ]; then
  status=0
  "$XLA_VENV/bin/python" "$ROOT/scripts/link_installed.py" "$VENV" "torch==$TORCH_VERSION" || status=$?
  case "$status" in
    0) echo "test-wheel: torch==$TORCH_VERSION linked from $XLA_VENV ($(took))" ;;
    3) echo "test-wheel: pip downloads torch==$TORCH_VERSION (several minutes)" ;;  # why: the line above
    *) echo "test-wheel: linking torch from $XLA_VENV failed ($status, above)" >&2; exit 1 ;;
  esac
fi
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "${WHEEL}${FULL}" "${RUNNER[@]}" 2>&1 \
  | grep -v "^WARNING: Location" || true
echo "test-wheel: installed ($(took))"
"$VENV/bin/python" -m pip check >/dev/null || { "$VENV/bin/python" -m pip check; exit 1; }
DRY_RUN=""  # the test extra resolves with this torch (a dry run: nothing is installed), beside the tests
if [ -z "$FULL" ]; then
  "$VENV/bin/python" -m pip install -q --dry-run "torch==$TORCH_VERSION" "${WHEEL}[test]" > "$WORK/test-extra.log" 2>&1 &
  DRY_RUN=$!
fi
test_extra_resolves() {
  [ -z "$DRY_RUN" ] && return 0
  if ! wait "$DRY_RUN"; then
    grep -v "^WARNING: Location" "$WORK/test-extra.log" | tail -20
    echo "test-wheel: the wheel's test extra does not install with torch==$TORCH_VERSION (above)" >&2
    return 1
  fi
  echo "test-wheel: the wheel's test extra resolves with torch==$TORCH_VERSION ($(took))"
}

# What tests/project reads, without the docs' build output and bytecode: left out while copying, not
# removed after, because .ci/run runs `make docs` in another lane, which may be rewriting docs/_build
# at this moment (a file that vanishes under `cp -r` fails the copy).
(cd "$ROOT" && tar -cf - --exclude=./docs/_build --exclude=./docs/reference/generated --exclude=__pycache__ \
  ./tests ./examples ./benchmarks ./scripts ./docs ./README.md ./pyproject.toml ./LICENSE ./Makefile ./.ci) \
  | tar -C "$TREE" -xf -

# tests/conftest.py puts its own parent (here: TREE) on PYTHONPATH for the processes it starts, so
# check the same way a worker would import anyaccel.
(cd "$TREE" && PYTHONPATH="$TREE" "$VENV/bin/python" "$TREE/scripts/check_dist.py" installed "$VENV")

echo "test-wheel: pytest from $TREE ($(took))"
cd "$TREE"
if [ -n "$FULL" ]; then   # PYTEST_ARGS: shell words, e.g. "-m 'not slow' -x"
  eval "set -- ${PYTEST_ARGS:-} \"\$@\""
  exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
fi
# The default (CI): the tests marked torch_versions, from the files that hold them (the others are
# not even collected: they may import what this environment lacks). WHEEL_PYTEST_WORKERS=2: on two
# xdist workers, as `make test` runs them; the default is one process (on the shared 2-core machine
# at load ~10, two workers took 350 s against 236 s in one: these tests are mostly launches whose
# interpreters all import torch at once; to be measured on a quiet machine).
mapfile -t FILES < <(grep -rl --include="test_*.py" "torch_versions" tests | sort)
XDIST=()
if [ "${WHEEL_PYTEST_WORKERS:-0}" -gt 0 ]; then XDIST=(-n "$WHEEL_PYTEST_WORKERS" --dist loadfile --no-loadscope-reorder); fi
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m torch_versions "${FILES[@]}" || status=$?
test_extra_resolves || status=1
echo "test-wheel: done ($(took))"
exit "$status"
