#!/usr/bin/env bash
# `make gpu-check`: everything anyaccel checks on a CUDA machine, in one command (~10 minutes on
# one H100), with one markdown results file at the end (its path is printed).
#
#   bash scripts/gpu_check.sh                 # or: make gpu-check
#   PYTHON=/opt/venv/bin/python GPU_CHECK_RESULTS=/tmp/r.md bash scripts/gpu_check.sh
#   OUT=/collected bash scripts/gpu_check.sh  # results file and every log under $OUT
#   GPU_CHECK_STEPS="fsdp,bench" make gpu-check  # only the steps whose names contain an entry (rerun what failed)
#   GPU_CHECK_ON_CPU=1 GPU_CHECK_STEPS="2 processes" bash scripts/gpu_check.sh   # check this script on a CPU box
#
# Uses the machine's own Python and torch: torch is never replaced (the default steps install only
# missing pure-Python dependencies, `pip install --no-deps`; the extra fault-tolerance step installs
# torchft 0.2.0 with its dependencies where they are missing and torch is 2.7 or later; offline, all
# from .gpu-wheels; the torch version is compared before and after). Python: $PYTHON, else the
# first of python3 / python that imports torch.
# anyaccel is taken from this repository (PYTHONPATH), not installed, and run as
# `python -m anyaccel.cli`. Steps, each with a time limit:
#   1. tests/gpu/check_cuda.py     placement, fp16/bf16, notebook_launcher, CUDA RNG in checkpoints
#   2. anyaccel test               the self-test on the GPU (bf16; 2 processes; through torch.compile)
#   3. examples on synthetic data  the torchvision examples, --synthetic CIFAR-shaped data, 1 GPU
#   4. tests/gpu/check_fsdp.py     FSDP2 on CUDA (bf16, offload, checkpoints) and torch.compile
#   5. tests/gpu/check_fp8.py      fp8 (torchao): a Llama-style block stack compiled in bf16, fp8 tensorwise and
#                                  rowwise: step time, peak memory, loss after N steps; FSDP2's fp8 all-gather
#   6. benchmarks/gpu_bench.py     ResNet-50 and a transformer, bf16: raw vs anyaccel vs Accelerate
# Extra steps, run only when GPU_CHECK_STEPS names them (the default run already fills a lent machine's time):
#   extra: fault tolerance         tests/gpu/check_fault_tolerance.py: torchft on the GPU (2 groups, one
#                                  killed and healed) and the fault-tolerance step-time benchmark on the
#                                  machine's CPUs (~6 min): GPU_CHECK_STEPS=fault make gpu-check (an extra
#                                  step is picked only by "extra" or its own words: fault, torchft)
# Without a GPU (no nvidia-smi listing one, and torch sees none) it says so and exits 0, running
# nothing. A GPU that nvidia-smi lists but torch cannot use is a failure (exit 1), not "no GPU".
# Exit status: 0 when every step that ran passed; 1 when one failed; 2 for a GPU_CHECK_STEPS entry
# that names no step.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else                                               # the first Python on PATH that has torch
    PY=""
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
            PY=$candidate; break
        fi
    done
    [ -n "$PY" ] || PY=python3
fi

# ---- is there a GPU, and can torch use it ------------------------------------------------------
SMI_NOTE="no GPU listed by nvidia-smi"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    GPUS_LISTED=0; SMI_NOTE="no nvidia-smi"
elif smi_out=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1); then
    GPUS_LISTED=$(printf '%s\n' "$smi_out" | grep -c .)
else                                               # installed, but no driver / no device: say what it said
    GPUS_LISTED=0; SMI_NOTE="nvidia-smi failed: $(printf '%s\n' "$smi_out" | head -n 1 | cut -c1-120)"
