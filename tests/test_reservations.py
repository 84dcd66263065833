"""Reservations with fencing tokens and short, renewed leases (decode/reservations.py), on a
real engine core's 8-block pool: exact block counts and check_integrity() after each step."""

from __future__ import annotations

import pytest

from decode.config import DecodeConfig
from decode.state import DecodeState
from pdserve.engine.args import EngineArgs
from pdserve.engine.build import build_engine
from pdserve.sampling_params import SamplingParams
from transfer import notification, parse_notification, unposted_notification

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks of 16


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def books():
    core, _ = build_engine("tiny-llama", EngineArgs(block_size=16, num_kv_blocks=8))
    clock = Clock()
    state = DecodeState(core, DecodeConfig("d", admission="greedy"), clock)
    yield state, clock
    core.close()


def free(state: DecodeState) -> int:
    state.check_integrity()
    return state.stats().free_blocks


def test_notifications_name_their_reservation_and_token():
    assert parse_notification(notification("req-1", 7)) == ("req-1", 7, 0, 1, False)
    assert parse_notification(notification("a#b", 12)) == (
        "a#b",
        12,
        0,
        1,
        False,
    )  # the last '#' counts
    assert parse_notification(notification("a#b", 12, 2, 3)) == ("a#b", 12, 2, 3, False)
    assert notification("r", 5) == b"r#5"  # one part: the notification of wire version 3
    assert parse_notification(unposted_notification("a#b", 9)) == ("a#b", 9, 0, 1, True)
    for bad in (b"req-1", b"req-1#", b"req-1#x", b"#", b"", b"r#5#2/2", b"r#1/2", b"r#x#0/2"):
        assert parse_notification(bad) is None
    for bad in (b"none", b"#none", b"r#x#none", b"r#none"):
        assert parse_notification(bad) is None


