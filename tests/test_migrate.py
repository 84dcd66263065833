"""Live KV migration between two decode workers in one process (real NIXL agents): a request
prefilled into A decodes there, its KV moves to B in pre-copy rounds while it keeps
decoding, and B finishes it. The tokens are the colocated engine's, none lost or repeated;
B's blocks hold A's bytes; every block of every worker is free at the end."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from workers import decode_worker, destination, drain, prefill_worker

from decode.legs import Round, RoundFailed
from decode.migrate import MigrationFailed
from decode.streams import EndEvent
from pdserve import LLM
from pdserve.engine.args import EngineArgs
from pdserve.sampling_params import SamplingParams
from transfer import XferState

MAX_NEW = 300  # long enough that a move starts well before the request ends
PROMPT = list(range(3, 60))  # 57 tokens: 4 blocks of 16, the last partial
NUM_BLOCKS = 64


def params(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(params=["tiny-llama", "tiny-deepseek"])
def trio(request):
    args = EngineArgs(block_size=16, num_kv_blocks=NUM_BLOCKS)
    name = request.param
    prefill = prefill_worker(name, f"p-{name}", "nixl", args)
    a = decode_worker(name, f"a-{name}", "nixl", args)
    b = decode_worker(name, f"b-{name}", "nixl", args)
    yield name, prefill, a, b
    for w in (prefill, a, b):
        w.close()


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    return {
        name: LLM(name, block_size=16).generate([PROMPT], params())[0].token_ids
        for name in ("tiny-llama", "tiny-deepseek")
    }


def started(prefill, decode, rid: str, prompt: list[int] = PROMPT):
    reserved = decode.reserve(rid, prompt, params(), lease_s=30)
    result = prefill.submit(rid, prompt, params(), destination(decode, reserved)).result(60)
    return decode.start(rid, result.first_token)


def take(stream, n: int) -> list[int]:
    """The next `n` tokens of a stream that has at least that many to come."""
    tokens = []
    while len(tokens) < n:
        event = stream.events.get(timeout=30)
        assert not isinstance(event, EndEvent), event
        tokens.append(event.token)
    return tokens


def rest(stream) -> tuple[list[int], str]:
    tokens, reason = drain(stream)
    return tokens, reason


class Move:
    """What the router does around one migration: reserve on the destination for the
    context the client has seen (all but its last token, whose KV may not exist yet), with
    room to grow; move; then start there with the tokens produced meanwhile."""

    def __init__(
        self, src, dst, rid: str, new_rid: str, prompt: list[int], sent: list[int], extra=64
    ):
        self.src, self.dst, self.rid, self.new_rid = src, dst, rid, new_rid
        self.prompt, self.sent_at_reserve = prompt, len(sent)
        self.reserved = dst.reserve(
            new_rid,
            prompt + sent[:-1],
            params(MAX_NEW - len(sent) + 1),
            lease_s=30,
            extra_tokens=extra,
            generated=len(sent) - 1,  # as the router says it: its output counts from its start
        )
        self.dest = destination(dst, self.reserved)

    def run(self, max_rounds: int = 0):
        return self.src.migrate(self.rid, self.dest, self.new_rid, max_rounds)

    def start(self, sent: list[int]):
        more = sent[self.sent_at_reserve - 1 : -1]
        return self.dst.start(self.new_rid, sent[-1], more, first_token_sent=True)


def snapshots(worker) -> dict[int, torch.Tensor]:
    """Every block's bytes at the moment the worker gives a request's blocks back."""
    pool, bd = worker.core.kv_pool, worker.core.kv_block_dim
    kept: dict[int, torch.Tensor] = {}
    release = worker.core.release

    def keep_then_release(request):
        kept.update({b: pool.select(bd, b).clone() for b in request.block_ids})
        kept["order"] = list(request.block_ids)
        release(request)

    worker.core.release = keep_then_release
    return kept


def test_a_migrated_request_finishes_on_the_other_worker_with_the_same_tokens(trio, expected):
    model, prefill, a, b = trio
    stream = started(prefill, a, "r1")
    sent = take(stream, 6)
    # room for a pre-copy round however far it decoded before the first look (in CI it once
    # decoded far enough that the default 64 tokens of room did not leave two blocks of
    # growth: then the first round was the last)
    move = Move(a, b, "r1", "r1~m1", PROMPT, sent, extra=128)
    kept = snapshots(a)
    moved = move.run()
    more, reason = rest(stream)
    assert reason == "migrated"
    sent += more
    assert moved.rounds >= 2  # 4+ blocks then what changed: a pre-copy round and the last
    assert moved.num_tokens == len(PROMPT) + len(sent)
    assert moved.nbytes >= (len(PROMPT) // 16 + 1) * a.endpoint.bytes_per_block
    # B's blocks hold A's bytes, block for block (A's at the moment it let them go)
    pool, bd = b.core.kv_pool, b.core.kv_block_dim
    kv_blocks = -(-(moved.num_tokens - 1) // 16)
    for src, dst in zip(kept["order"][:kv_blocks], move.reserved.block_ids):
        assert torch.equal(kept[src], pool.select(bd, dst)), f"block {src} -> {dst} differs"
    tokens, reason = rest(move.start(sent))
    assert (sent + tokens, reason) == (expected[model], "length")
    for w in (a, b):
        w.check_integrity()
        assert w.stats().free_blocks == NUM_BLOCKS
    assert a.metrics.migrations.labels("completed")._value.get() == 1
    # B's length estimator learned the request's whole length; A, which handed it over,
    # learned nothing from it
    assert b.state.estimator.sorted_lengths().tolist() == [MAX_NEW]
    assert a.state.estimator.count == 0


def test_a_request_migrated_twice_keeps_its_tokens(trio, expected):
    model, prefill, a, b = trio
    stream = started(prefill, a, "r2")
    sent = take(stream, 4)
    first = Move(a, b, "r2", "r2~m1", PROMPT, sent)
    first.run()
    more, reason = rest(stream)
    assert reason == "migrated"
    sent += more
    stream = first.start(sent)
    sent += take(stream, 5)
    second = Move(b, a, "r2~m1", "r2~m2", PROMPT, sent)
    second.run(max_rounds=1)  # stop at once: one round moves everything
    more, reason = rest(stream)
    assert reason == "migrated"
    sent += more
    tokens, reason = rest(second.start(sent))
    assert (sent + tokens, reason) == (expected[model], "length")
    for w in (a, b):
        w.check_integrity()
        assert w.stats().free_blocks == NUM_BLOCKS
    assert a.state.estimator.sorted_lengths().tolist() == [MAX_NEW]  # moved twice: whole
    assert b.state.estimator.count == 0


def test_a_request_that_outruns_its_pre_copy_waits_at_the_destination_size(trio, expected):
    """A fast decoder can produce more tokens during one pre-copy round than the destination
    has room for (CI once saw 134 tokens against 8 reserved blocks, and the move failed):
    the request waits at the destination's size, steps going on without it, until its last
    round moves it; B finishes it with the colocated engine's tokens."""
    model, prefill, a, b = trio
    stream = started(prefill, a, "r6")
    sent = take(stream, 4)
    move = Move(a, b, "r6", "r6~m1", PROMPT, sent, extra=128)  # room for pre-copy rounds
    capacity = len(move.reserved.block_ids) * 16
    write = a.migrator._write

    def computed() -> int:
        with a.lock:
            kv = a.core.kv_of("r6")
        assert kv is not None, "r6 stopped running before its last round"
        return kv[1]

    def slow_pre_copy(*args, final: bool, **kw):
        nbytes = write(*args, final=final, **kw)
        if not final:  # a pre-copy round: it ends only once the request could outrun it
            wait_for(lambda: computed() >= capacity, "r6 reaching the destination's size")
            steps = a.core.scheduler.steps
            wait_for(lambda: a.core.scheduler.steps >= steps + 3, "three more steps")
            assert computed() == capacity
        return nbytes

    a.migrator._write = slow_pre_copy
    moved = move.run()
    more, reason = rest(stream)
    assert reason == "migrated"
    sent += more
    assert moved.rounds >= 2 and moved.num_tokens == capacity + 1  # the last token has no KV
    tokens, reason = rest(move.start(sent))
    assert (sent + tokens, reason) == (expected[model], "length")
    for w in (a, b):
        w.check_integrity()
        assert w.stats().free_blocks == NUM_BLOCKS


