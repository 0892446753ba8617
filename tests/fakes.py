"""An in-memory store for testing the core's logic in isolation (never a backend proof)."""

from __future__ import annotations

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
