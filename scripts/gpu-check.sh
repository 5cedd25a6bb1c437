#!/usr/bin/env bash
# The checks CI cannot run: the executor's CUDA and NCCL paths, on a machine with GPUs.
# At most 8 minutes (every check runs under `timeout`, inside one overall budget).
#
#   scripts/gpu-check.sh                          # on a machine with >= 1 GPU
#   GPU_CHECK_DRY_RUN=1 scripts/gpu-check.sh      # the same flow on CPU/gloo, tiny sizes
#   GPU_CHECK_ONLY="pairs memory" scripts/gpu-check.sh   # only these checks (names as in the table)
#
# One GPU (one rank: NCCL refuses two ranks on one GPU): float64 on CUDA against the CPU
#            one-process reference for a gpt, every architecture preset shrunk, recompute
#            full, selective and per-op, ZeRO-1/2/3 on a one-rank NCCL group, tp/cp/ep applied over
#            one-rank NCCL groups, DualPipeV's pairs on two CUDA streams (and how many
#            overlapped); measured peak memory beside the prediction; profile -> simulate
#            -> run (step-time error); bf16 against fp32 loss curves; the allocator's peak of
#            single-rank jobs against run's prediction (benchmarks/gpu_memory.py), BF16/FP8
#            GEMMs against the compute model (benchmarks/gpu_gemms.py) and the built-in GEMM
#            table timed again in nn.Linear's layouts (benchmarks/gemm_table.py).
# >= 2 GPUs: also expert parallelism (dp 2 ep 2, float64, all-to-all), context parallelism
#            (cp 2, K/V all-gather and ring attention), ZeRO-3 with ep 2, tensor parallelism (tp 2, sequence
#            parallel) and parallel folding (tp 2, etp 1, ep 2, clipped) against
#            the CPU reference; every generated schedule on NCCL with transfers >= 64 MiB
#            (and pp=4 with >= 4 GPUs); pipesim profile, bench-comm and compare at pp=2.
# Ends with a table of every check; exits non-zero if any check failed, timed out or was
# cut by the budget, and at once if no GPU is visible (it never passes by skipping).
#
# Needs torch with CUDA, networkx, pyyaml and simpy. simpy (and plotly, which no check
# needs) is installed from a wheel in scripts/wheels/ when it is missing (no network
# needed): `pip download --no-deps simpy plotly -d scripts/wheels` on a machine with
# network adds them. The timing engine's C walk is built in place when a compiler is
# there (else the SimPy model of the same rules runs). Logs of every check:
# $GPU_CHECK_OUT (gpu-check-out/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET:-480}
DRY=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$OUT"
STARTED=$(date +%s)
ROWS=()
FAILED=0

die() { echo "gpu-check: FAILED: $*" >&2; exit 1; }

# --- what this machine has ---------------------------------------------------------------
for package in simpy plotly; do
    if ! $PYTHON -c "import $package" 2>/dev/null && ls scripts/wheels/"$package"-*.whl >/dev/null 2>&1; then
        echo "$package is missing: installing it from scripts/wheels/"
        $PYTHON -m pip install -q --no-index --no-deps --find-links scripts/wheels "$package" \
            || echo "gpu-check: could not install $package from scripts/wheels/" >&2
    fi
done
$PYTHON -c "import torch, networkx, yaml, simpy" \
    || die "torch, networkx, pyyaml or simpy does not import (simpy: put its wheel in scripts/wheels/)"
if ! ls schedules/_engine*.so >/dev/null 2>&1; then
    $PYTHON setup.py -q build_ext --inplace >"$OUT/engine-build.log" 2>&1 \
        && echo "built the timing engine's C walk" \
        || echo "no C build of the timing engine (see $OUT/engine-build.log): the SimPy model runs instead"
fi
if [ "$DRY" = 1 ]; then
    GPUS=2; BACKEND=gloo; PYFLAGS=(--dry-run)
    echo "DRY RUN: CPU and gloo, tiny sizes; checks the script's flow, its numbers mean nothing"
else
    GPUS=$($PYTHON -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)") \
        || die "torch does not import"
    [ "$GPUS" -ge 1 ] || die "no CUDA device is visible (torch.cuda.is_available() is False); this script checks the GPU paths"
    BACKEND=nccl; PYFLAGS=()
    $PYTHON -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
fi
echo "$GPUS GPU(s); budget ${BUDGET}s; logs in $OUT/"

# check NAME SECONDS COMMAND...: run under `timeout`, within what is left of the budget.
# selected NAME: whether GPU_CHECK_ONLY (names, spaces or commas between) is unset or names it.
selected() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " ${GPU_CHECK_ONLY//,/ } " == *" $1 "* ]]; }

check() {
    local name=$1 limit=$2; shift 2
    selected "$name" || return
    local left=$((BUDGET - ($(date +%s) - STARTED)))
    if [ "$left" -le 5 ]; then
        ROWS+=("$(printf '%-26s %-8s %6s  %s' "$name" CUT - "no time left in the ${BUDGET}s budget")"); FAILED=1; return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (timeout ${limit}s)"
    local begin=$(date +%s) rc status
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=PASS ;;
        124|137) status=TIMEOUT; FAILED=1 ;;
        *) status="FAIL($rc)"; FAILED=1 ;;
    esac
    tail -n 6 "$OUT/$name.log" | sed 's/^/   /'
    local detail
    detail=$(grep -E "error|spread|gap|difference|within|overlapped|MiB|fit sendrecv|both lower|overheads" "$OUT/$name.log" \
        | tail -n 1 | sed 's/^ *//' | cut -c1-100)
    ROWS+=("$(printf '%-26s %-8s %6s  %s' "$name" "$status" "$(( $(date +%s) - begin ))" "$detail")")
}

