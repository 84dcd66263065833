"""The router: the front door of a cluster (its own process; `pdserve serve router`).

config.py    every timeout, lease, retry and queue bound, one default each
registry.py  the workers it knows (registration + heartbeats) and the choice among them
handoff.py   one request's way through: reserve -> prefill -> start -> stream, resumed
             on another worker when one fails (docs/faults.md)
request.py   one request as its client sees it across attempts; its final message
leases.py    renewing the reservations whose prefill is running (short leases)
watch.py     cancelling the streams of workers that stopped heartbeating
periodic.py  the thread both of them tick on
service.py   the gRPC service (Generate, Abort, Register, ListWorkers, Health)
metrics.py   its Prometheus metrics
"""
