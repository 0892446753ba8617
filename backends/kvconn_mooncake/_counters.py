"""What each path of the backend did, counted from several threads at once.

``counters[name] += n`` is a read, an add and a write: two threads doing it at once can
both read the old count and one increment is lost (a thread may be switched out inside
``Counter.__missing__``, which is Python code; on a free-threaded build, anywhere). The
backend's calls run on several threads (``Capabilities.thread_safe``), so every
increment goes through :meth:`Counters.add` or :meth:`Counters.merge`, under a lock;
reading stays a plain ``Counter``'s.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["Counters"]


class Counters(Counter[str]):
    """``MooncakeBackend.counters``: a ``Counter`` whose increments are thread-safe."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()  # before super(): it may add through update()
        super().__init__(*args, **kwargs)

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more under ``name``."""
        with self._lock:
            self[name] += n

    def merge(self, tally: Mapping[str, int]) -> None:
        """Add a call's own tally at once: one lock for what a batch counted per key."""
        with self._lock:
            for name, n in tally.items():
                self[name] += n
