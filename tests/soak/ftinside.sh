#!/usr/bin/env bash
# Soak of the launched fault-tolerance kill tests with a strategy inside each group of 2 processes
# (tests/fault_tolerance/test_fault_tolerance_multiprocess.py): RUNS runs in a row of K (a pytest -k
# expression; default: sequence parallelism, and expert parallelism, inside each group, and DDP inside
# groups told by the environment, one launch each). Per run: pytest's verdict (each test asserts the kill, the restart, the heal
# and bitwise equality), a hang past 900 s (exit 124), and the processes left 5 s after it that carry the
# run's token in their environment (the launchers, agents and workers it started; other jobs may run meanwhile).
#   bash tests/soak/ftinside.sh [RUNS] [K]       (default 20; ~70 s a run on a quiet 2-core machine)
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RUNS="${1:-20}"
K="${2:-(killed and (sp] or ep])) or ddp_inside}"
ok=0; hangs=0; survivors=0
for i in $(seq 1 "$RUNS"); do
  token="ftinside-$$-$i"; log=$(mktemp "${TMPDIR:-/tmp}/ftinside.XXXXXX")
  start=$SECONDS
  (cd "$ROOT" && FTINSIDE_TOKEN=$token PYTHONDONTWRITEBYTECODE=1 timeout 900 "$PY" -m pytest -q -p no:cacheprovider \
    tests/fault_tolerance/test_fault_tolerance_multiprocess.py -k "$K" > "$log" 2>&1)
  code=$?
  sleep 5
  left=$(grep -l "FTINSIDE_TOKEN=$token" /proc/[0-9]*/environ 2>/dev/null | wc -l)
  [ "$code" = 0 ] && ok=$((ok + 1))
  [ "$code" = 124 ] && hangs=$((hangs + 1))
  [ "$left" -gt 0 ] && survivors=$((survivors + 1))
  echo "run $i: exit $code, $((SECONDS - start)) s, processes left $left: $(tail -1 "$log")"
done
echo "ftinside: $ok of $RUNS ok, $hangs hangs, $survivors runs with processes left"