# --- one GPU ------------------------------------------------------------------------------
check numerics-cuda-vs-cpu 60 $PYTHON scripts/gpu_check.py numerics "${PYFLAGS[@]}"
check architectures 90 $PYTHON scripts/gpu_check.py architectures "${PYFLAGS[@]}"
check recompute 60 $PYTHON scripts/gpu_check.py recompute "${PYFLAGS[@]}"
check zero-one-rank 60 $PYTHON scripts/gpu_check.py zero "${PYFLAGS[@]}"
check tp-cp-ep-degree-one 60 $PYTHON scripts/gpu_check.py degree-one "${PYFLAGS[@]}"
check dualpipev-stream-pairs 90 $PYTHON scripts/gpu_check.py pairs "${PYFLAGS[@]}"
check memory-vs-predicted 60 $PYTHON scripts/gpu_check.py memory "${PYFLAGS[@]}"
check profile-simulate-run 120 $PYTHON scripts/gpu_check.py predict "${PYFLAGS[@]}"
check bf16-vs-fp32 60 $PYTHON scripts/gpu_check.py precision "${PYFLAGS[@]}"
# measurements beside the model, each job in its own process: the allocator's peak memory
# against run's prediction (the held-out jobs), and BF16/FP8 GEMMs against the compute model
check memory-held-out 200 $PYTHON benchmarks/gpu_memory.py --set held-out --json "$OUT/gpu-memory.json" "${PYFLAGS[@]}"
if [ "$DRY" != 1 ]; then
    check gemms-bf16-fp8 90 $PYTHON benchmarks/gpu_gemms.py --json "$OUT/gpu-gemms.json"
    # the built-in GEMM table again in nn.Linear's layouts, and the model fitted to it
    check gemm-table-linear 120 $PYTHON benchmarks/gemm_table.py --out "$OUT/h200-gemm-linear.csv"
fi

# --- two GPUs and more --------------------------------------------------------------------
if [ "$GPUS" -ge 2 ]; then
    check nccl-schedules-pp2 120 $PYTHON scripts/gpu_check.py nccl-schedules --pp 2 "${PYFLAGS[@]}"
    check expert-parallel-ep2 90 $PYTHON scripts/gpu_check.py expert-parallel "${PYFLAGS[@]}"
    check context-parallel-cp2 90 $PYTHON scripts/gpu_check.py context-parallel "${PYFLAGS[@]}"
    check tensor-parallel-tp2 90 $PYTHON scripts/gpu_check.py tensor-parallel "${PYFLAGS[@]}"
    check ring-attention-cp2 90 $PYTHON scripts/gpu_check.py ring-attention "${PYFLAGS[@]}"
    check zero3-ep2 90 $PYTHON scripts/gpu_check.py zero-ep "${PYFLAGS[@]}"
    check folding-tp2-etp1 90 $PYTHON scripts/gpu_check.py folding "${PYFLAGS[@]}"
    if [ "$GPUS" -ge 4 ]; then
        check nccl-schedules-pp4 120 $PYTHON scripts/gpu_check.py nccl-schedules --pp 4 "${PYFLAGS[@]}"
    fi
    MODEL=(--model gpt --layers 8 --hidden 1024 --heads 16 --seq-len 256 --batch-size 32 --microbatches 8)
    [ "$DRY" = 1 ] && MODEL=(--model gpt --layers 4 --hidden 32 --heads 4 --seq-len 16 --batch-size 8 --microbatches 4)
    SCHEDULE=(--schedule interleaved-1f1b --pp 2 --virtual-stages 2)
    check profile-pp2 120 $PYTHON -m pipesim profile "${SCHEDULE[@]}" "${MODEL[@]}" --backend "$BACKEND" \
        --min-time 1 --out "$OUT/costs.json"
    SIZES=1MB..256MB; [ "$DRY" = 1 ] && SIZES=1KB..4MB
    check bench-comm-2 90 $PYTHON -m pipesim bench-comm --ranks 2 --sizes "$SIZES" --backend "$BACKEND" \
        --out "$OUT/links.json"
    if [ -f "$OUT/costs.json" ] && [ -f "$OUT/links.json" ]; then
        check compare-pp2 120 $PYTHON -m pipesim compare "${SCHEDULE[@]}" "${MODEL[@]}" --backend "$BACKEND" --costs "$OUT/costs.json" --topology "$OUT/links.json" \
            --json "$OUT/compare.json"
    elif selected compare-pp2; then
        ROWS+=("$(printf '%-26s %-8s %6s  %s' compare-pp2 FAIL - "no costs or links from the checks above")"); FAILED=1
    fi
elif [ -z "${GPU_CHECK_ONLY:-}" ]; then
    ROWS+=("$(printf '%-26s %-8s %6s  %s' multi-gpu "n/a" - "one GPU: NCCL between ranks needs >= 2 (NCCL refuses two ranks on one GPU)")")
fi

# --- the table ----------------------------------------------------------------------------
echo
printf '%-26s %-8s %6s  %s\n' check status seconds detail
for row in "${ROWS[@]}"; do echo "$row"; done
echo "total $(( $(date +%s) - STARTED ))s of ${BUDGET}s"
if [ "$FAILED" != 0 ]; then
    echo "gpu-check: FAILED (logs in $OUT/)" >&2
    exit 1
fi
echo "gpu-check: all checks passed"
