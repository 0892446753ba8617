"""Which memory Mooncake may move bytes to and from directly.

Mooncake's zero-copy calls (``batch_put_from`` / ``batch_get_into``) take raw
addresses, and over RDMA those must lie in memory registered with the transfer engine.
The connector registers its staging buffer once (:meth:`Backend.register_buffer`);
:class:`Registry` remembers those ranges so each put/get can tell, per buffer, whether
it may go straight to the store. Everything else (``bytes``, a caller's own
``bytearray``) goes through :class:`Scratch`, one registered area owned by the backend:
one extra ``memcpy``, but still the zero-copy transfer with per-key result codes, which
Mooncake's copying ``put_batch`` (one code for the whole batch) cannot give.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvconn.backend import buffer_address
from kvconn.errors import BackendError


def address_of(view: memoryview) -> int | None:
    """The address of a writable buffer's first byte; None for read-only memory.

    A read-only buffer (``bytes``) cannot be a registered range (the connector's staging
    is writable), so it needs no address: it is copied through the scratch area.
    """
    if view.readonly or view.nbytes == 0:
        return None
    return buffer_address(view)


@dataclass
class _Range:
    start: int
    end: int
    view: memoryview  # keeps the exporter alive while Mooncake may touch the memory
    mooncake: bool  # registered with the client (False: the client is not set up yet)


class Registry:
    """Registered, non-overlapping address ranges, looked up by binary search."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[_Range] = []
        #: Whether some range is not registered with the client: read on every call, so a
        #: flag kept by :meth:`mark` rather than a scan.
        self.any_failed = False

    def __len__(self) -> int:
        return len(self._ranges)

    def add(self, view: memoryview, start: int) -> _Range:
        end = start + view.nbytes
        i = bisect.bisect_right(self._starts, start)
        before = self._ranges[i - 1] if i > 0 else None
        after = self._ranges[i] if i < len(self._ranges) else None
        if (before is not None and before.end > start) or (after is not None and after.start < end):
            raise ValueError(
                f"buffer [{start:#x}, {end:#x}) overlaps a registered buffer; "
                "unregister that one first (Mooncake rejects overlapping regions)"
            )
        entry = _Range(start, end, view, mooncake=False)
        self._starts.insert(i, start)
        self._ranges.insert(i, entry)
        self.any_failed = True
        return entry

    def mark(self, entry: _Range, registered: bool) -> None:
        """Record whether the client accepted ``entry``."""
        entry.mooncake = registered
        self.any_failed = any(not r.mooncake for r in self._ranges)

    def remove(self, start: int) -> _Range | None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            del self._starts[i]
            entry = self._ranges.pop(i)
            self.any_failed = any(not r.mooncake for r in self._ranges)
            return entry
        return None

    def locate(self, views: Sequence[memoryview]) -> list[int | None]:
        """Per view, its address if it lies inside one range registered with Mooncake.

        One loop for the whole batch: this runs for every page of every put and get,
        and a batch is usually slices of one staging buffer, so the range the previous
        view fell in is tried before a binary search.
        """
        if not self._ranges:
            return [None] * len(views)
        starts, ranges = self._starts, self._ranges
        from_buffer, addressof = ctypes.c_char.from_buffer, ctypes.addressof
        out: list[int | None] = []
        last: _Range | None = None
        for view in views:
            if view.readonly or not view.nbytes:
                out.append(None)  # copied through scratch; see address_of
                continue
            start = addressof(from_buffer(view))
            if last is None or not last.start <= start < last.end:
                i = bisect.bisect_right(starts, start) - 1
                last = ranges[i] if i >= 0 else None
            if last is not None and last.mooncake and start + view.nbytes <= last.end:
                out.append(start)
            else:
                out.append(None)
        return out

    def entries(self) -> list[_Range]:
        return list(self._ranges)

    def failed(self) -> list[_Range]:
        """Ranges the client refused (or could not yet) register."""
        return [r for r in self._ranges if not r.mooncake]


class Scratch:
    """One page-aligned, registered area for buffers outside the registered ranges.

    It grows to the largest batch seen (capped per round by the caller) and is reused,
    because registering memory per call would cost more than the copy it saves.
    """

    def __init__(
        self,
        register: Callable[[int, int], bool],
        unregister: Callable[[int, int], None],
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.address = 0
        self.capacity = 0

    def take(self, nbytes: int) -> memoryview:
        """A registered view of at least ``nbytes``; raises BackendError if refused.

        A refused area is kept mapped while a second one is tried, so the second lands
        at another address (one that no stale registration covers).
        """
        if self._view is None or self.capacity < nbytes:
            self.release()
            size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            refused: list[mmap.mmap] = []
            try:
                for _ in range(2):
                    area = mmap.mmap(-1, size)
                    address = _map_address(area)
                    if self._register(address, size):
                        self._map, self.address, self.capacity = area, address, size
                        self._view = memoryview(area)
                        break
                    refused.append(area)
                else:
                    raise BackendError(
                        f"mooncake refused to register {size} bytes of scratch memory"
                    )
            finally:
                for area in refused:
                    area.close()
        assert self._view is not None
        return self._view

    def release(self) -> None:
        if self._view is None or self._map is None:
            return
        self._unregister(self.address, self.capacity)
        self._view.release()
        self._map.close()
        self._map = self._view = None
        self.address = self.capacity = 0


def _map_address(area: mmap.mmap) -> int:
    view = memoryview(area)
    try:
        return buffer_address(view)
    finally:
        view.release()