def test_a_refused_move_leaves_the_request_running_where_it_was(trio, expected):
    """A destination whose pool is laid out otherwise (another block size) is refused
    before any WRITE: the request decodes on at A to its end, and nothing is held."""
    model, prefill, a, _ = trio
    other = decode_worker(model, f"c-{model}", "nixl", EngineArgs(block_size=32, num_kv_blocks=32))
    try:
        stream = started(prefill, a, "r3")
        sent = take(stream, 3)
        move = Move(a, other, "r3", "r3~m1", PROMPT, sent)
        with pytest.raises(MigrationFailed, match="destination") as e:
            move.run()
        assert not e.value.retryable
        other.release("r3~m1", unpushed=True)
        assert other.stats().free_blocks == 32
    finally:
        other.close()
    tokens, reason = rest(stream)
    assert (sent + tokens, reason) == (expected[model], "length")
    a.check_integrity()
    assert a.stats().free_blocks == NUM_BLOCKS
    assert a.metrics.migrations.labels("failed")._value.get() == 1


def test_a_request_that_is_not_running_is_not_moved(trio):
    _, prefill, a, b = trio
    reserved = b.reserve("x~m1", PROMPT, params(), lease_s=30, extra_tokens=16)
    with pytest.raises(MigrationFailed, match="not running") as e:
        a.migrate("x", destination(b, reserved), "x~m1")
    assert not e.value.retryable
    b.release("x~m1", unpushed=True)
    assert b.stats().free_blocks == NUM_BLOCKS


