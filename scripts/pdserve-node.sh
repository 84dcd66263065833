#!/usr/bin/env bash
# One pdserve role per node (or per GPU), configured from the environment.
#
#   PDSERVE_ROLE      router | prefill | decode                     (required)
#   PDSERVE_MODEL     preset, checkpoint directory or .gguf file     (required)
#   PDSERVE_ROUTER    router host:port, for prefill/decode workers   (required for workers)
#   PDSERVE_HOST      address to listen on; use the node's reachable address on a
#                     multi-node cluster                             (default 127.0.0.1)
#   PDSERVE_PORT      gRPC port (0 = any free port)                  (default 0; set it for the router)
#   PDSERVE_METRICS_PORT  Prometheus port (0 = any)                  (default 0)
#   PDSERVE_TRANSFER  nixl | loopback                                (default nixl)
#   PDSERVE_KV_BYTES  KV pool bytes per worker                       (default: half of free GPU memory)
#   CUDA_VISIBLE_DEVICES  which GPU this worker uses
#   PDSERVE_EXTRA     more flags for `pdserve serve <role>`
set -euo pipefail
: "${PDSERVE_ROLE:?set PDSERVE_ROLE to router, prefill or decode}"
: "${PDSERVE_MODEL:?set PDSERVE_MODEL}"
args=(serve "$PDSERVE_ROLE" --model "$PDSERVE_MODEL"
      --host "${PDSERVE_HOST:-127.0.0.1}" --port "${PDSERVE_PORT:-0}"
      --metrics-port "${PDSERVE_METRICS_PORT:-0}")
if [[ $PDSERVE_ROLE != router ]]; then
  : "${PDSERVE_ROUTER:?workers need PDSERVE_ROUTER=host:port}"
  args+=(--router "$PDSERVE_ROUTER" --transfer "${PDSERVE_TRANSFER:-nixl}")
  [[ -n ${PDSERVE_KV_BYTES:-} ]] && args+=(--kv-cache-memory "$PDSERVE_KV_BYTES")
fi
# shellcheck disable=SC2086
exec pdserve "${args[@]}" ${PDSERVE_EXTRA:-}
