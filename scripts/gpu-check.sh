#!/usr/bin/env bash
# The GPU session's one prepared run: the kernel tests, what a preemption costs, decode
# against the memory roofline, a calibrated profile for the simulator and the simulator
# against the engine, the spill tiers against raw copies (pinned host memory), the kernel
# microbenchmarks, and a short capacity sweep (when NIXL is carried), all with a real-shaped
# model (Llama-3-8B's architecture, seeded random weights in bf16: nothing is downloaded).
# On one H200 every section but the sweep took 302 s together (2026-12-04, second session,
# docs/gpu-h200.md); their deadlines add up to 15 minutes without the sweep. JSON goes to $RESULTS (default docs/results/gpu), a
# log beside it.
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
KEYS="kernel-tests preempt-cost roofline calibrate sim-vs-real tiers kernels sweep"
# GPU_CHECK_ONLY="preempt-cost sim-vs-real" (or with commas) runs only those sections: a
# rerun after a fix, inside the same lease; its log goes on after the full run's
ONLY=" ${GPU_CHECK_ONLY:-} "
ONLY=${ONLY//,/ }
for key in $ONLY; do
    if [[ " $KEYS " != *" $key "* ]]; then
        echo "GPU_CHECK_ONLY: unknown section $key (sections: $KEYS)" >&2
        exit 2
    fi
done
if [[ -n "${GPU_CHECK_ONLY:-}" ]]; then
    echo "== rerun of:$ONLY($(date -u +%FT%TZ))" >>"$LOG"
else
    : >"$LOG"
fi

if [[ -n "${GPU_CHECK_DRY_RUN:-}" ]]; then
    MODEL=tiny-llama
    CONTEXTS=64,256
    BATCH=4
    SWEEP=(--concurrency 2 --num-kv-blocks 24 --quick)
    ROOFLINE=(--batches 1,2 --contexts 64)
    CALIBRATE=(--batches 1,2 --contexts 32,64 --num-kv-blocks 64)
    VS_REAL=(--concurrency 1,2 --num-kv-blocks 16 --requests 4)
    # the CPU pool in bf16, as the GPU run's: the same byte views and reference passes
    TIERS=(--device cpu --dtype bfloat16 --quick)
    LIMIT=300
else
    MODEL=random:pdserve/sim/configs/llama-3-8b.json
    # 4,096-token contexts at batch 64 did not finish in 85 s on the H200 (2026-12-04)
    CONTEXTS=1024,2048
    BATCH=32
    # 8B in bf16 leaves ~120 GB of the H200 for KV; a pool of 2,048 blocks (32k tokens,
    # 4 GiB) keeps the sweep where preemption happens at concurrency 32+
    SWEEP=(--concurrency 8,32,64 --num-kv-blocks 2048 --mean-output 512
        --requests-per-client 1 --workload long-prompt)
    # our engine against the memory roofline at serving batch sizes, measured in the run
    ROOFLINE=(--batches 1,8,32,64,128,256 --contexts 512,2048)
    # the engine's steps over a grid -> a fitted H200 profile for `pdserve sim` (the built-in
    # h200.json is a roofline with assumed efficiencies), then the simulator against the same
    # engine with it; 8,192 blocks (16 GiB) hold 64 clients of 1,024-token prompts
    CALIBRATE=(--batches 1,4,16,64 --contexts 128,512,1024 --num-kv-blocks 8192)
    VS_REAL=(--concurrency 4,16,32 --num-kv-blocks 32 --requests 16 --mean-output 64)
    # the pool on the GPU in bf16, 1-256 blocks of 2 MiB; the host tier pinned as a worker's
    # is, raw = one device <-> pinned host copy of the same bytes (docs/benchmarks.md)
    TIERS=(--device cuda)
    LIMIT=60
fi

wanted() { [[ -z "${GPU_CHECK_ONLY:-}" || "$ONLY" == *" $1 "* ]]; }

section() { # key, name, deadline seconds, command...
    local key=$1 name=$2 limit=$3
    shift 3
    if ! wanted "$key"; then
        echo "== $name: not in GPU_CHECK_ONLY" | tee -a "$LOG"
        return 0
    fi
    echo "== $name (at most ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    LAST_RC=$?
    echo "== $name: exit $LAST_RC after $((SECONDS - start))s" | tee -a "$LOG"
    return 0
}

has() { "$PY" -c "import $1" >/dev/null 2>&1; }

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee -a "$LOG"

if ! wanted kernel-tests || has pytest; then
    section kernel-tests "kernel and CUDA graph tests (-m gpu)" "$((3 * LIMIT / 2))" "$PY" -m pytest \
        -q -m gpu tests/test_kernels_triton.py tests/test_cuda_graphs.py
else
    echo "== kernel tests: skipped, pytest is not installed here (carry its wheel)" | tee -a "$LOG"
fi

section preempt-cost "bench preempt-cost ($MODEL)" "$((3 * LIMIT / 2))" "$PY" -m pdserve.cli bench preempt-cost \
    --model "$MODEL" --contexts "$CONTEXTS" --batch "$BATCH" --steps 6 --reps 2 \
    --json "$RESULTS/preempt-cost.json"

section roofline "bench roofline ($MODEL)" "$((3 * LIMIT / 2))" "$PY" -m pdserve.cli bench roofline \
    --model "$MODEL" "${ROOFLINE[@]}" --steps 3 --json "$RESULTS/roofline.json"

LAST_RC=0
section calibrate "sim calibrate ($MODEL)" "$((5 * LIMIT / 2))" "$PY" -m pdserve.cli sim calibrate \
    --model "$MODEL" "${CALIBRATE[@]}" --json "$RESULTS/profile.json" \
    --samples "$RESULTS/calibrate-steps.json"
CALIBRATED=$LAST_RC

PROFILE=${PROFILE:-$RESULTS/profile.json} # calibrate's, or one from an earlier run
if ! wanted sim-vs-real; then
    echo "== bench sim-vs-real ($MODEL): not in GPU_CHECK_ONLY" | tee -a "$LOG"
elif wanted calibrate && [[ $CALIBRATED != 0 ]]; then
    echo "== bench sim-vs-real: skipped, calibrate failed (exit $CALIBRATED)" | tee -a "$LOG"
elif [[ -f "$PROFILE" ]]; then
    # 4x: an engine probe before each policy's points (three more engines built than in 2026-12-04's 42 s)
    section sim-vs-real "bench sim-vs-real ($MODEL)" "$((4 * LIMIT))" "$PY" -m pdserve.cli \
        bench sim-vs-real --model "$MODEL" --profile "$PROFILE" "${VS_REAL[@]}" \
        --json "$RESULTS/sim-vs-real.json"
else
    echo "== bench sim-vs-real: skipped, calibrate wrote no profile" | tee -a "$LOG"
fi

section tiers "bench tiers ($MODEL)" "$((3 * LIMIT / 2))" "$PY" -m pdserve.cli bench tiers \
    --model "$MODEL" "${TIERS[@]}" --json "$RESULTS/tiers.json"

if [[ -z "${GPU_CHECK_DRY_RUN:-}" ]]; then
    section kernels "bench kernels" "$((4 * LIMIT))" "$PY" -m pdserve.cli bench kernels \
        --tiles --json "$RESULTS/kernels.json"
fi

if ! wanted sweep || { has nixl_cu12._api && has prometheus_client && has tqdm; }; then
    section sweep "bench sweep ($MODEL)" "$((2 * LIMIT))" "$PY" -m pdserve.cli bench sweep \
        --model "$MODEL" "${SWEEP[@]}" --policy greedy+recompute,greedy+tiered,default \
        --json "$RESULTS/sweep.json"
else
    echo "== bench sweep: skipped, it launches real workers and needs nixl-cu12," \
        "prometheus-client and tqdm here (carry their wheels)" | tee -a "$LOG"
fi
echo "results in $RESULTS" | tee -a "$LOG"
