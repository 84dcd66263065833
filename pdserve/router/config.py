"""The router's settings: every timeout, lease and retry in one frozen place."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.serving.registration import HEARTBEAT_S


@dataclass(frozen=True)
class RouterConfig:
    max_model_len: int
    max_queue: int = 256  # requests admitted at once; more answer RESOURCE_EXHAUSTED
    # a request waits this long for a decode worker with room (and for workers at all),
    # then RESOURCE_EXHAUSTED (no room) or UNAVAILABLE (no workers)
    queue_timeout_s: float = 30.0
    reserve_retry_s: tuple[float, float] = (0.01, 0.2)  # first and longest pause between tries
    reserve_rpc_timeout_s: float = 10.0
    release_rpc_timeout_s: float = 5.0
    probe_timeout_s: float = 2.0  # a new worker's Health must answer within this
    prefill_timeout_s: float = 180.0  # the prefill RPC's deadline (the worker honours it)
    stream_timeout_s: float = 3600.0  # a decode stream's deadline
    heartbeat_s: float = HEARTBEAT_S  # told to every worker that registers
    missed_heartbeats: int = 5  # then a worker gets no new requests (its streams go on)
    forget_after_s: float = 120.0  # then it leaves the registry and its channel is closed

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1, got {self.max_queue}")
        for name in (
            "max_model_len",
            "queue_timeout_s",
            "reserve_rpc_timeout_s",
            "release_rpc_timeout_s",
            "probe_timeout_s",
            "prefill_timeout_s",
            "stream_timeout_s",
            "heartbeat_s",
            "forget_after_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        first, longest = self.reserve_retry_s
        if not 0 < first <= longest:
            raise ValueError(
                f"reserve_retry_s: need 0 < first <= longest, got {self.reserve_retry_s}"
            )

    @property
    def lease_s(self) -> float:
        """A reservation's lease must outlive the prefill that fills its blocks: blocks
        returned while a push is still running could be handed to another request and
        overwritten by the late push."""
        return self.prefill_timeout_s + 60.0

    @property
    def alive_window_s(self) -> float:
        return self.missed_heartbeats * self.heartbeat_s
