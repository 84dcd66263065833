#!/usr/bin/env bash
# Two GPU nodes: node A runs the router and a prefill worker per GPU, node B a decode worker
# per GPU. Run the "A" part on node A and the "B" part on node B (same model path on both).
#
#   NODE_A=10.0.0.1 NODE_B=10.0.0.2 MODEL=/models/Llama-3.1-8B-Instruct GPUS=8 \
#     scripts/two-node-example.sh A      # on node A
#   NODE_A=10.0.0.1 NODE_B=10.0.0.2 MODEL=/models/Llama-3.1-8B-Instruct GPUS=8 \
#     scripts/two-node-example.sh B      # on node B
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${NODE_A:?}" "${NODE_B:?}" "${MODEL:?}"
GPUS=${GPUS:-8}
ROUTER_PORT=${ROUTER_PORT:-50051}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' INT TERM EXIT
case "${1:?A or B}" in
  A)
    PDSERVE_ROLE=router PDSERVE_MODEL=$MODEL PDSERVE_HOST=$NODE_A PDSERVE_PORT=$ROUTER_PORT \
      "$here/pdserve-node.sh" & pids+=($!)
    for ((g = 0; g < GPUS; g++)); do
      CUDA_VISIBLE_DEVICES=$g PDSERVE_ROLE=prefill PDSERVE_MODEL=$MODEL PDSERVE_HOST=$NODE_A \
        PDSERVE_ROUTER=$NODE_A:$ROUTER_PORT "$here/pdserve-node.sh" & pids+=($!)
    done ;;
  B)
    for ((g = 0; g < GPUS; g++)); do
      CUDA_VISIBLE_DEVICES=$g PDSERVE_ROLE=decode PDSERVE_MODEL=$MODEL PDSERVE_HOST=$NODE_B \
        PDSERVE_ROUTER=$NODE_A:$ROUTER_PORT "$here/pdserve-node.sh" & pids+=($!)
    done ;;
  *) echo "usage: $0 A|B" >&2; exit 2 ;;
esac
wait
