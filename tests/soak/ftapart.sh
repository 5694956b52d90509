#!/usr/bin/env bash
# Soak of the fault-tolerance lineage check (anyaccel/fault_tolerance/lineage.py): RUNS launched runs in a row
# of the 3-group case of tests/fault_tolerance/test_fault_tolerance_multiprocess.py
# (test_groups_that_meet_again_with_different_histories_...): two groups' backward raises in step 6, they take
# the step again without group 0, all three meet at one count with two histories; found, one side stops and is
# started again, heals, all end equal. Per run: the exit status (124: a hang past 240 s), whether the two
# histories were found, whether the three groups end bitwise equal, and the job's processes left 5 s after it
# ended (ft_train.py or the launcher; nothing else of that name may run meanwhile).
# SHAPE raise2x2 instead: the case of test_a_backward_that_raises_in_a_group_of_two_fsdp2_processes_...
# (2 groups of 2 FSDP2 processes, group 1's backward raises in step 8: its processes end, it restarts and
# heals; "found" then counts the runs that said so, and "equal" compares rank 0 of both groups).
#   bash tests/soak/ftapart.sh [RUNS] [SHAPE]        (default 20 apart; ~15-20 s a run on a quiet 2-core machine)
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RUNS="${1:-20}"
SHAPE="${2:-apart}"
if [ "$SHAPE" = raise2x2 ]; then
  ENVS=(FT_EPOCHS=4 FT_RAISE_AT=8 FT_ALONE_SLEEP=0.3)
  FLAGS=(--num_processes 4 --parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 2)
  SAYS="cannot go on after that"; GROUPS_N=2; FILES="rank_0"
else
  ENVS=(FT_EPOCHS=3 FT_RAISE_AT=6 FT_APART_AT=6 FT_RAISE_GROUPS=1,2 FT_ALONE_SLEEP=0.3)
  FLAGS=(--num_processes 3)
  SAYS="hold 2 different histories"; GROUPS_N=3; FILES=""
fi
ok=0; found=0; hangs=0; survivors=0
for i in $(seq 1 "$RUNS"); do
  d=$(mktemp -d "${TMPDIR:-/tmp}/ftapart.XXXXXX"); mkdir -p "$d/out"
  start=$SECONDS
  (cd "$d" && env FT_OUT="$d/out" "${ENVS[@]}" PYTHONPATH="$ROOT" timeout 240 "$PY" -m anyaccel.cli launch --cpu \
    --fault_tolerance on "${FLAGS[@]}" --max_restarts 1 "$ROOT/tests/fault_tolerance/ft_train.py" >"$d/log" 2>&1); rc=$?
  [ "$rc" = 124 ] && hangs=$((hangs + 1))
  seen=$(grep -c "$SAYS" "$d/log")
  [ "$seen" -gt 0 ] && found=$((found + 1))
  equal=$("$PY" -c "
import glob, json
ends = [[json.loads(l) for l in open(f) if '\"end\"' in l][-1] for f in sorted(glob.glob('$d/out/*$FILES.jsonl'))]
print(len(ends) == $GROUPS_N and len({(e['sha'], e['committed']) for e in ends}) == 1)")
  sleep 5
  left=$(pgrep -f "ft_train.py|anyaccel.cli launch" | wc -l); survivors=$((survivors + left))
  [ "$rc" = 0 ] && [ "$equal" = True ] && [ "$seen" -gt 0 ] && ok=$((ok + 1))
  echo "run $i: exit $rc, said in $seen lines, equal at the end: $equal, survivors $left, $((SECONDS - start)) s"
  [ "$rc" = 0 ] && [ "$left" = 0 ] && rm -rf "$d"
done
echo "ftapart soak ($SHAPE): $RUNS runs, $ok ok, $found found, $hangs hangs, $survivors survivors"
[ "$ok" = "$RUNS" ] && [ "$survivors" = 0 ]
