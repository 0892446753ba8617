"""The staging memory of asynchronous transfers: one region, a ceiling, lent in pieces.

Saves captured but not yet stored, and loads being read, hold their bytes here. One
region allocated once (pinned for CUDA pools, registered once with a zero-copy backend)
and lent in pieces: allocating and pinning per transfer would cost more than the copy,
and a ceiling on one region is a ceiling on memory. The allocator is first-fit over a
sorted free list that merges neighbours on release; pieces are few (one per transfer in
flight), so a list is enough.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from kvconn.backend import Backend, tensor_bytes

log = logging.getLogger("kvconn")

#: Pieces start on this boundary, so pages in them can be read as the pool's words.
ALIGN = 64


@dataclass(frozen=True)
class Piece:
    """A lent range of the arena: a uint8 tensor and a byte view of the same memory."""

    offset: int
    size: int
    tensor: torch.Tensor
    view: memoryview


class Arena:
    """``capacity`` bytes of staging, lent in pieces until released."""

    def __init__(
        self,
        capacity: int,
        backend: Backend,
        *,
        pin: bool,
        guard: AbstractContextManager[object] | None = None,
    ) -> None:
        self.capacity = _round_up(capacity)
        self._backend = backend
        self._pin = pin
        self._guard: AbstractContextManager[object] = guard or contextlib.nullcontext()
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted
        self._lent = 0
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._registered = False
        self._closed = False

    @property
    def lent(self) -> int:
        """Bytes lent right now."""
        return self._lent

    def try_take(self, nbytes: int) -> Piece | None:
        """A piece of ``nbytes`` (rounded up), or ``None`` if none is free now."""
        with self._cond:
            return self._take_locked(nbytes)

    def take(self, nbytes: int, *, timeout: float | None = None) -> Piece | None:
        """A piece of ``nbytes``, waiting for one to be released; ``None`` on timeout or
        when the arena closes meanwhile. A request larger than the arena never fits."""
        if _round_up(nbytes) > self.capacity:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                piece = self._take_locked(nbytes)
                if piece is not None or self._closed:
                    return piece
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def give(self, piece: Piece) -> None:
        """Return a piece; its memory may be lent again at once."""
        with self._cond:
            self._lent -= piece.size
            start, size = piece.offset, piece.size
            i = bisect.bisect(self._free, (start, size))
            # merge with the free range after it, then with the one before it
            if i < len(self._free) and self._free[i][0] == start + size:
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
                start, prev = self._free[i - 1][0], self._free.pop(i - 1)[1]
                size += prev
                i -= 1
            self._free.insert(i, (start, size))
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter (it gets ``None``) and release the memory.

        Only when nothing lent is still in use: the transfer service closes it last.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._view is not None and self._registered:
            try:
                with self._guard:
                    self._backend.unregister_buffer(self._view)
            except Exception as exc:
                log.warning("kvconn: could not unregister staging memory: %s", exc)
            self._registered = False
        self._tensor = None
        self._view = None

    def _take_locked(self, nbytes: int) -> Piece | None:
        if self._closed:
            return None
        size = _round_up(max(1, nbytes))
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + size, free - size)
                self._lent += size
                tensor, view = self._memory()
                return Piece(start, size, tensor[start : start + size], view[start : start + size])
        return None

    def _memory(self) -> tuple[torch.Tensor, memoryview]:
        """The region, allocated (and registered) on first use."""
        if self._tensor is None:
            tensor = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self._pin)
            view = tensor_bytes(tensor)
            if self._backend.capabilities.buffer_registration:
                # Registration only speeds transfers up: a store that refuses it now
                # still serves unregistered buffers.
                try:
                    with self._guard:
                        self._backend.register_buffer(view)
                    self._registered = True
                except Exception as exc:
                    log.warning("kvconn: could not register staging memory: %s", exc)
            self._tensor, self._view = tensor, view
        assert self._view is not None
        return self._tensor, self._view


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