def test_a_request_still_computing_its_context_is_not_moved(trio):
    """Its blocks do not hold its context yet (a prompt A computes itself, conditional
    disaggregation): the destination would decode on KV never computed. Refused before any
    WRITE, retryable (once it decodes it may move)."""
    _, _, a, b = trio
    a._stop.set()  # no step runs on A: the prompt stays uncomputed
    a._wake.set()
    a._loop.join(timeout=10)
    a.reserve("x", PROMPT, params(), lease_s=30)
    a.start_here("x")
    assert a.core.computing_context("x")
    reserved = b.reserve("x~m1", PROMPT, params(), lease_s=30, extra_tokens=16)
    with pytest.raises(MigrationFailed, match="still computing its context") as e:
        a.migrate("x", destination(b, reserved), "x~m1")
    assert e.value.retryable
    b.release("x~m1", unpushed=True)
    a.release("x")
    for w in (a, b):
        w.check_integrity()
        assert w.stats().free_blocks == NUM_BLOCKS


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s}s"
        time.sleep(0.01)


def parked_by_a_hog(prefill, a, rid: str) -> tuple[object, list[int]]:
    """`rid` decodes on A (24 blocks) until a reservation takes all but one free block:
    it preempts itself into A's host tier and stays parked -> its stream, what it sent."""
    stream = started(prefill, a, rid)
    sent = take(stream, 6)  # 63 tokens: 4 blocks
    a.reserve("hog", list(range(5, 5 + 19 * 16)), params(1), lease_s=60)  # 19 of 20 free
    wait_for(lambda: a.core.stats().parked == 1, "a park")
    while not stream.events.empty():  # what it sent before it was parked
        sent += take(stream, 1)
    return stream, sent


