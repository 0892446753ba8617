"""Host staging memory between the KV pool and the store.

One buffer, grown on demand and reused: allocating (and, for CUDA pools, pinning)
per request would cost more than the copy itself, and zero-copy backends need the
buffer registered once, not per call.
"""

from __future__ import annotations

import logging

import torch

from kvconn.backend import Backend, tensor_bytes

log = logging.getLogger("kvconn")


class Staging:
    def __init__(self, backend: Backend, *, pin: bool) -> None:
        self._backend = backend
        self._pin = pin
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
                self._backend.unregister_buffer(self._view)
            except Exception as exc:
                log.warning("kvconn: could not unregister staging memory: %s", exc)
            finally:
                self._registered = False
        self._tensor = None
        self._view = None
