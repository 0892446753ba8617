"""Repeated warnings, at most one an interval.

A stalled store makes the same thing go wrong on every request (a lookup served late
as a miss, a save unfinished within its deadline). One line an interval, carrying the
running count, says as much as thousands, and keeps the log of a long stall readable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: How often a repeated warning is logged by default: once a minute.
DEFAULT_INTERVAL_S = 60.0


class LogInterval:
    """Says whether a repeated warning is due: the first time, then once ``interval_s``
    has passed since the last one that was.

    Safe to share between threads: two threads asking at once get one ``True``.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s >= 0:  # also refuses NaN
            raise ValueError(f"LogInterval: interval_s must be >= 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None

    def due(self) -> bool:
        """Whether to log now; a ``True`` starts the next interval."""
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                return False
            self._last = now
            return True