fi
TORCH_STATE=$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu-only', torch.__version__)" 2>/dev/null)
TORCH_STATE=${TORCH_STATE:-missing}
PY_PATH=$(command -v "$PY" 2>/dev/null || echo "$PY (not found)")
ON_CPU=${GPU_CHECK_ON_CPU:-0}
case "$TORCH_STATE" in
    cuda*) ON_CPU=0 ;;
    *)
        if [ "$ON_CPU" = 1 ] && [ "$TORCH_STATE" != missing ]; then
            :                                      # said once the steps are chosen
        elif [ "${GPUS_LISTED:-0}" -gt 0 ]; then
            if [ "$TORCH_STATE" = missing ]; then what="cannot import torch"; else what="has torch ${TORCH_STATE#cpu-only } without CUDA (torch.cuda.is_available() is False)"; fi
            echo "gpu-check: nvidia-smi lists $GPUS_LISTED GPU(s), but $PY_PATH $what." >&2
            echo "gpu-check: run it with the Python whose torch has CUDA: PYTHON=/path/to/python make gpu-check (or GPU_PYTHON=...)." >&2
            exit 1
        else
            if [ "$TORCH_STATE" = missing ]; then why="no torch in $PY_PATH"; else why="$PY_PATH: torch.cuda.is_available() is False"; fi
            echo "gpu-check: no CUDA GPU here ($SMI_NOTE; $why); nothing was run."
            exit 0
        fi ;;
esac

# ---- the steps ---------------------------------------------------------------------------------
# all_steps calls `step` once per step; with MODE=list it only collects the names (before anything runs).
all_steps() {
    local ex=(--synthetic --epochs 1 --max_steps 30 --output_dir "${LOGS:-}/examples")
    step "check_cuda.py"                           240 "$PY" tests/gpu/check_cuda.py
    step "anyaccel test (bf16)"                    120 "${ANYACCEL[@]}" test --mixed_precision bf16
    step "anyaccel test (2 processes, 1 GPU each or shared)" 120 "${ANYACCEL[@]}" test --num_processes 2
    step "anyaccel test (bf16, torch.compile)"     240 "${ANYACCEL[@]}" test --mixed_precision bf16 \
                                                       --dynamo_backend inductor --timeout 200
    step "example resnet_cifar_engine (synthetic)" 180 "${ANYACCEL[@]}" launch examples/resnet_cifar_engine.py \
                                                       --synthetic --epochs 1 --max_steps 30 --fp16 torch
    step "example ddp_slurm_resnet (synthetic)"    180 "${ANYACCEL[@]}" launch --mixed_precision bf16 \
                                                       examples/ddp_slurm_resnet.py "${ex[@]}"
    step "example lightning_style_imagenet (synthetic)" 180 "${ANYACCEL[@]}" launch --mixed_precision bf16 \
                                                       examples/lightning_style_imagenet.py "${ex[@]}" --log_with csv
    step "check_fsdp.py (FSDP2 + compile)"         240 "$PY" tests/gpu/check_fsdp.py
    step "check_fp8.py (fp8: bf16 vs tensorwise vs rowwise, compiled)" 600 "$PY" tests/gpu/check_fp8.py
    step "gpu_bench.py"                            300 "$PY" benchmarks/gpu_bench.py
    step "$FT_STEP"                                540 "$PY" tests/gpu/check_fault_tolerance.py
}
FT_STEP="extra: fault tolerance (tests/gpu/check_fault_tolerance.py: torchft on the GPU, CPU step time)"
ANYACCEL=("$PY" -m anyaccel.cli)
NAMES=(); STATUS=(); SECS=(); LOGFILES=(); ALL_NAMES=()
step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    if [ "$MODE" = list ]; then ALL_NAMES+=("$name"); return; fi
    wanted "$name" || return 0
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
MODE=list all_steps

# ---- which steps: all, or those whose names contain an entry of GPU_CHECK_STEPS (comma-separated) ----
WANTED=()
IFS=',' read -r -a entries <<<"${GPU_CHECK_STEPS:-}"
for entry in ${entries[@]+"${entries[@]}"}; do  # (bash < 4.4 calls an empty "${a[@]}" unbound under set -u)
    entry=$(echo "$entry" | tr 'A-Z' 'a-z' | sed 's/^ *//; s/ *$//')
    [ -n "$entry" ] && WANTED+=("$entry")
