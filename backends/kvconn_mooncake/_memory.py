"""Which memory Mooncake may move bytes to and from directly.

Mooncake's zero-copy calls (``batch_put_from`` / ``batch_get_into``) take raw
addresses, and over RDMA those must lie in memory registered with the transfer engine.
The connector registers its staging buffer once (:meth:`Backend.register_buffer`);
:class:`Registry` remembers those ranges so each put/get can tell, per buffer, whether
it may go straight to the store. Everything else (``bytes``, a caller's own
``bytearray``) goes through :class:`Scratch`, one registered area owned by the backend:
one extra ``memcpy``, but still the zero-copy transfer with per-key result codes, which
Mooncake's copying ``put_batch`` (one code for the whole batch) cannot give.
:class:`Memory` keeps both registered with the client across its restarts and splits
each batch into :class:`Round` s that fit the scratch area.

Measured (``docs/notes/mooncake-api.md``): unregistering while the metadata server is
down fails yet leaves the range registered for good, wedging every later registration
that overlaps it (freed memory is soon reused). Unregistration is therefore deferred
until the metadata server answers (checked by a TCP probe), and refused registrations
are retried every few seconds; meanwhile that memory moves through the scratch area.

Threads (the backend is ``thread_safe``): the client's own methods may be called at once
from several threads, and release the GIL while they work. Here, two locks:
:attr:`Memory.lock` guards the registry, the deferred unregisters and the idle scratch
areas, and is held only to read or change them, never across a call to the client;
``Memory._registering`` puts (un)registrations one after another (each may be a round
trip to the metadata server), so a range is never registered and removed at once, and
close waits for one in progress. A transfer takes neither while its bytes move: each
scratch round borrows a scratch area of its own, so transfers through scratch memory
from several threads overlap instead of queueing for one area.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from kvconn.backend import buffer_address
from kvconn.errors import BackendError
from kvconn_mooncake import _codes as codes
from kvconn_mooncake._counters import Counters

log = logging.getLogger(__name__)

#: How often refused registrations and deferred unregisters are tried again.
RETRY_INTERVAL_S = 5.0


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


class Client(Protocol):
    """What :class:`Memory` reads of the client's session (:class:`~._session.Session`)."""

    #: The set-up client, None before set-up.
    store: Any
    #: The master stopped answering; its metadata server (usually the same process) may too.
    down: bool

    @property
    def closed(self) -> bool: ...

    def metadata_reachable(self) -> bool: ...


@dataclass
class Round:
    """One client call's share of a batch: item indices and where each item's bytes are."""

    items: list[int] = field(default_factory=list)
    direct: list[int] = field(default_factory=list)  # address, for registered memory
    offsets: list[int] = field(default_factory=list)  # scratch offset, or -1 when direct
    scratch: int = 0  # scratch bytes the round needs


