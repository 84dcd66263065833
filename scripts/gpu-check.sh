#!/usr/bin/env bash
# The GPU session's one prepared run (one H200, at most ~8 minutes): the kernel tests and
# microbenchmarks, then what a preemption costs and a short capacity sweep with a
# real-shaped model (Llama-3-8B's architecture, seeded random weights in bf16: nothing is
# downloaded). JSON goes to $RESULTS (default docs/results/gpu), a log beside it.
#
#   scripts/gpu-check.sh                     on the GPU machine, from the repo root
#   GPU_CHECK_DRY_RUN=1 scripts/gpu-check.sh the same sections on this CPU with a tiny
#                                            model and small sizes (tests/test_gpu_check.py)
#
# Runs from the source tree (PYTHONPATH=.), installs nothing. A section whose needs are
# missing there (pytest for the kernel tests; NIXL and the serving packages for the sweep,
# which launches real worker processes) is skipped with a line saying what to carry
# (.library/device/README.md: carry wheels in .whl/). Every section has its own deadline.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-docs/results/gpu}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu-check.log"
: >"$LOG"

if [[ -n "${GPU_CHECK_DRY_RUN:-}" ]]; then
    MODEL=tiny-llama
    CONTEXTS=64,256
    BATCH=4
    SWEEP=(--concurrency 1,2 --num-kv-blocks 24 --quick)
    LIMIT=300
else
    MODEL=random:pdserve/sim/configs/llama-3-8b.json
    CONTEXTS=1024,4096
    BATCH=64
    # 8B in bf16 leaves ~120 GB of the H200 for KV; a pool of 2,048 blocks (32k tokens,
    # 4 GiB) keeps the sweep where preemption happens at concurrency 32+
    SWEEP=(--concurrency 8,32,64 --num-kv-blocks 2048 --mean-output 512
        --requests-per-client 1 --workload long-prompt)
    LIMIT=150
fi

section() { # name, deadline seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$LOG"
    return 0
}

has() { "$PY" -c "import $1" >/dev/null 2>&1; }

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee -a "$LOG"

if has pytest; then
    section "kernel tests (-m gpu)" "$LIMIT" "$PY" -m pytest -q -m gpu tests/test_kernels_triton.py
else
    echo "== kernel tests: skipped, pytest is not installed here (carry its wheel)" | tee -a "$LOG"
fi

if [[ -z "${GPU_CHECK_DRY_RUN:-}" ]]; then
    section "bench kernels" "$LIMIT" "$PY" -m pdserve.cli bench kernels \
        --json "$RESULTS/kernels.json"
fi

section "bench preempt-cost ($MODEL)" "$LIMIT" "$PY" -m pdserve.cli bench preempt-cost \
    --model "$MODEL" --contexts "$CONTEXTS" --batch "$BATCH" --steps 3 --reps 2 \
    --json "$RESULTS/preempt-cost.json"

if has nixl_cu12._api && has prometheus_client && has tqdm; then
    section "bench sweep ($MODEL)" "$((2 * LIMIT))" "$PY" -m pdserve.cli bench sweep \
        --model "$MODEL" "${SWEEP[@]}" --policy greedy+recompute,greedy+tiered,default \
        --json "$RESULTS/sweep.json"
else
    echo "== bench sweep: skipped, it launches real workers and needs nixl-cu12," \
        "prometheus-client and tqdm here (carry their wheels)" | tee -a "$LOG"
fi
echo "results in $RESULTS" | tee -a "$LOG"