def test_a_push_in_parts_arrives_with_its_last_part(books):
    """A tensor-parallel push is one WRITE stream per pair of ranks: the reservation has
    arrived when every part's notification has (a repeated part counts once)."""
    state, _ = books
    a = state.reserve("a", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.note_arrivals([notification("a", a.fence, 0, 3), notification("a", a.fence, 0, 3)])
    state.note_arrivals([notification("a", a.fence, 2, 3)])
    assert not state.reservations.arrived("a")
    state.check_integrity()
    state.note_arrivals([notification("a", a.fence, 1, 3)])
    assert state.reservations.arrived("a")
    state.check_integrity()


def test_a_fenced_push_in_parts_frees_its_blocks_after_the_last_part(books):
    state, _ = books
    before = free(state)
    a = state.reserve("a", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.note_arrivals([notification("a", a.fence, 0, 2)])
    state.release("a")  # one part may still land: fenced
    assert state.reservations.fenced == 1 and free(state) < before
    state.note_arrivals([notification("a", a.fence, 1, 2)])
    state.expire()
    assert state.reservations.fenced == 0 and free(state) == before


def test_only_the_reservations_own_token_counts_as_its_arrival(books):
    state, _ = books
    a = state.reserve("a", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    b = state.reserve("b", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    assert (a.fence, b.fence) == (1, 2) and free(state) == 2
    state.note_arrivals([notification("a", b.fence), notification("b", 99), b"a"])
    assert state.reservations.pending_arrivals == 0
    state.note_arrivals([notification("a", a.fence)])
    assert state.reservations.arrived("a") and not state.reservations.arrived("b")
    state.check_integrity()


def test_a_reservation_released_before_its_push_is_fenced_until_the_push_is_over(books):
    state, clock = books
    r = state.reserve("r", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    assert free(state) == 5
    assert state.release("r") == (True, None)
    assert free(state) == 5 and state.reservations.fenced == 1  # the push may still land
    state.expire()
    assert free(state) == 5
    # a new reservation of the same id gets a new token; the old push's note frees the fence
    again = state.reserve("r", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    assert again.fence == r.fence + 1 and free(state) == 2
    state.note_arrivals([notification("r", r.fence)])
    assert state.reservations.pending_arrivals == 0  # not the new one's arrival
    state.expire()
    assert free(state) == 5 and state.reservations.fenced == 0
    # with no note at all: fenced until the push window is over, then free
    assert state.release("r") == (True, None)
    assert free(state) == 5
    clock.t += 19.9
    state.expire()
    assert free(state) == 5
    clock.t += 0.2
    state.expire()
    assert free(state) == 8 and state.reservations.fenced == 0


def test_an_arrived_or_unpushed_reservation_frees_at_once(books):
    state, _ = books
    r = state.reserve("r", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.note_arrivals([notification("r", r.fence)])
    state.release("r")
    assert free(state) == 8
    state.reserve("s", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.release("s", unpushed=True)  # the prefill worker refused it before any WRITE
    assert free(state) == 8 and state.reservations.fenced == 0
    state.reserve("t", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.release("t")
    assert free(state) == 5 and state.reservations.fenced == 1
    assert state.release("t", unpushed=True) == (True, None)  # learnt later: no push came
    assert free(state) == 8 and state.reservations.fenced == 0


def test_a_nothing_posted_note_frees_its_reservation_at_its_end_whichever_comes_first(books):
    """A prefill worker that gave a prompt up before posting anything says so (a note
    alone): a reservation released before the note is fenced until it comes, one released
    after frees at once; the note never counts as an arrival, and one of another token
    (an earlier reservation of the same id) frees nothing."""
    state, _ = books
    a = state.reserve("a", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.release("a")  # the router gave it up: fenced, the push may still land
    assert free(state) == 5 and state.reservations.fenced == 1
    state.note_arrivals([unposted_notification("a", a.fence + 7)])  # not its token
    state.expire()
    assert free(state) == 5 and state.reservations.fenced == 1
    state.note_arrivals([unposted_notification("a", a.fence)])
    state.expire()
    assert free(state) == 8 and state.reservations.fenced == 0
    b = state.reserve("b", PROMPT, GREEDY, lease_s=5, push_window_s=20)
    state.note_arrivals([unposted_notification("b", b.fence)])  # before the release
    assert not state.reservations.arrived("b") and free(state) == 5
    state.release("b")
    assert free(state) == 8 and state.reservations.fenced == 0


def test_renewed_leases_live_and_an_abandoned_one_expires_into_its_fence(books):
    state, clock = books
    r = state.reserve("r", PROMPT, GREEDY, lease_s=3, push_window_s=10)
    for _ in range(4):  # renewed every second for 4 s: alive past its first 3 s
        clock.t += 1
        assert state.renew("r", r.fence, 3)
        state.expire()
        assert "r" in state.reservations
    assert not state.renew("r", r.fence + 1, 3)  # another reservation's token
    assert not state.renew("nope", r.fence, 3)
    assert state.renew("r", r.fence, 0.5)  # never shortens
    assert state.reservations.get("r").deadline == clock.t + 3  # from the last renewal
    clock.t += 3.1  # the router stopped renewing (it died)
    state.expire()
    assert "r" not in state.reservations and state.reservations.fenced == 1
    assert free(state) == 5
    clock.t = 100 + 10.01  # the push window from Reserve is over
    state.expire()
    assert free(state) == 8


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), 1e12])
def test_leases_and_windows_that_never_end_are_refused(books, bad):
    state, _ = books
    with pytest.raises(ValueError, match="lease_s"):
        state.reserve("r", PROMPT, GREEDY, lease_s=bad)
    with pytest.raises(ValueError, match="push_window_s"):
        state.reserve("r", PROMPT, GREEDY, lease_s=5, push_window_s=bad)
    r = state.reserve("r", PROMPT, GREEDY, lease_s=5)
    with pytest.raises(ValueError, match="lease_s"):
        state.renew("r", r.fence, bad)
    assert free(state) == 5


def test_the_heartbeat_projects_growth_whatever_the_admission_policy(books):
    """Greedy admission's headroom is the free blocks; the heartbeat also says how many
    blocks are left once every held request has grown by the output expected of it (before
    any request finished: its max_tokens), which the router's rebalancer reads."""
    state, _ = books
    state.reserve("short", PROMPT, GREEDY, lease_s=5, push_window_s=20)  # 44 tokens: 3 blocks
    stats = state.stats()
    assert (stats.free_blocks, stats.headroom_blocks, stats.projected_free_blocks) == (5, 5, 5)
    long = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    state.reserve("long", PROMPT, long, lease_s=5, push_window_s=20)  # 120 tokens: 8 blocks
    stats = state.stats()
    assert (stats.free_blocks, stats.headroom_blocks, stats.projected_free_blocks) == (2, 2, -3)
    state.check_integrity()


def test_a_worker_holds_at_most_max_requests_whatever_its_free_blocks():
    """Each held request streams on a thread of the worker's server (sized by it): a Reserve
    past max_requests is refused as one without room, with blocks to spare; once one ends,
    the next is taken. The default is max_num_seqs plus QUEUE_REQUESTS."""
    from decode.config import QUEUE_REQUESTS
    from decode.state import ReservationError

    core, _ = build_engine("tiny-llama", EngineArgs(block_size=16, num_kv_blocks=32))
    try:
        assert DecodeState(core, DecodeConfig("d")).max_requests == 256 + QUEUE_REQUESTS
        state = DecodeState(core, DecodeConfig("d", admission="greedy", max_requests=2))
        state.reserve("a", PROMPT, GREEDY, lease_s=5)
        state.reserve("b", PROMPT, GREEDY, lease_s=5)
        state.start("a", first_token=7)  # running now (41 tokens in its 3 blocks): held
        with pytest.raises(ReservationError, match="max_requests 2"):
            state.reserve("c", PROMPT, GREEDY, lease_s=5)
        assert free(state) == 32 - 2 * 3  # refused with 26 blocks free
        assert state.release("b", unpushed=True)[0]
        state.reserve("c", PROMPT, GREEDY, lease_s=5)
        assert free(state) == 32 - 2 * 3
    finally:
        core.close()
    with pytest.raises(ValueError, match="max_requests: must be >= 1"):
        DecodeConfig("d", max_requests=0)


def test_a_reserve_says_what_the_request_generated_before_and_it_counts(books):
    """A migration's Reserve carries the tokens its request generated elsewhere (its prompt
    ends with them, max_tokens is what it has left): the books show its output counted from
    its start, and a count that is not part of the prompt is refused by name."""
    state, _ = books
    state.reserve("moved", PROMPT, GREEDY, lease_s=30, generated=10)
    (held,) = [h for h in state.held() if h.request_id == "moved"]
    assert (held.tokens, held.generated, held.max_tokens) == (40, 10, 14)
    with pytest.raises(ValueError, match="generated_tokens"):
        state.reserve("bad", PROMPT, GREEDY, lease_s=30, generated=40)
    state.check_integrity()