def test_a_request_parked_in_a_tier_moves_from_the_tier(trio, expected):
    """A's pool fills (a reservation holds all but one block): its request preempts itself
    and is parked in the host tier, where it stays (no room to come back). It moves to B in
    one round from the tier, B's blocks hold the parked bytes, and it finishes there with
    the colocated engine's tokens; A's tier and pool are empty afterwards."""
    model, prefill, _, b = trio
    a = decode_worker(
        model, f"s-{model}", "nixl", EngineArgs(block_size=16, num_kv_blocks=24, preemption="swap")
    )
    try:
        stream, sent = parked_by_a_hog(prefill, a, "r5")
        with a.lock:
            parked = a.core.kv.parked_blocks("r5")
            staged = a.migrator._staging(parked)
            assert a.core.kv.copy_parked("r5", staged)
        move = Move(a, b, "r5", "r5~m1", PROMPT, sent)
        moved = move.run()
        tail, reason = rest(stream)
        assert (tail, reason) == ([], "migrated")
        assert moved.rounds == 1
        assert moved.num_tokens == len(PROMPT) + len(sent)
        assert moved.nbytes == parked * a.endpoint.bytes_per_block
        bd = b.core.kv_block_dim
        for i, dst in enumerate(move.reserved.block_ids[:parked]):
            assert torch.equal(staged.select(bd, i), b.core.kv_pool.select(bd, dst)), i
        tokens, reason = rest(move.start(sent))
        assert (sent + tokens, reason) == (expected[model], "length")
        a.release("hog", unpushed=True)  # never pushed: its blocks come back at once
        for w in (a, b):
            w.check_integrity()
        assert a.stats().free_blocks == 24 and b.stats().free_blocks == NUM_BLOCKS
        assert a.core.kv.offload.stats().parked == 0
        assert a.core.stats().parked == 0
    finally:
        a.close()


class HeldOpen:
    """A posted WRITE that reports itself in flight until `ended` is set (then its own
    state): a transfer a failed move gave up on while the transport still reads it."""

    def __init__(self, xfer, ended: threading.Event) -> None:
        self.xfer, self.ended = xfer, ended

    def state(self):
        return self.xfer.state() if self.ended.is_set() else XferState.PENDING

    def release(self) -> None:
        self.xfer.release()


def test_a_parked_move_given_up_in_flight_keeps_its_staging_until_the_write_ends(
    trio, expected, monkeypatch
):
    """A parked request's move whose WRITE was posted but not seen done by the deadline
    fails; its staging buffer stays registered (the transport may still read it) exactly
    until that WRITE has ended, then goes: nothing kept for the worker's lifetime. The
    request goes on where it was and finishes with the colocated engine's tokens."""
    model, prefill, _, b = trio
    a = decode_worker(
        model, f"s-{model}", "nixl", EngineArgs(block_size=16, num_kv_blocks=24, preemption="swap")
    )
    ended = threading.Event()
    try:
        stream, sent = parked_by_a_hog(prefill, a, "r6")
        regions = dict(a.endpoint.agent._regions)
        with a.lock:
            staged_bytes = a.core.kv.parked_blocks("r6") * a.endpoint.bytes_per_block

        def late(self, deadline, poll_s):
            self._mine = [HeldOpen(x, ended) for x in self._mine]
            raise RoundFailed("the move was not done by its deadline", True)

        monkeypatch.setattr(Round, "wait", late)
        with pytest.raises(MigrationFailed) as failed:
            Move(a, b, "r6", "r6~m1", PROMPT, sent).run()
        monkeypatch.undo()
        assert failed.value.wrote
        kept = a.migrator.retiring
        assert len(kept) == 1 and kept.nbytes == staged_bytes
        assert len(a.endpoint.agent._regions) == len(regions) + 1  # still registered
        time.sleep(0.2)  # many sweeps by the step loop meanwhile: the WRITE is in flight
        assert len(kept) == 1
        assert a.metrics.staging_kept._value.get() == staged_bytes
        ended.set()
        gauge = a.metrics.staging_kept._value
        wait_for(lambda: len(kept) == 0 and gauge.get() == 0, "the staging buffer let go")
        assert a.endpoint.agent._regions == regions
        a.release("hog", unpushed=True)  # room: it comes back from the tier and finishes
        tokens, reason = rest(stream)
        assert (sent + tokens, reason) == (expected[model], "length")
        a.check_integrity()
        assert a.stats().free_blocks == 24 and a.core.kv.offload.stats().parked == 0
    finally:
        ended.set()
        a.close()


