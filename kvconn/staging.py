"""Host staging memory between the KV pool and the store.

One buffer, grown on demand and reused: allocating (and, for CUDA pools, pinning)
per request would cost more than the copy itself, and zero-copy backends need the
buffer registered once, not per call.
"""

from __future__ import annotations

import torch

from kvconn.backend import Backend, tensor_bytes


class Staging:
    def __init__(self, backend: Backend, *, pin: bool) -> None:
        self._backend = backend
        self._pin = pin
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._registered = False

    def take(self, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A uint8 tensor of at least ``nbytes`` and a byte view of the same memory."""
        if self._tensor is None or self._tensor.numel() < nbytes:
            self.release()
            tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self._pin)
            view = tensor_bytes(tensor)
            if self._backend.capabilities.buffer_registration:
                self._backend.register_buffer(view)
                self._registered = True
            self._tensor, self._view = tensor, view
        assert self._view is not None
        return self._tensor, self._view

    def release(self) -> None:
        if self._view is not None and self._registered:
            try:
                self._backend.unregister_buffer(self._view)
            finally:
                self._registered = False
        self._tensor = None
        self._view = None
