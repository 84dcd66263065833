"""The router's settings: every timeout, lease and retry in one frozen place."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.serving.registration import HEARTBEAT_S


@dataclass(frozen=True)
class RouterConfig:
    max_model_len: int
    max_queue: int = 256  # requests admitted at once; more answer RESOURCE_EXHAUSTED
    # a request waits this long for a decode worker with room (and for workers at all),
    # then RESOURCE_EXHAUSTED (no room) or UNAVAILABLE (no workers); one already under way
    # waits longer for room (room_wait_s)
    queue_timeout_s: float = 30.0
    reserve_retry_s: tuple[float, float] = (0.01, 0.2)  # first and longest pause between tries
    reserve_rpc_timeout_s: float = 10.0
    release_rpc_timeout_s: float = 5.0
    probe_timeout_s: float = 2.0  # a new worker's Health must answer within this
    prefill_timeout_s: float = 180.0  # the prefill RPC's deadline (the worker honours it)
    # a reservation's lease, renewed every third of it while its prefill runs
    # (pdserve/router/leases.py): a dead router's reservations come back within it
    lease_s: float = 10.0
    # a push may land up to this long after its deadline (a WRITE posted just before it)
    push_margin_s: float = 2.0
    # times a request is resumed on another worker after the one serving it died or went
    # silent (or its prefill failed); then it fails with the last failure's status
    max_resumes: int = 3
    stream_timeout_s: float = 3600.0  # a decode stream's deadline
    # live migration (pdserve/router/migrate.py): a move's deadline (every pre-copy round
    # and the last, on the worker it leaves), the tokens of room its destination reserves
    # beyond the context (the request decodes on while it moves; the blocks count as used
    # on the receiver, and too little room makes moves stop early: docs/migration.md), and
    # how long a drain keeps moving what is left before it gives up
    migrate_timeout_s: float = 30.0
    migrate_extra_tokens: int = 128
    drain_timeout_s: float = 600.0
    # when to migrate (pdserve/router/rebalance.py): "off", or "pressure" (a decode worker
    # with under migrate_low_free of its pool free gives a request to one at least
    # migrate_min_gap freer, every rebalance_period_s, one per migrate_interval_s at most)
    migrate_policy: str = "off"
    rebalance_period_s: float = 0.5
    migrate_low_free: float = 0.2
    migrate_min_gap: float = 0.25
    migrate_interval_s: float = 0.5
    # conditional disaggregation: a context of at most this many tokens is computed by the
    # decode worker that reserved it, in its next steps beside its running batch, instead of
    # on a prefill worker (no push, no second pass over the weights on the node); 0: every
    # prompt goes to a prefill worker (docs/architecture.md)
    local_prefill_tokens: int = 0
    # a decode worker's tokens for this router on one feed call, a message a step for all
    # its streams (pdserve/router/feed.py); off: a message a token on each request's stream
    token_feed: bool = True
    heartbeat_s: float = HEARTBEAT_S  # told to every worker that registers
    missed_heartbeats: int = 5  # then a worker gets no new requests (its streams go on)
    forget_after_s: float = 120.0  # then it leaves the registry and its channel is closed

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1, got {self.max_queue}")
        if self.max_resumes < 0:
            raise ValueError(f"max_resumes: must be >= 0, got {self.max_resumes}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens: must be >= 0, got {self.local_prefill_tokens}")
        for name in (
            "max_model_len",
            "queue_timeout_s",
            "reserve_rpc_timeout_s",
            "release_rpc_timeout_s",
            "probe_timeout_s",
            "prefill_timeout_s",
            "lease_s",
            "push_margin_s",
            "stream_timeout_s",
            "migrate_timeout_s",
            "migrate_extra_tokens",
            "drain_timeout_s",
            "rebalance_period_s",
            "migrate_interval_s",
            "heartbeat_s",
            "forget_after_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        # a decode worker refuses leases and push windows beyond an hour (decode/state.py):
        # a router configured past it would have every request refused INVALID_ARGUMENT
        for name in ("lease_s", "push_window_s"):
            if getattr(self, name) > 3600:
                raise ValueError(f"{name}: at most 3600 s, got {getattr(self, name)}")
        if self.migrate_policy not in ("off", "pressure"):
            raise ValueError(f"migrate_policy: off or pressure, got {self.migrate_policy!r}")
        for name in ("migrate_low_free", "migrate_min_gap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(
                    f"{name}: a fraction of a pool in [0, 1], got {getattr(self, name)}"
                )
        first, longest = self.reserve_retry_s
        if not 0 < first <= longest:
            raise ValueError(
                f"reserve_retry_s: need 0 < first <= longest, got {self.reserve_retry_s}"
            )

    @property
    def push_window_s(self) -> float:
        """Told to the decode worker at Reserve: no push for the reservation lands later
        (the prefill call's deadline lies inside it). A reservation that ends before its
        push arrived keeps its blocks fenced until then (decode/reservations.py)."""
        return self.prefill_timeout_s + self.push_margin_s

    def room_wait_s(self, under_way: bool) -> float:
        """How long an attempt waits for a decode worker with room: queue_timeout_s for a
        new request; for one already under way (resumed after a fault, or a client's
        continuation after a router restart) at least the push window: its client holds
        tokens, and blocks a failed attempt left fenced come back within that window. (A
        prefill worker is waited for queue_timeout_s either way.)"""
        if under_way:
            return max(self.queue_timeout_s, self.push_window_s)
        return self.queue_timeout_s

    @property
    def alive_window_s(self) -> float:
        return self.missed_heartbeats * self.heartbeat_s
