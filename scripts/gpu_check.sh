#!/usr/bin/env bash
# `make gpu-check`: everything anyaccel checks on a CUDA machine, in one command (~10 minutes on
# one H100), with one markdown results file at the end (its path is printed).
#
#   bash scripts/gpu_check.sh                 # or: make gpu-check
#   PYTHON=/opt/venv/bin/python GPU_CHECK_RESULTS=/tmp/r.md bash scripts/gpu_check.sh
#   OUT=/collected bash scripts/gpu_check.sh  # results file and every log under $OUT
#
# Uses the machine's own Python and torch: nothing is downloaded and torch is never replaced
# (only missing pure-Python dependencies, `pip install --no-deps`; the torch version is compared
# before and after). anyaccel is taken from this repository (PYTHONPATH), not installed, and run as
# `python -m anyaccel.cli`. Steps, each with a time limit:
#   1. tests/gpu/check_cuda.py     placement, fp16/bf16, notebook_launcher, CUDA RNG in checkpoints
#   2. anyaccel test               the self-test on the GPU (bf16; 2 processes; through torch.compile)
#   3. examples on synthetic data  the torchvision examples, --synthetic CIFAR-shaped data, 1 GPU
#   4. tests/gpu/check_fsdp.py     FSDP2 on CUDA (bf16, offload, checkpoints) and torch.compile
#   5. benchmarks/gpu_bench.py     ResNet-50 and a transformer, bf16: raw vs anyaccel vs Accelerate
# Without a CUDA GPU it says so and exits 0, running nothing. Exit status: 0 when every step passed.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then PY=python; fi

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu-check: no CUDA GPU here ($PY: torch.cuda.is_available() is False, or torch is missing); nothing was run."
    exit 0
fi

if [ -n "${OUT:-}" ]; then                         # a folder that is collected afterwards (CI, a lent machine)
    mkdir -p "$OUT/gpu-check-logs"
    LOGS=$OUT/gpu-check-logs
    RESULTS=${GPU_CHECK_RESULTS:-$OUT/gpu-check-results.md}
else
    LOGS=$(mktemp -d "${TMPDIR:-/tmp}/anyaccel-gpu-check.XXXXXX")
    RESULTS=${GPU_CHECK_RESULTS:-$ROOT/gpu-check-results.md}
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OUT=$LOGS                                   # check_cuda / check_fsdp / gpu_bench write JSON here
export PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
export ANYACCEL_HOME=$LOGS/home                    # no config file of this machine's user changes the checks
START=$(date +%s)

# ---- install: only what is missing, never torch ----------------------------------------------
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"psutil": "psutil", "yaml": "pyyaml", "safetensors": "safetensors", "questionary": "questionary",
        "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
install_note="nothing missing"
if [ -n "$missing" ]; then
    if "$PY" -m pip install -q --no-deps $missing >"$LOGS/install.log" 2>&1; then
        install_note="installed (no deps): $missing"
    else
        install_note="could not install $missing (offline?); steps that need them may fail"
    fi
fi
install_note="$install_note; anyaccel from this repository (PYTHONPATH, not installed)"
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "gpu-check: torch changed from $torch_before to $torch_after during the install; stopping." >&2
    exit 1
fi
ANYACCEL=("$PY" -m anyaccel.cli)

# ---- the steps ---------------------------------------------------------------------------------
NAMES=(); STATUS=(); SECS=(); LOGFILES=()
step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local log="$LOGS/$(echo "$name" | tr -c 'a-zA-Z0-9_\n' '_').log" t0=$(date +%s) rc
    echo "== gpu-check: $name (limit ${limit}s)"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n 25 "$log"
    local verdict="PASS"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="FAIL (timed out after ${limit}s)";
    elif [ $rc -ne 0 ]; then verdict="FAIL (exit $rc)"; fi
    echo "-- $verdict: $name ($(( $(date +%s) - t0 )) s)"
    NAMES+=("$name"); STATUS+=("$verdict"); SECS+=("$(( $(date +%s) - t0 ))"); LOGFILES+=("$log")
}

step "check_cuda.py"                           240 "$PY" tests/gpu/check_cuda.py
step "anyaccel test (bf16)"                    120 "${ANYACCEL[@]}" test --mixed_precision bf16
step "anyaccel test (2 processes, 1 GPU each or shared)" 120 "${ANYACCEL[@]}" test --num_processes 2
step "anyaccel test (bf16, torch.compile)"     240 "${ANYACCEL[@]}" test --mixed_precision bf16 \
                                                   --dynamo_backend inductor --timeout 200
