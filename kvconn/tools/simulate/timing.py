"""A backend wrapper that times the store, so ``kvconn simulate`` can split its own
planning time from the store's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from kvconn.backend import Backend, ReadStatus

T = TypeVar("T")


class TimedBackend(Backend):
    """Wraps a backend and counts the seconds spent inside it.

    ``first_call`` is the moment the first store call since :meth:`mark` began: the
    connector derives keys and owners before it asks the store anything, so the time
    from entering ``save``/``load``/``lookup`` to ``first_call`` is its planning time.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.seconds = 0.0  # wall-clock time inside the store
        self.cpu_seconds = 0.0  # CPU time of this thread inside the store
        self.calls = 0
        self.first_call: tuple[float, float] | None = None  # (wall, cpu)

    def mark(self) -> None:
        self.first_call = None

    def _timed(self, fn: Callable[[], T]) -> T:
        start, cpu = time.perf_counter(), time.thread_time()
        if self.first_call is None:
            self.first_call = (start, cpu)
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
            self.calls += 1

    # Whole public calls are timed and delegated, so the inner backend validates keys
    # once and that validation counts as store time, as it would in a real engine.
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._timed(lambda: self.inner.exists(keys))

    def put(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        return self._timed(lambda: self.inner.put(keys, values))

    def get(
        self, keys: Sequence[str], buffers: Sequence[Any], *, scratch: bool = False
    ) -> list[bool]:
        return self._timed(lambda: self.inner.get(keys, buffers, scratch=scratch))

    def read(
        self, keys: Sequence[str], buffers: Sequence[Any], *, scratch: bool = False
    ) -> list[ReadStatus]:
        return self._timed(lambda: self.inner.read(keys, buffers, scratch=scratch))

    @contextlib.contextmanager
    def borrow(self, keys: Sequence[str]) -> Iterator[list[memoryview | None]]:
        """Times the lending only: verifying and copying the lent bytes is the
        connector's work, done inside the block."""
        with contextlib.ExitStack() as stack:
            yield self._timed(lambda: stack.enter_context(self.inner.borrow(keys)))

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self._timed(lambda: self.inner.delete(keys))

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self.inner.list_keys(prefix)

    def check_access(self, key_prefix: str) -> None:
        self.inner.check_access(key_prefix)

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        return self.inner._exists(keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        return self.inner._put(keys, values)

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        return self.inner._get(keys, buffers, scratch=scratch)

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        return self.inner._read_status(keys, buffers, scratch=scratch)

    def register_buffer(self, buffer: memoryview) -> None:
        self.inner.register_buffer(buffer)

    def unregister_buffer(self, buffer: memoryview) -> None:
        self.inner.unregister_buffer(buffer)

    def close(self) -> None:
        self.inner.close()


def timed(inner: Backend) -> TimedBackend:
    """A :class:`TimedBackend` that declares the same capabilities as ``inner``.

    Capabilities are class attributes, so the wrapper class is made per backend class:
    the connector must see zero-copy registration exactly when the real store has it.
    """
    cls = type(
        f"Timed{type(inner).__name__}",
        (TimedBackend,),
        {
            "name": inner.name,
            "extra": inner.extra,
            "capabilities": inner.capabilities,
            "max_key_length": inner.max_key_length,
        },
    )
    return cast("type[TimedBackend]", cls)(inner)


def describe_location(backend: Backend) -> str:
    """Where the store lives, for the report header (a path for embedded stores)."""
    inner = backend.inner if isinstance(backend, TimedBackend) else backend
    path = getattr(inner, "path", None)
    return f"{inner.name} at {path}" if path is not None else inner.name
