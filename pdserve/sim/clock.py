"""Virtual time for one simulated process (an engine replica, a prefill or decode worker).

Work done while a step is being scheduled (a spill, a reload) is charged to the clock and
added to that step's duration, as it is in the real engine, where it happens inside the
step."""

from __future__ import annotations


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._charged = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, seconds: float) -> None:
        self._charged += seconds

    def elapsed(self) -> float:
        """Now plus what is charged to the step being scheduled (what a timer would read)."""
        return self.now + self._charged

    def take_charges(self) -> float:
        charged, self._charged = self._charged, 0.0
        return charged