done
contains() { case "$(echo "$1" | tr 'A-Z' 'a-z')" in *"$2"*) return 0 ;; esac; return 1; }
matches() {  # matches NAME ENTRY: a part of the name picks a default step; an extra step only its own words
    case "$1" in
        "extra: "*) case "$2" in extra|fault|tolerance|"fault tolerance"|fault-tolerance|torchft|check_fault_tolerance*) return 0 ;;
                    esac; return 1 ;;
    esac
    contains "$1" "$2"
}
wanted() {  # wanted NAME: 0 when the step runs (every default step when GPU_CHECK_STEPS is empty)
    if [ ${#WANTED[@]} -eq 0 ]; then case "$1" in "extra: "*) return 1 ;; esac; return 0; fi
    local entry
    for entry in ${WANTED[@]+"${WANTED[@]}"}; do matches "$1" "$entry" && return 0; done
    return 1
}
for entry in ${WANTED[@]+"${WANTED[@]}"}; do
    hit=0
    for name in "${ALL_NAMES[@]}"; do matches "$name" "$entry" && hit=1; done
    if [ $hit = 0 ]; then
        echo "gpu-check: GPU_CHECK_STEPS entry '$entry' names no step (entries are comma-separated parts of these names;" \
             "an extra step is named only by extra, fault, tolerance, torchft or check_fault_tolerance):" >&2
        printf '  %s\n' "${ALL_NAMES[@]}" >&2
        exit 2
    fi
done

if [ "$ON_CPU" = 1 ]; then
    echo "gpu-check: GPU_CHECK_ON_CPU=1: running the chosen steps on the CPU to check this script; CUDA checks fail or skip there."
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
        "tqdm": "tqdm", "torchao": "torchao==0.18.0"}  # torchao: the fp8 step (offline: make gpu-wheels)
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
install_note="nothing missing"
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.gpu-wheels}     # made by `make gpu-wheels` for a machine without internet
pip_from=()
[ -d "$WHEELS" ] && pip_from=(--no-index --find-links "$WHEELS")
if [ -n "$missing" ]; then
    if "$PY" -m pip install -q --no-deps ${pip_from[@]+"${pip_from[@]}"} $missing >"$LOGS/install.log" 2>&1; then
        install_note="installed (no deps): $missing"
    else
        install_note="could not install $missing (offline? make gpu-wheels here, carry .gpu-wheels); steps that need them may fail"
    fi
fi
# torchft (the extra fault-tolerance step), with its dependencies but never torch: only where torch
# already satisfies its torch>=2.7, so that pip has nothing of torch to fetch
if wanted "$FT_STEP" && ! "$PY" -c "import torchft" >/dev/null 2>&1; then
    if "$PY" -c "import sys, torch; sys.exit(0 if tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 7) else 1)"; then
        if "$PY" -m pip install -q ${pip_from[@]+"${pip_from[@]}"} torchft==0.2.0 >>"$LOGS/install.log" 2>&1; then
            install_note="$install_note; torchft==0.2.0 installed (with its dependencies)"
        else
            install_note="$install_note; could not install torchft==0.2.0 (offline? make gpu-wheels here, carry .gpu-wheels)"
        fi
    else
        install_note="$install_note; torchft not installed: it needs torch >= 2.7"
    fi
fi
install_note="$install_note; anyaccel from this repository (PYTHONPATH, not installed)"
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "gpu-check: torch changed from $torch_before to $torch_after during the install; stopping." >&2
    exit 1
fi
MODE=run all_steps

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
    case "$(basename "$1")" in example_*)              # which model, and the last accuracy line
        local model="torchvision model"
        grep -q 'torchvision cannot be imported' "$1" && model="SmallCNN (torchvision missing)"
        echo "$model; $(tr '\r' '\n' <"$1" | grep -i 'acc' | grep -v 'it/s' | tail -n 1 \
                        | sed 's/^[0-9:]* \[rank [0-9]*\] //' | tr '|' '/' | cut -c1-140)"
        return ;;
    esac
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
    if [ "$ON_CPU" = 1 ]; then
        echo "* GPU: **none: GPU_CHECK_ON_CPU=1**, the steps ran on the CPU (a check of this script, not of a GPU)"
    else
        echo "* GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 4 | tr '\n' ';' || echo unknown)"
    fi
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
    if [ ${#WANTED[@]} -gt 0 ]; then
        echo "* steps: ${#NAMES[@]} of ${#ALL_NAMES[@]}, chosen by GPU_CHECK_STEPS=\"${GPU_CHECK_STEPS}\""
    fi
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
