"""The decode worker's settings: every timeout, lease and policy choice, one default each."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.admission import DEFAULT_ADMISSION, DEFAULT_MARGIN, check_admission
from pdserve.failpoints import NO_FAILPOINTS, Failpoints

# held requests beyond the engine's running batch (max_num_seqs) a decode worker takes by
# default: reservations whose prompts are being computed, requests waiting for room
QUEUE_REQUESTS = 64


def max_requests(config: DecodeConfig, max_num_seqs: int) -> int:
    """The most requests a decode worker holds at once (DecodeConfig.max_requests)."""
    return config.max_requests or max_num_seqs + QUEUE_REQUESTS


@dataclass(frozen=True)
class DecodeConfig:
    worker_id: str
    admission: str = DEFAULT_ADMISSION  # greedy | kv-aware | cost-aware (engine/admission.py)
    admission_margin: float = DEFAULT_MARGIN  # kv-aware keeps this fraction of the pool free
    # a reservation whose Start has not come by then returns its blocks; used when the
    # router names no lease (it normally does: pdserve/router/config.py)
    default_lease_s: float = 30.0
    kv_arrival_timeout_s: float = 10.0  # Start waits this long for the push's notification
    kv_arrival_poll_s: float = 0.0005
    # a stream that produced nothing for this long, for a request the engine no longer
    # holds, is ended DEADLINE_EXCEEDED (one waiting for room to run is alive)
    stream_idle_s: float = 60.0
    # the step loop's sleep when nothing runs but the worker holds something (reservations
    # whose pushes and leases it watches, requests waiting for room, moving or parked), and
    # when it holds nothing at all; either way a Reserve, a Start or a detach wakes it
    idle_wait_s: float = 0.05
    idle_park_s: float = 1.0
    # live migration (decode/migrate.py): pre-copy rounds at most (the last stops the
    # request), the last one comes as soon as at most `migrate_final_blocks` blocks changed
    # since the previous round, and every WRITE of a move is done within the timeout
    migrate_max_rounds: int = 4
    migrate_final_blocks: int = 2
    migrate_timeout_s: float = 30.0
    # the most requests it holds at once (reserved, waiting, running, parked, moving out):
    # each one's Start call holds a thread of the worker's gRPC server for as long as it
    # streams (pdserve/cli/serve.py sizes the server by it), and a Reserve past it is
    # refused as one without room (the router places it elsewhere or lines it up). None:
    # the engine's max_num_seqs plus QUEUE_REQUESTS (reservations whose prompts are being
    # computed, requests waiting for room)
    max_requests: int | None = None
    failpoints: Failpoints = NO_FAILPOINTS  # decode.* (pdserve/failpoints.py)
    # the node's CPU lease (pdserve/serving/cpu_lease.py): steps run only in its turns; None:
    # this worker's threads have their CPUs to themselves
    cpu_lease: str | None = None

    def __post_init__(self) -> None:
        check_admission(self.admission, self.admission_margin)
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests: must be >= 1, got {self.max_requests}")
        for name in ("migrate_max_rounds", "migrate_final_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in (
            "default_lease_s",
            "kv_arrival_timeout_s",
            "stream_idle_s",
            "idle_wait_s",
            "idle_park_s",
            "migrate_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