# -- tensor-parallel workers: each rank moves its own heads (their ranks are processes) -----
def kv_tokens(worker, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The KV of the first `num_tokens` tokens held in `block_ids`, every head of every rank
    side by side (MLA: every rank holds the whole latent, checked equal; rank 0's)."""
    core = worker.core
    ids = torch.tensor(block_ids)
    parts = [core.kv_pool.index_select(core.kv_block_dim, ids)]
    parts += [torch.from_numpy(b) for b in core.rank_call("blocks", block_ids)]
    if len(core.model_config.kv_token_shape) == 1:  # MLA's latent
        assert all(torch.equal(p, parts[0]) for p in parts[1:]), "ranks' latents differ"
        whole = parts[0]
    else:
        whole = torch.cat(parts, dim=-2)
    d = core.kv_block_dim
    return whole.flatten(d, d + 1).narrow(d, 0, num_tokens)


@pytest.fixture(scope="module")
def tp_workers():
    """One prefill worker and decode workers of TP 2, 2 and 1 per model, shared by the
    moves between them (each test ends with every block free)."""
    base = dict(block_size=16, num_kv_blocks=NUM_BLOCKS)
    made: dict[str, dict] = {}

    def of(model: str) -> dict:
        if model not in made:
            w = {"prefill": prefill_worker(model, f"p-tp-{model}", "nixl", EngineArgs(**base))}
            for name, tp in (("a2", 2), ("b2", 2), ("c1", 1)):
                args = EngineArgs(**base, tensor_parallel_size=tp)
                w[name] = decode_worker(model, f"{name}-tp-{model}", "nixl", args)
            made[model] = w
        return made[model]

    yield of
    for w in made.values():
        for worker in w.values():
            worker.close()


@pytest.mark.parametrize(
    "model,src,dst,first",
    [
        ("tiny-llama", "a2", "b2", 3),
        ("tiny-llama", "a2", "c1", 4),
        ("tiny-llama", "c1", "b2", 5),
        ("tiny-deepseek", "a2", "b2", 3),
    ],
)
def test_a_tensor_parallel_worker_moves_each_ranks_heads(model, src, dst, first, tp_workers):
    """Every rank of A writes its heads of the request's blocks into B's ranks (whole blocks
    between equal groups, runs of heads between unequal ones), in pre-copy rounds and a
    last one; B's ranks hold exactly A's KV for every moved token and finish the request
    with the colocated engine's tokens. Each case has its own prompt: a destination's
    freed blocks from an earlier case cannot hold the same KV."""
    w = tp_workers(model)
    prefill, a, b = w["prefill"], w[src], w[dst]
    prompt = list(range(first, first + len(PROMPT)))
    want_tokens = LLM(model, block_size=16).generate([prompt], params())[0].token_ids
    rid = f"t-{src}-{dst}"
    stream = started(prefill, a, rid, prompt)
    sent = take(stream, 6)
    move = Move(a, b, rid, f"{rid}~m1", prompt, sent, extra=128)  # room for a pre-copy round
    kept = snapshots(a)  # (rank 0's; the order of A's blocks is what is used here)
    try:
        moved = move.run()
    finally:
        del a.core.release  # the class's again
    more, reason = rest(stream)
    assert reason == "migrated"
    sent += more
    assert moved.rounds >= 2
    assert moved.num_tokens == len(prompt) + len(sent)
    with_kv = moved.num_tokens - 1  # the last token's KV is computed at the destination
    blocks = -(-with_kv // 16)
    assert moved.nbytes >= blocks * a.endpoint.bytes_per_block  # the last block twice
    # nothing runs on A any more: its freed blocks still hold what it moved
    want = kv_tokens(a, kept["order"][:blocks], with_kv)
    got = kv_tokens(b, move.reserved.block_ids[:blocks], with_kv)
    assert torch.equal(got, want)
    tokens, reason = rest(move.start(sent))
    assert (sent + tokens, reason) == (want_tokens, "length")
    for worker in (a, b):
        worker.check_integrity()
        assert worker.stats().free_blocks == NUM_BLOCKS


def test_a_parked_request_of_a_tensor_parallel_worker_moves_from_every_ranks_tier(expected):
    """A (TP=2) parks its request: each rank its own shard in its own host tier. Each rank
    stages its shard and writes it into B's (TP=2) ranks in one round; the request finishes
    on B with the colocated engine's tokens, and no tier of A keeps anything."""
    model = "tiny-llama"
    base = dict(block_size=16)
    prefill = prefill_worker(model, "p-tp-park", "nixl", EngineArgs(**base, num_kv_blocks=64))
    a = decode_worker(
        model,
        "s-tp-park",
        "nixl",
        EngineArgs(**base, num_kv_blocks=24, preemption="swap", tensor_parallel_size=2),
    )
    b = decode_worker(
        model, "b-tp-park", "nixl", EngineArgs(**base, num_kv_blocks=64, tensor_parallel_size=2)
    )
    offload = a.core.kv.offload
    park = offload.park
    parked_from: list[list[int]] = []

    def park_and_note(request_id, block_ids):
        parked_from.append(list(block_ids))
        return park(request_id, block_ids)

    offload.park = park_and_note
    try:
        stream, sent = parked_by_a_hog(prefill, a, "t5")
        parked = a.core.kv.parked_blocks("t5")
        move = Move(a, b, "t5", "t5~m1", PROMPT, sent)
        moved = move.run()
        assert rest(stream) == ([], "migrated")
        assert moved.rounds == 1
        assert moved.nbytes == parked * a.endpoint.bytes_per_block  # every rank's shard
        # the blocks it was parked from were never written since (the hog is never
        # pushed): every rank's KV there equals B's, token by token
        with_kv = moved.num_tokens - 1
        (source,) = parked_from
        want = kv_tokens(a, source[:parked], with_kv)
        assert torch.equal(kv_tokens(b, move.reserved.block_ids[:parked], with_kv), want)
        tokens, reason = rest(move.start(sent))
        assert (sent + tokens, reason) == (expected[model], "length")
        a.release("hog", unpushed=True)
        for w in (a, b):
            w.check_integrity()  # every rank's tier included (TP check)
        assert a.stats().free_blocks == 24 and b.stats().free_blocks == 64
        assert offload.stats().parked == 0
    finally:
        offload.park = park
        for w in (prefill, a, b):
            w.close()


def test_a_rank_that_lost_its_shard_of_a_parked_request_fails_the_move_and_it_is_recomputed(
    expected,
):
    """A (TP=2) parks its request, then rank 1's shard is lost (dropped there alone). The
    move fails (retryable) before a byte goes; every rank drops the request's KV, so the
    tiers stay all or none (the ranks' integrity check agrees); once room comes back it is
    computed again at A and ends with the colocated engine's tokens."""
    model = "tiny-llama"
    prefill = prefill_worker(model, "p-tp-lost", "nixl", EngineArgs(block_size=16))
    a = decode_worker(
        model,
        "s-tp-lost",
        "nixl",
        EngineArgs(block_size=16, num_kv_blocks=24, preemption="swap", tensor_parallel_size=2),
    )
    b = decode_worker(model, "b-tp-lost", "nixl", EngineArgs(block_size=16, num_kv_blocks=64))
    try:
        stream, sent = parked_by_a_hog(prefill, a, "t6")
        a.core.runner.group.send("drop_parked", "t6")  # rank 1's shard only
        move = Move(a, b, "t6", "t6~m1", PROMPT, sent)
        with pytest.raises(MigrationFailed, match="lost or corrupt") as e:
            move.run()
        assert e.value.retryable and not e.value.wrote
        b.release("t6~m1", unpushed=True)
        assert a.core.stats().parked == 0 and a.core.kv.offload.stats().parked == 0
        a.check_integrity()  # every rank: no parked entry of it anywhere
        a.release("hog", unpushed=True)  # room: it is computed again here
        tokens, reason = rest(stream)
        assert (sent + tokens, reason) == (expected[model], "length")
        for w in (a, b):
            w.check_integrity()
        assert a.stats().free_blocks == 24 and b.stats().free_blocks == 64
    finally:
        for w in (prefill, a, b):
            w.close()
