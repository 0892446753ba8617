"""An in-memory store for testing the core's logic in isolation (never a backend proof)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvconn.backend import Backend, Capabilities
from kvconn.errors import BackendUnavailable


class DictBackend(Backend):
    name = "dict"
    capabilities = Capabilities(delete=True)

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False
        self.calls: list[tuple[str, int]] = []
        self.corrupt_sizes: set[str] = set()

    def _guard(self, op: str, n: int) -> None:
        self.calls.append((op, n))
        if self.down:
            raise BackendUnavailable("dict store is down")

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        self._guard("exists", len(keys))
        return [k in self.data for k in keys]

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        self._guard("put", len(keys))
        for k, v in zip(keys, values):
            self.data.setdefault(k, bytes(v))
        return [True] * len(keys)

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        self._guard("get", len(keys))
        out = []
        for k, b in zip(keys, buffers):
            v = self.data.get(k)
            if v is None or len(v) != b.nbytes:
                out.append(False)
            else:
                b[:] = v
                out.append(True)
        return out

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        return [self.data.pop(k, None) is not None for k in keys]

    def ops(self, op: str) -> int:
        return sum(1 for o, _ in self.calls if o == op)


class GatedBackend(DictBackend):
    """A dict store whose calls can be held at a gate: a stalled store, on demand.

    ``hold(op)`` makes every later ``op`` call wait until ``release(op)``; ``entered``
    counts calls that reached the gate, so a test can wait for a call to be in flight
    instead of sleeping.
    """

    capabilities = Capabilities(delete=True, thread_safe=True)

    def __init__(self) -> None:
        super().__init__()
        self._gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Semaphore] = {}

    def hold(self, op: str) -> None:
        self._gates[op] = threading.Event()
        self.entered[op] = threading.Semaphore(0)

    def release(self, op: str) -> None:
        gate = self._gates.pop(op, None)
        if gate is not None:
            gate.set()

    def wait_entered(self, op: str, timeout: float = 10.0) -> bool:
        return self.entered[op].acquire(timeout=timeout)

    def _guard(self, op: str, n: int) -> None:
        gate = self._gates.get(op)
        if gate is not None:
            self.entered[op].release()
            gate.wait(30)
        super()._guard(op, n)
