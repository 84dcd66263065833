from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "has_seed", "seed", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Span(_message.Message):
    __slots__ = ("name", "start", "end", "worker", "layer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: float
    end: float
    worker: str
    layer: int
    def __init__(self, name: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., worker: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ok", "role", "worker_id", "protocol_version", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    role: str
    worker_id: str
    protocol_version: int
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., role: _Optional[str] = ..., worker_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "unpushed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UNPUSHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    unpushed: bool
    def __init__(self, request_id: _Optional[str] = ..., unpushed: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("protocol_version", "text", "token_ids", "sampling", "request_id", "continuation")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    request_id: str
    continuation: TokenIds
    def __init__(self, protocol_version: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., continuation: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s", "ttft_s", "tpot_s", "e2e_s", "prefill_worker", "decode_worker", "arrival_unix", "end_unix", "resumes", "migrations")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_worker: str
    decode_worker: str
    arrival_unix: float
    end_unix: float
    resumes: int
    migrations: int
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., arrival_unix: _Optional[float] = ..., end_unix: _Optional[float] = ..., resumes: _Optional[int] = ..., migrations: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "timings", "text", "trace", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    timings: Timings
    text: str
    trace: _containers.RepeatedCompositeFieldContainer[Span]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., text: _Optional[str] = ..., trace: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "metrics_address", "free_blocks", "total_blocks", "queued_tokens", "running", "last_heartbeat_age_s", "headroom_blocks", "preempted", "parked_request_ids", "projected_free_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    PARKED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    metrics_address: str
    free_blocks: int
    total_blocks: int
    queued_tokens: int
    running: int
    last_heartbeat_age_s: float
    headroom_blocks: int
    preempted: int
    parked_request_ids: _containers.RepeatedScalarFieldContainer[str]
    projected_free_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., running: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., headroom_blocks: _Optional[int] = ..., preempted: _Optional[int] = ..., parked_request_ids: _Optional[_Iterable[str]] = ..., projected_free_blocks: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "worker")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker: WorkerInfo
    def __init__(self, protocol_version: _Optional[int] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "heartbeat_interval_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    heartbeat_interval_s: float
    def __init__(self, accepted: _Optional[bool] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "undo", "stop")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    undo: bool
    stop: bool
    def __init__(self, worker_id: _Optional[str] = ..., undo: _Optional[bool] = ..., stop: _Optional[bool] = ...) -> None: ...

class DrainProgress(_message.Message):
    __slots__ = ("moved", "failed", "remaining", "done", "stopped")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    moved: int
    failed: int
    remaining: int
    done: bool
    stopped: bool
    def __init__(self, moved: _Optional[int] = ..., failed: _Optional[int] = ..., remaining: _Optional[int] = ..., done: _Optional[bool] = ..., stopped: _Optional[bool] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("wire_version", "layout_hash", "num_blocks", "block_bytes", "planes_per_layer", "region", "head_start", "head_stop", "total_heads", "tp_rank", "tp_size")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_STOP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HEADS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    layout_hash: str
    num_blocks: int
    block_bytes: int
    planes_per_layer: int
    region: int
    head_start: int
    head_stop: int
    total_heads: int
    tp_rank: int
    tp_size: int
    def __init__(self, wire_version: _Optional[int] = ..., layout_hash: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., planes_per_layer: _Optional[int] = ..., region: _Optional[int] = ..., head_start: _Optional[int] = ..., head_stop: _Optional[int] = ..., total_heads: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class RankKV(_message.Message):
    __slots__ = ("layout", "agent_metadata")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    agent_metadata: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_s", "push_window_s", "extra_tokens", "line", "decode_workers", "generated_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    lease_s: float
    push_window_s: float
    extra_tokens: int
    line: int
    decode_workers: int
    generated_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., lease_s: _Optional[float] = ..., push_window_s: _Optional[float] = ..., extra_tokens: _Optional[int] = ..., line: _Optional[int] = ..., decode_workers: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "layout", "agent_metadata", "worker_id", "cached_blocks", "headroom_cost_blocks", "fence", "ranks")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_COST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    agent_metadata: bytes
    worker_id: str
    cached_blocks: int
    headroom_cost_blocks: int
    fence: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankKV]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., agent_metadata: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., headroom_cost_blocks: _Optional[int] = ..., fence: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankKV, _Mapping]]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("request_id", "fence", "lease_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    fence: int
    lease_s: float
    def __init__(self, request_id: _Optional[str] = ..., fence: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("request_id", "first_token", "more_token_ids", "first_token_sent", "prefill_here", "feed_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    more_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_sent: bool
    prefill_here: bool
    feed_id: str
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., more_token_ids: _Optional[_Iterable[int]] = ..., first_token_sent: _Optional[bool] = ..., prefill_here: _Optional[bool] = ..., feed_id: _Optional[str] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "dest_request_id", "dest_worker_id", "dest_block_ids", "dest_layout", "dest_agent_metadata", "dest_cached_blocks", "dest_fence", "dest_ranks", "max_rounds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEST_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DEST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEST_FENCE_FIELD_NUMBER: _ClassVar[int]
    DEST_RANKS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dest_request_id: str
    dest_worker_id: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dest_layout: KVLayout
    dest_agent_metadata: bytes
    dest_cached_blocks: int
    dest_fence: int
    dest_ranks: _containers.RepeatedCompositeFieldContainer[RankKV]
    max_rounds: int
    def __init__(self, request_id: _Optional[str] = ..., dest_request_id: _Optional[str] = ..., dest_worker_id: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., dest_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., dest_agent_metadata: _Optional[bytes] = ..., dest_cached_blocks: _Optional[int] = ..., dest_fence: _Optional[int] = ..., dest_ranks: _Optional[_Iterable[_Union[RankKV, _Mapping]]] = ..., max_rounds: _Optional[int] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("rounds", "bytes", "num_tokens", "stall_s")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    bytes: int
    num_tokens: int
    stall_s: float
    def __init__(self, rounds: _Optional[int] = ..., bytes: _Optional[int] = ..., num_tokens: _Optional[int] = ..., stall_s: _Optional[float] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "tpot_s", "spans")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    tpot_s: float
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., tpot_s: _Optional[float] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...

class FeedRequest(_message.Message):
    __slots__ = ("feed_id",)
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    feed_id: str
    def __init__(self, feed_id: _Optional[str] = ...) -> None: ...

class FeedItem(_message.Message):
    __slots__ = ("request_id", "chunk")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class FeedBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[FeedItem]
    def __init__(self, items: _Optional[_Iterable[_Union[FeedItem, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "dest_worker_id", "dest_block_ids", "dest_layout", "dest_agent_metadata", "dest_cached_blocks", "dest_fence", "dest_ranks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEST_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEST_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DEST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEST_FENCE_FIELD_NUMBER: _ClassVar[int]
    DEST_RANKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    dest_worker_id: str
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dest_layout: KVLayout
    dest_agent_metadata: bytes
    dest_cached_blocks: int
    dest_fence: int
    dest_ranks: _containers.RepeatedCompositeFieldContainer[RankKV]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., dest_worker_id: _Optional[str] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., dest_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., dest_agent_metadata: _Optional[bytes] = ..., dest_cached_blocks: _Optional[int] = ..., dest_fence: _Optional[int] = ..., dest_ranks: _Optional[_Iterable[_Union[RankKV, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "queue_s", "prefill_s", "transfer_s", "transfer_bytes", "worker_id", "spans")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    worker_id: str
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    def __init__(self, first_token: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...
