"""Servers still running when the interpreter exits are stopped, whoever started them.

Shared by every managed server kind, so tests that crash before their ``finally`` leave
no redis-server or mooncake process behind.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable

_LIVE: dict[int, Callable[[], None]] = {}
_LOCK = threading.Lock()


def track(owner: object, stop: Callable[[], None]) -> None:
    """Remember how to stop ``owner`` at exit (idempotent)."""
    with _LOCK:
        _LIVE[id(owner)] = stop


def untrack(owner: object) -> None:
    with _LOCK:
        _LIVE.pop(id(owner), None)


def _stop_all_at_exit() -> None:
    with _LOCK:
        stops = list(_LIVE.values())
    for stop in stops:
        # Best effort: one failure must not keep the others running.
        with contextlib.suppress(Exception):
            stop()


atexit.register(_stop_all_at_exit)
