"""A role's main thread waits for SIGINT/SIGTERM with pdserve.lifetime.StopSignal: its handler
takes no lock, so a signal that comes while the last one's handler runs (Python nests them
in the main thread) cannot block the stop. The handler we had, threading.Event.set(),
deadlocked there: a router and a decode worker outlived their SIGKILLed launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a signal every 200 µs for the child's whole life: handlers nest into each other's
# middles, and the main thread waits, is woken, and waits again meanwhile
STORM = r"""
import signal, time
{setup}
signal.setitimer(signal.ITIMER_REAL, 0.001, 2e-4)
assert {wait}(10), "never woken"
end = time.monotonic() + 0.3
while time.monotonic() < end:
    {wait}(0.001)
signal.setitimer(signal.ITIMER_REAL, 0)
print("stopped", flush=True)
"""
OURS = dict(
    setup="from pdserve.lifetime import StopSignal\nstop = StopSignal((signal.SIGALRM,))",
    wait="stop.wait",
)
# what the roles did before: under the storm a handler blocks on the Event's lock, which the
# handler it interrupted holds, the next signal nests another that blocks too, and so on
# until RecursionError: the check below fails on it, so it tells the two apart
EVENT = dict(
    setup="import threading\nstop = threading.Event()\n"
    "signal.signal(signal.SIGALRM, lambda *_: stop.set())",
    wait="stop.wait",
)


def stops(code: str, timeout_s: float = 20.0) -> bool:
    """Whether the child finished, printing "stopped", within `timeout_s`."""
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        out, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return False
    return child.returncode == 0 and "stopped" in out


def test_a_storm_of_nested_signals_never_blocks_the_stop():
    for _ in range(5):
        assert stops(STORM.format(**OURS))


def test_the_event_it_replaced_does_not_survive_the_same_storm():
    """The check above can fail: the same storm stops the old handler in most runs."""
    results = [stops(STORM.format(**EVENT), timeout_s=5) for _ in range(3)]
    if all(results):
        pytest.fail("the storm did not nest a handler into another's lock in 3 runs")


def test_a_signal_given_to_another_thread_still_ends_the_wait():
    """The kernel may give a process's SIGTERM to any thread: here a thread signals itself
    while the main thread waits with no timeout. Its poll is not interrupted; the byte
    CPython's handler writes to the wakeup pipe ends it."""
    code = (
        "import signal, threading, time\n"
        "from pdserve.lifetime import StopSignal\n"
        "stop = StopSignal()\n"
        "def strike():\n"
        "    time.sleep(0.3)\n"
        "    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)\n"
        "threading.Thread(target=strike).start()\n"
        "assert stop.wait()\n"
        "print('stopped', flush=True)\n"
    )
    assert stops(code)


def test_wait_times_out_without_a_signal_and_reports_one_that_came():
    import signal

    from pdserve.lifetime import StopSignal

    stop = StopSignal((signal.SIGUSR1,))
    try:
        assert stop.wait(0.05) is False
        signal.raise_signal(signal.SIGUSR1)
        assert stop.wait(5) is True
        assert stop.wait() is True  # stays asked for
    finally:
        stop.close()  # the handler and the wakeup fd as they were
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1  # none was set before, none is now