EX=(--synthetic --epochs 1 --max_steps 30 --output_dir "$LOGS/examples")
step "example resnet_cifar_engine (synthetic)" 180 "${ANYACCEL[@]}" launch examples/resnet_cifar_engine.py \
                                                   --synthetic --epochs 1 --max_steps 30 --fp16 torch
step "example ddp_slurm_resnet (synthetic)"    180 "${ANYACCEL[@]}" launch --mixed_precision bf16 \
                                                   examples/ddp_slurm_resnet.py "${EX[@]}"
step "example lightning_style_imagenet (synthetic)" 180 "${ANYACCEL[@]}" launch --mixed_precision bf16 \
                                                   examples/lightning_style_imagenet.py "${EX[@]}" --log_with csv
step "check_fsdp.py (FSDP2 + compile)"         240 "$PY" tests/gpu/check_fsdp.py
step "gpu_bench.py"                            300 "$PY" benchmarks/gpu_bench.py

charts_note="no chart (matplotlib missing or no gpu_bench.json)"
if [ -f "$LOGS/gpu_bench.json" ] && "$PY" -c "import matplotlib" >/dev/null 2>&1 \
        && "$PY" -m benchmarks --plot "$LOGS/charts" --results "$LOGS/gpu_bench.json" >/dev/null 2>&1; then
    charts_note="chart: $LOGS/charts/gpu.png"
fi

# ---- the results file ---------------------------------------------------------------------------
summary() {  # one cell: the PASS/FAIL/SKIP counts of a check script, or the verdict line of anyaccel test
    local p f k
    p=$(grep -c '^PASS ' "$1"); f=$(grep -c '^FAIL ' "$1"); k=$(grep -c '^SKIP ' "$1")
    if [ $((p + f + k)) -gt 0 ]; then echo "$p passed, $f failed, $k skipped"; return; fi
    if [ "$(basename "$1")" = gpu_bench_py.log ] && [ -f "$LOGS/gpu_bench.json" ]; then  # anyaccel / raw per workload
        "$PY" -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(d.get('skipped') or '; '.join(f\"{r['name']}: {r['contender']} {r['ratio']:.3f}x raw\" for r in d['rows']
                                   if r.get('ratio') is not None and r['contender'] in ('anyaccel', 'accelerate')))
" "$LOGS/gpu_bench.json" 2>/dev/null | tr '|' '/' | cut -c1-300
        return
    fi
    grep -E '^(PASS|FAIL): ' "$1" | tail -n 1 | tr '|' '/' | cut -c1-160
}
failed=0
for s in "${STATUS[@]}"; do [ "$s" = "PASS" ] || failed=$((failed + 1)); done
{
    echo "# make gpu-check — $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "* GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 4 | tr '\n' ';' || echo unknown)"
    echo "* $("$PY" -c "import sys, torch; print(f'Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} visible GPU(s)')")"
    echo "* $("$PY" -c "
import importlib
out = []
for m in ('anyaccel', 'torchvision', 'accelerate', 'lightning'):
    try:
        out.append(f'{m} {importlib.import_module(m).__version__}')
    except Exception as e:
        out.append(f'{m} missing')
print(', '.join(out))" 2>/dev/null)"
    echo "* commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' + local changes')"
    echo "* install: $install_note; torch unchanged ($torch_after)"
    echo "* total: $(( $(date +%s) - START )) s; **$(( ${#NAMES[@]} - failed )) of ${#NAMES[@]} steps passed**; $charts_note"
    echo
    echo "| step | result | seconds | what it reported |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${SECS[$i]} | $(summary "${LOGFILES[$i]}") |"; done
    for i in "${!NAMES[@]}"; do
        echo
        echo "## ${NAMES[$i]}: ${STATUS[$i]}"
        echo
        echo '```'
        tr '\r' '\n' <"${LOGFILES[$i]}" | grep -v 'it/s' | tail -n 60
        echo '```'
    done
    for j in "$LOGS"/*.json; do
        [ -e "$j" ] || continue
        echo
        echo "## $(basename "$j")"
        echo
        echo '```json'
        head -c 20000 "$j"
        echo
        echo '```'
    done
} >"$RESULTS"
echo
echo "gpu-check: $(( ${#NAMES[@]} - failed )) of ${#NAMES[@]} steps passed in $(( $(date +%s) - START )) s; results in $RESULTS (logs in $LOGS)"
[ $failed -eq 0 ]
