"""The process edge every role shares: proto <-> dataclass conversion, gRPC servers, worker
registration and heartbeats, Prometheus plumbing, and the KV pool as the transfer layer sees
it. Nothing here knows a role: the roles (prefill/, decode/, pdserve/router/) import it."""