class Memory:
    """The ranges registered with the client, scratch areas, and deferred unregisters.

    Ranges outlive clients: one registered before set-up, or refused, is registered
    when a client is attached (:meth:`attach`) or at the next :meth:`mend`. There are as
    many scratch areas as rounds that ever went through scratch memory at once, each
    up to ``scratch_bytes`` (or one value, if larger), kept for the next round.
    """

    def __init__(self, client: Client, counters: Counters, scratch_bytes: int) -> None:
        #: Guards the registry, ``stale`` and the scratch areas; held briefly, never
        #: across a call to the client.
        self.lock = threading.Lock()
        #: One (un)registration at a time (see the module docstring); taken before
        #: ``lock`` when both are needed, never the other way round.
        self._registering = threading.Lock()
        self.registry = Registry()
        #: Ranges to unregister once the metadata server answers (start -> end), see
        #: :meth:`unregister_range`.
        self.stale: dict[int, int] = {}
        self._client = client
        self._counters = counters
        self._scratch_bytes = scratch_bytes
        self._retry_at = 0.0
        self._scratch_idle: list[Scratch] = []
        self._scratch_all: list[Scratch] = []

    # ------------------------------------------------------------------ ranges
    def add(self, view: memoryview) -> None:
        """Remember ``view`` and register it if a client is set up (else at set-up)."""
        start = address_of(view)
        assert start is not None
        with self._registering:
            with self.lock:
                entry = self.registry.add(view, start)
            store = self._open_store()
            if store is not None:
                self._register_entry(store, entry)

    def remove(self, view: memoryview) -> None:
        start = address_of(view)
        assert start is not None
        with self._registering:
            with self.lock:
                entry = self.registry.remove(start)
            if entry is not None and entry.mooncake:
                self.unregister_range(start, entry.end - start)

    def attach(self, store: Any) -> None:
        """Register every remembered range with a newly set-up client."""
        with self._registering:
            with self.lock:
                entries = self.registry.entries()
            for entry in entries:
                self._register_entry(store, entry)

    def forget(self) -> None:
        """Drop every range and scratch area: closing the client unregisters them.

        Waits for a registration in progress, so the client is not closed under it.
        """
        with self._registering:
            with self.lock:
                scratches, self._scratch_all, self._scratch_idle = self._scratch_all, [], []
                for entry in self.registry.entries():
                    self.registry.remove(entry.start)
                self.stale.clear()
            for scratch in scratches:
                scratch.release()

    def mend(self, store: Any) -> None:
        """Finish deferred unregisters and retry refused registrations (every few s).

        Runs at the start of a call; a thread that finds another already at it, or a
        registration in progress, goes on with its call instead of waiting.
        """
        now = time.monotonic()
        if now < self._retry_at or not self._registering.acquire(blocking=False):
            return
        try:
            if now < self._retry_at:  # another thread mended meanwhile
                return
            self._retry_at = now + RETRY_INTERVAL_S
            self._drop_stale(store)
            with self.lock:
                failed = self.registry.failed()
            for entry in failed:
                self._register_entry(store, entry)
        finally:
            self._registering.release()

    def _open_store(self) -> Any:
        """The set-up client, or None before set-up and once closing began."""
        client = self._client
        return None if client.closed else client.store

    def _register_entry(self, store: Any, entry: _Range) -> None:
        registered = self._register_with(store, entry.start, entry.end - entry.start)
        with self.lock:
            self.registry.mark(entry, registered)

    def _register_with(self, store: Any, start: int, nbytes: int) -> bool:
        """Register with the client, first dropping stale ranges the new one overlaps."""
        self._drop_stale(store, start, start + nbytes)
        try:
            code = store.register_buffer(start, nbytes)
        except Exception as exc:
            code = codes.INTERNAL_ERROR
            log.debug("register_buffer raised %r", exc)
        if code != 0:
            self._counters.add("register_refused")
            log.warning(
                "kvconn: mooncake refused to register %d bytes at %#x (%s); transfers from "
                "that memory are copied through scratch memory until it accepts",
                nbytes,
                start,
                codes.describe(code),
            )
        return bool(code == 0)

    def _register_range(self, start: int, nbytes: int) -> bool:
        store = self._open_store()
        return store is not None and self._register_with(store, start, nbytes)

    def unregister_range(self, start: int, nbytes: int) -> None:
        """Unregister now, or remember the range to unregister when that is safe.

        Measured: an ``unregister_buffer`` while the metadata server is unreachable
        fails (``-600``) yet leaves the range registered inside the transfer engine for
        good, and every later registration that overlaps it fails too. Freed memory is
        soon reused (the connector's next staging buffer, our scratch area), so that
        would end zero-copy for the life of the process. A range whose memory is gone
        but which is still registered is harmless as long as nothing transfers from it,
        so unregistering is deferred until the metadata server answers.
        """
        client = self._client
        store = client.store
        if store is None or client.closed:
            return  # closing the client drops every registration at once
        if client.down or not client.metadata_reachable():
            with self.lock:
                self.stale[start] = start + nbytes
            return
        try:
            code = store.unregister_buffer(start)
        except Exception as exc:
            code = codes.INTERNAL_ERROR
            log.debug("unregister_buffer raised %r", exc)
        if code != 0:
            with self.lock:
                self.stale[start] = start + nbytes
            log.warning(
                "kvconn: mooncake could not unregister %d bytes at %#x (%s)",
                nbytes,
                start,
                codes.describe(code),
            )

    def _drop_stale(self, store: Any, start: int = 0, end: int = 1 << 64) -> None:
        """Unregister deferred ranges overlapping ``[start, end)`` if now possible."""
        with self.lock:
            overlapping = [s for s, e in self.stale.items() if s < end and start < e]
        if not overlapping or not self._client.metadata_reachable():
            return
        for stale in overlapping:
            try:
                code = store.unregister_buffer(stale)
            except Exception:
                code = codes.INTERNAL_ERROR
            if code == 0:
                with self.lock:
                    self.stale.pop(stale, None)

    # ------------------------------------------------------------------ batches
    def plan(self, views: Sequence[memoryview]) -> list[Round]:
        """Split transfers into rounds that each fit the scratch area.

        A view inside a registered range moves by its own address (zero copy); any other
        takes room in the scratch area, at most ``scratch_bytes`` per round (a larger
        single view gets a round of its own).
        """
        with self.lock:
            located = self.registry.locate(views)
        if views and None not in located:  # all in registered memory: the connector's case
            n = len(views)
            return [Round(list(range(n)), cast("list[int]", located), [-1] * n)]
        rounds: list[Round] = []
        current = Round()
        for i, (view, address) in enumerate(zip(views, located)):
            need = 0 if address is not None else view.nbytes
            if current.items and need and current.scratch + need > self._scratch_bytes:
                rounds.append(current)
                current = Round()
            current.items.append(i)
            if address is None:
                current.offsets.append(current.scratch)
                current.scratch += need
                current.direct.append(0)
            else:
                current.offsets.append(-1)
                current.direct.append(address)
        if current.items:
            rounds.append(current)
        return rounds

    @contextlib.contextmanager
    def addresses(self, round_: Round) -> Iterator[tuple[list[int], memoryview | None]]:
        """The round's addresses, and a scratch area of its own when the round uses one."""
        if not round_.scratch:
            yield round_.direct, None
            return
        scratch = self._borrow_scratch(round_.scratch)
        try:
            growing = scratch.capacity < round_.scratch
            with self._registering if growing else contextlib.nullcontext():
                area = scratch.take(round_.scratch)
            base = scratch.address
            addresses = [
                base + offset if offset >= 0 else address
                for offset, address in zip(round_.offsets, round_.direct)
            ]
            yield addresses, area
        finally:
            with self.lock:
                if scratch in self._scratch_all:  # not dropped by forget() meanwhile
                    self._scratch_idle.append(scratch)

    def _borrow_scratch(self, nbytes: int) -> Scratch:
        """The smallest idle area that fits, else the largest idle one, else a new one."""
        with self.lock:
            idle = self._scratch_idle
            if idle:
                fitting = [s for s in idle if s.capacity >= nbytes]
                if fitting:
                    pick = min(fitting, key=lambda s: s.capacity)
                else:
                    pick = max(idle, key=lambda s: s.capacity)  # grown, it replaces one
                idle.remove(pick)
                return pick
            scratch = Scratch(self._register_range, self.unregister_range)
            self._scratch_all.append(scratch)
            return scratch
