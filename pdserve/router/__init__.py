"""The router: the front door of a cluster (its own process; `pdserve serve router`).

config.py    every timeout, lease, retry and queue bound, one default each
registry.py  the workers it knows (registration + heartbeats) and the choice among them
handoff.py   one request's way through: reserve -> prefill -> start -> stream
service.py   the gRPC service (Generate, Abort, Register, ListWorkers, Health)
metrics.py   its Prometheus metrics
"""
