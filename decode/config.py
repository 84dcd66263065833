"""The decode worker's settings: every timeout, lease and policy choice, one default each."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.admission import DEFAULT_ADMISSION, DEFAULT_MARGIN, check_admission
from pdserve.failpoints import NO_FAILPOINTS, Failpoints


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
    failpoints: Failpoints = NO_FAILPOINTS  # decode.* (pdserve/failpoints.py)
    # the node's CPU lease (pdserve/serving/cpu_lease.py): steps run only in its turns; None:
    # this worker's threads have their CPUs to themselves
    cpu_lease: str | None = None

    def __post_init__(self) -> None:
        check_admission(self.admission, self.admission_margin)
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
