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
#   CUDA_VISIBLE_DEVICES  which GPU(s) this worker uses: with PDSERVE_TP=k, k of them
#                     (rank r on the r-th; e.g. CUDA_VISIBLE_DEVICES=4,5,6,7 PDSERVE_TP=4)
#   PDSERVE_TP        tensor-parallel ranks of this worker           (default 1)
#   PDSERVE_SECRET_FILE   the cluster secret, one file readable only by this user, the same
#                     on every node (or PDSERVE_CLUSTER_SECRET; docs/security.md)
#   PDSERVE_TLS_DIR   a directory from `pdserve certs` (member.pem, member-key.pem, ca.pem):
#                     mutual TLS between all members
#   PDSERVE_API_KEY_FILE  router: API keys for Generate and the OpenAI API, one per line
#   PDSERVE_EXTRA     more flags for `pdserve serve <role>`
set -euo pipefail
: "${PDSERVE_ROLE:?set PDSERVE_ROLE to router, prefill or decode}"
: "${PDSERVE_MODEL:?set PDSERVE_MODEL}"
args=(serve "$PDSERVE_ROLE" --model "$PDSERVE_MODEL"
      --host "${PDSERVE_HOST:-127.0.0.1}" --port "${PDSERVE_PORT:-0}"
      --metrics-port "${PDSERVE_METRICS_PORT:-0}")
[[ -n ${PDSERVE_SECRET_FILE:-} ]] && args+=(--cluster-secret-file "$PDSERVE_SECRET_FILE")
if [[ -n ${PDSERVE_TLS_DIR:-} ]]; then
  args+=(--tls-cert "$PDSERVE_TLS_DIR/member.pem" --tls-key "$PDSERVE_TLS_DIR/member-key.pem"
         --tls-ca "$PDSERVE_TLS_DIR/ca.pem")
fi
if [[ $PDSERVE_ROLE == router && -n ${PDSERVE_API_KEY_FILE:-} ]]; then
  args+=(--api-key-file "$PDSERVE_API_KEY_FILE")
fi
if [[ $PDSERVE_ROLE != router ]]; then
  : "${PDSERVE_ROUTER:?workers need PDSERVE_ROUTER=host:port}"
  args+=(--router "$PDSERVE_ROUTER" --transfer "${PDSERVE_TRANSFER:-nixl}")
  [[ -n ${PDSERVE_KV_BYTES:-} ]] && args+=(--kv-cache-memory "$PDSERVE_KV_BYTES")
  args+=(--tp "${PDSERVE_TP:-1}")
fi
# shellcheck disable=SC2086
exec pdserve "${args[@]}" ${PDSERVE_EXTRA:-}
