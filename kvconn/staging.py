"""Host staging memory between the KV pool and the store.

One buffer, grown on demand and reused: allocating (and, for CUDA pools, pinning)
per request would cost more than the copy itself, and zero-copy backends need the
buffer registered once, not per call. Transfers running at the same time (an engine
that saves and loads from different threads) each borrow their own buffer from a
:class:`StagingPool`, so there are as many buffers as transfers ever ran at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

from kvconn.backend import Backend, tensor_bytes

log = logging.getLogger("kvconn")


class Staging:
    def __init__(
        self, backend: Backend, *, pin: bool, guard: AbstractContextManager[object] | None = None
    ) -> None:
        self._backend = backend
        self._pin = pin
        #: Held around (un)registration: the backend's lock when it is not thread-safe.
        self._guard: AbstractContextManager[object] = guard or contextlib.nullcontext()
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._registered = False

    def take(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A uint8 tensor of at least ``nbytes`` and a byte view of the same memory.

        Grows to the next power of two, so a slowly growing request size does not
        re-allocate (and re-register) on every call.
        """
        if self._tensor is None or self._tensor.numel() < nbytes:
            self.release()
            size = 1 << max(0, nbytes - 1).bit_length()
            tensor = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=self._pin)
            view = tensor_bytes(tensor)
            if self._backend.capabilities.buffer_registration:
                # Registration only speeds transfers up: a store that refuses it now
                # (down, out of registrations) still serves unregistered buffers.
                try:
                    with self._guard:
                        self._backend.register_buffer(view)
                    self._registered = True
                except Exception as exc:
                    log.warning("kvconn: could not register staging memory: %s", exc)
            self._tensor, self._view = tensor, view
        assert self._tensor is not None and self._view is not None
        return self._tensor, self._view

    def release(self) -> None:
        if self._view is not None and self._registered:
            try:
                with self._guard:
                    self._backend.unregister_buffer(self._view)
            except Exception as exc:
                log.warning("kvconn: could not unregister staging memory: %s", exc)
            finally:
                self._registered = False
        self._tensor = None
        self._view = None


class StagingPool:
    """Staging buffers lent one per transfer in flight and kept for the next one."""

    def __init__(
        self, backend: Backend, *, pin: bool, guard: AbstractContextManager[object] | None = None
    ) -> None:
        self._backend = backend
        self._pin = pin
        self._guard = guard
        self._lock = threading.Lock()
        self._idle: list[Staging] = []
        self._all: list[Staging] = []

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Staging]:
        with self._lock:
            if self._idle:
                staging = self._idle.pop()
            else:
                staging = Staging(self._backend, pin=self._pin, guard=self._guard)
                self._all.append(staging)
        try:
            yield staging
        finally:
            with self._lock:
                self._idle.append(staging)

    @property
    def buffers(self) -> int:
        """How many buffers exist: the most transfers that ever ran at once."""
        with self._lock:
            return len(self._all)

    def release(self) -> None:
        """Free every buffer; only when no transfer is running (close, new pools)."""
        with self._lock:
            for staging in self._all:
                staging.release()
            self._all.clear()
            self._idle.clear()
