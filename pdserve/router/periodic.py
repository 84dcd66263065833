"""A daemon thread that calls a function every `period_s` seconds until closed (the
router's lease renewal and stream watch)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, period_s: float, tick: Callable[[], object]) -> None:
        self.period_s, self._tick = period_s, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the duty must outlive one bad round
                log.exception("%s: a round failed; the next one runs as usual", self._thread.name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + 1)
