"""A bound on the transfer requests one client has in flight, all threads together.

Mooncake's TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
requests per peer (1024 by default), holds as many more for
``MC_TCP_ADMISSION_TIMEOUT_MS`` (1 s by default), and then rejects the rest ("TCP lane
queue-full" in its log). Each key of a ``batch_put_from`` or ``batch_get_into`` is one
request, whatever its size. Measured with 0.3.x over loopback (``docs/performance.md``,
"Batches longer than Mooncake's TCP queue"): one ``batch_put_from`` of 3,000 values of
16 KiB took 61 s and stored 58 of them, and a ``batch_get_into`` of as many failed with
``-800`` within a second. A long prompt with small pages (a 32k-token save of 16-token
blocks is 2,048 keys per page kind) gets there, as do the batches of several threads
that are each short enough.

So the backend cuts each call that moves bytes into slices of at most ``limit`` keys
and starts a slice only while the requests in flight, all threads together, stay
within ``limit``: a slice waits for others to finish instead of being rejected. The
limit is per client (its transfer engine has one queue per peer); keeping the total
under one peer's queue is stricter than needed when keys spread over several storage
processes, and costs a wait only when more than ``limit`` keys are moving at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class Flight:
    """Slices of calls that move bytes, so that at most ``limit`` keys move at once.

    ``limit=None`` bounds nothing: every call goes whole, at once.
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        self.limit = limit
        self._cond = threading.Condition()
        self._moving = 0  # keys in calls under way, all threads together

    @property
    def moving(self) -> int:
        """Keys in calls under way now (for tests and operators)."""
        with self._cond:
            return self._moving

    def run(self, call: Callable[..., Sequence[T]], *columns: Sequence[Any]) -> list[T]:
        """``call`` over ``columns`` (a value per key each) a slice at a time; the
        slices' answers joined in order (per key, for a call that answers per key).

        An exception from a slice propagates at once: the slices after it are not
        started, and the caller learns nothing of those before it, as for a call that
        raised whole.
        """
        n, limit = len(columns[0]), self.limit
        if limit is None or n == 0:
            return list(call(*columns))
        answers: list[T] = []
        for start in range(0, n, limit):
            stop = min(start + limit, n)
            self._take(stop - start, limit)
            try:
                answers += call(*(column[start:stop] for column in columns))
            finally:
                self._give(stop - start)
        return answers

    def _take(self, keys: int, limit: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._moving + keys <= limit)
            self._moving += keys

    def _give(self, keys: int) -> None:
        with self._cond:
            self._moving -= keys
            self._cond.notify_all()


def queue_limit(value: str | None, default: int = 1024, most: int = 65535) -> int:
    """The TCP queue's size as Mooncake reads ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
    from the environment: digits only, 1 to ``most``; anything else is the default."""
    if value is None or not value.isdigit() or not value.isascii():
        return default
    size = int(value)
    return size if 1 <= size <= most else default
