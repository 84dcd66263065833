"""The router's line of requests waiting for decode room (pdserve/router/line.py): only
the head asks, in arrival order, a resumed request first, and a kick wakes the head."""

from __future__ import annotations

import threading
import time

from pdserve.router.line import ReserveLine


def test_everyone_asks_until_someone_is_refused():
    line = ReserveLine()
    a, b = line.join(), line.join()
    assert line.wait_turn(a, 0) and line.wait_turn(b, 0)  # open: a burst asks at once
    line.refused()
    assert line.wait_turn(a, 0) and not line.wait_turn(b, 0)  # closed: the head only
    c = line.join()
    assert not line.wait_turn(c, 0)  # a newcomer waits behind them
    for t in (a, b, c):
        line.leave(t)
    d, e = line.join(), line.join()  # it was empty: open again
    assert line.wait_turn(d, 0) and line.wait_turn(e, 0)


def test_only_the_head_has_its_turn_in_arrival_order():
    line = ReserveLine()
    a, b, c = line.join(), line.join(), line.join()
    line.refused()
    assert len(line) == 3
    assert line.wait_turn(a, 0)
    assert not line.wait_turn(b, 0)
    assert not line.wait_turn(c, 0)
    line.leave(a)
    assert line.wait_turn(b, 0) and not line.wait_turn(c, 0)
    line.leave(c)  # one behind the head gives up: the head is unchanged
    assert line.wait_turn(b, 0)
    line.leave(b)
    assert len(line) == 0 and line.head() is None
    line.leave(b)  # leaving twice is harmless


def test_resumed_requests_go_ahead_of_new_ones_in_their_own_order():
    line = ReserveLine()
    a = line.join()
    line.refused()
    first, second = line.join(front=True), line.join(front=True)  # a dead worker's two
    b = line.join()
    order = []
    while line.head() is not None:
        order.append(line.head())
        line.leave(order[-1])
    assert order == [first, second, a, b]


def test_waiting_for_the_turn_ends_when_the_head_leaves():
    line = ReserveLine()
    a, b = line.join(), line.join()
    line.refused()
    got = []
    waiter = threading.Thread(target=lambda: got.append(line.wait_turn(b, 30.0)))
    waiter.start()
    time.sleep(0.05)  # let it block (the outcome does not depend on it)
    line.leave(a)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and got == [True]


def test_wait_turn_gives_up_after_its_timeout():
    line = ReserveLine()
    line.join()
    b = line.join()
    line.refused()
    t0 = time.monotonic()
    assert not line.wait_turn(b, 0.05)
    assert 0.04 <= time.monotonic() - t0 < 5


def test_a_kick_after_asking_wakes_the_head_at_once():
    line = ReserveLine()
    a = line.join()
    line.asking(a)
    line.kick()  # room came back while its Reserve was refused: ask again now
    t0 = time.monotonic()
    assert line.wait_room(a, 30.0)
    assert time.monotonic() - t0 < 5
    line.asking(a)
    t0 = time.monotonic()
    assert not line.wait_room(a, 0.05)  # no kick since it asked: the pause runs out
    assert time.monotonic() - t0 >= 0.04


def test_a_kick_from_another_thread_ends_the_pause():
    line = ReserveLine()
    a = line.join()
    line.asking(a)
    got = []
    waiter = threading.Thread(target=lambda: got.append(line.wait_room(a, 30.0)))
    waiter.start()
    time.sleep(0.05)
    line.kick()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and got == [True]
