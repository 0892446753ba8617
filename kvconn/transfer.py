"""Asynchronous loads and saves: the engine hands transfers over and never waits on a store.

Every engine adapter uses this one service (vLLM, SGLang, TensorRT-LLM). The engine's
thread submits a load or a batch of saves and gets a :class:`Transfer` handle back at
once; background threads talk to the store; finished handles are polled with
:meth:`TransferService.finished` or waited for, and carry per-block outcomes (loaded,
failed, written, skipped, dropped).

Saves are *captured* when submitted: their pages are gathered out of the pool into
staging on the submitting thread (on a CUDA pool, queued on a side stream, so the
thread does not wait; see :meth:`TransferService.order_reuse`). From then on the
engine may reuse or free the blocks: the bytes are in staging. A store thread then
takes every save captured so far and stores them with one ``exists`` and one ``put``
(:meth:`kvconn.connector.Connector.store_captured`), so a step's saves cost the store
two round trips, not two per request.

Loads run on load threads: read into staging, verify, scatter into the slots. A load
not finished ``load_timeout_s`` after it was submitted is cancelled: its handle reports
the blocks scattered so far as loaded and the rest failed, and no byte of it reaches a
slot afterwards (the scatter and the cancel exclude each other).

Over a TP group (a connector built with ``group=``, see :mod:`kvconn.striped_load`) a
load is collective: its ranks read each shared page once and exchange it. Collectives
must be issued in the same order on every rank, so such a service runs its loads on one
thread, in the order they were submitted, and an engine must submit the same loads in
the same order on every rank (engines do: the scheduler's metadata, broadcast to every
worker, names them). A load that is cancelled, finds no staging before its deadline, or
is still queued at :meth:`TransferService.close` still takes part in its first
collective, having read nothing, so the other ranks fail it too instead of waiting.

Memory is bounded: staging of transfers in flight lives in one :class:`~kvconn.arena.Arena`
of ``inflight_bytes``. A save that finds no room is dropped and counted (a cache may skip
a save); a load waits for room. A backend that fails or stalls yields failed or dropped
blocks and back-off (:mod:`kvconn.calls`), never an exception on the engine's thread.

Where the threads run: on :attr:`TransferService.cpus` when set (a core the engine keeps
for KV transfers), so a save or a load does not take the core a forward pass runs on. A
load submitted while the engine has nothing else to run (``load_many(..., idle=True)``)
runs on the submitting thread's own cores instead: the next forward pass there reads the
bytes it scatters, and on a CPU it read them slower when another core wrote them (in
vLLM at TP=1 on two CPUs, the fresh hit's forward pass took 662 against 594 ms, medians
of five rounds; docs/performance.md, "Loads on the step's core while it idles"), while
that core has nothing else to do until the load is done. Loads submitted beside other
work, and every save, stay on :attr:`cpus`. So does every load where the configuration
names the CPUs (``transfer_cpus = "6-7"``: the user's placement is kept), and every load
over a backend whose client moves bytes on I/O threads of its own
(``Capabilities.io_threads``: Mooncake's transfer engine, whose threads run on the
step's core): there the load thread took turns with them, and the hit came 1.18x
MooncakeStoreConnector's, against 0.86-0.93x with the load on the kept core
(docs/performance.md, "Idle loads over Mooncake back on the kept core").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvconn.arena import Arena, Piece
from kvconn.connector import CapturedPages, Connector
from kvconn.cpus import AUTO, placement
from kvconn.errors import ConnectorClosed
from kvconn.gate import ScatterGate
from kvconn.lograte import LogInterval
from kvconn.plan import WriterPolicy
from kvconn.replica_check import Probe
from kvconn.results import LoadResult, Outcome, SaveResult
from kvconn.slots import SlotMap, Slots

log = logging.getLogger("kvconn")

__all__ = ["LoadRequest", "SaveRequest", "Transfer", "TransferService"]

Result = LoadResult | SaveResult

#: Which outcome of a block wins when parts of one save disagree.
_RANK = {Outcome.DROPPED: 2, Outcome.WRITTEN: 1, Outcome.SKIPPED: 0}


@dataclass(frozen=True)
class SaveRequest:
    """One save of a batch handed over together (:meth:`TransferService.save_many`)."""

    block_hashes: Sequence[bytes]
    slots: Slots
    tag: Hashable = None
    writer_policy: WriterPolicy | str | None = None


@dataclass(frozen=True)
class LoadRequest:
    """One load of a batch handed over together (:meth:`TransferService.load_many`)."""

    block_hashes: Sequence[bytes]
    slots: Slots
    tag: Hashable = None


class Transfer:
    """A handle on one submitted load or save."""

    def __init__(self, kind: Literal["load", "save"], tag: Hashable, blocks: int) -> None:
        self.kind = kind
        self.tag = tag
        self.blocks = blocks
        self.submitted = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._result: Result | None = None
        self._on_done: Callable[[Transfer], None] | None = None
        # saves: parts still being stored, and what the finished ones reported
        self._parts = 0
        self._captures: list[CapturedPages] = []
        self._partial: SaveResult | None = None
        # loads: held while bytes reach the slots, shut when the engine gives up on it
        self._gate = ScatterGate(self._lock)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"Transfer({self.kind}, tag={self.tag!r}, blocks={self.blocks}, {state})"

    def done(self) -> bool:
        return self._done.is_set()

    def captured(self) -> bool:
        """Whether the engine's blocks are no longer needed: a save's pages are all in
        staging (on a CUDA pool, once the side-stream copies have run), or it was dropped.
        A load needs its slots until it is :meth:`done`."""
        if self.kind == "load":
            return self.done()
        return all(c.captured() for c in self._captures)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until finished; whether it has."""
        return self._done.wait(timeout)

    @property
    def result(self) -> Result:
        """The finished transfer's result; an error to ask before :meth:`done`."""
        if self._result is None:
            raise RuntimeError(f"{self!r} has not finished")
        return self._result

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return self.result.blocks

    def cancel(self) -> bool:
        """Give up on a load: it finishes now, with the blocks scattered so far loaded
        and the rest failed, and nothing more reaches its slots. ``False`` if it had
        finished already (or is a save, which cannot be called back once captured)."""
        if self.kind != "load":
            return False
        with self._lock:
            if self._result is not None:
                return False
            loaded = self._gate.close()
        self._finish(LoadResult(loaded, tuple(range(loaded, self.blocks))))
        return True

    # ------------------------------------------------------------------ service side
    def _finish(self, result: Result) -> bool:
        with self._lock:
            if self._result is not None:
                return False
            self._result = result
        # Recorded as finished before waiters wake: one that waits, then asks the
        # service what finished, finds this transfer there.
        if self._on_done is not None:
            self._on_done(self)
        self._done.set()
        return True

    def _part_stored(self, result: SaveResult) -> None:
        with self._lock:
            if self._result is not None:
                return  # given up already (the service closed): reported once
            merged = result if self._partial is None else _merge(self._partial, result)
            self._partial = merged
            self._parts -= 1
            last = self._parts == 0
        if last:
            self._finish(merged)


@dataclass
class _StoreJob:
    transfer: Transfer
    captured: CapturedPages
    piece: Piece


@dataclass
class _LoadJob:
    transfer: Transfer
    hashes: list[bytes]
    slots: SlotMap
    cpus: frozenset[int] | None = None  # where it runs; None: on TransferService.cpus


@dataclass
class _CheckJob:
    """A replica check (kvconn.replica_check): collective, so it waits in the load queue,
    in submission order with the loads."""

    probe: Probe


@dataclass
class _Queues:
    store: collections.deque[_StoreJob] = field(default_factory=collections.deque)
    load: collections.deque[_LoadJob | _CheckJob] = field(default_factory=collections.deque)


class TransferService:
    """Background loads and saves over one connector (module docstring)."""

    def __init__(
        self,
        connector: Connector,
        *,
        load_threads: int = 2,
        inflight_bytes: int | None = None,
        cpus: Collection[int] | None = None,
    ) -> None:
        """``load_threads`` is ignored over a TP group: its loads run on one thread, in
        submission order (module docstring).

        ``cpus``: the engine adapter's suggestion of CPUs for the transfer threads,
        taken when the configuration's ``transfer_cpus`` is ``"auto"``; ``"inherit"``
        ignores it and a CPU list replaces it (:mod:`kvconn.cpus`). None: the threads
        run where the thread that starts them runs, which in an engine that binds its
        compute threads to cores is the step's own core. An engine that keeps cores for
        KV transfers (vLLM's CPU backend) suggests them, so that a load or a save does
        not take the core the forward pass is running on. A set the system refuses is
        logged and ignored.
        """
        if load_threads < 1:
            raise ValueError(f"load_threads must be >= 1, got {load_threads}")
        setting = connector.config.transfer_cpus
        cpus = placement(setting, cpus, os.cpu_count())
        if setting != AUTO:
            log.info(
                "kvconn: transfer threads %s (transfer_cpus = %r)",
                "where they start" if cpus is None else f"on CPUs {sorted(cpus)}",
                setting,
            )
        if cpus is not None:
            cpus = frozenset(cpus)
            if not cpus or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus
            ):
                raise ValueError(
                    f"cpus must be a non-empty set of CPU numbers, got {sorted(cpus, key=repr)}"
                )
        #: The CPUs the transfer threads are asked to run on (None: inherited).
        self.cpus: frozenset[int] | None = cpus
        # whether an idle step's loads go to the submitter's cores (load_many): only to
        # cores the engine suggested, a CPU list the user names is kept for every load
        self._idle_moves = (
            setting == AUTO and cpus is not None and not connector.backend.capabilities.io_threads
        )
        #: Loads run one at a time in submission order (a connector over a TP group).
        self.ordered = connector.group is not None
        if self.ordered:
            load_threads = 1
        self.connector = connector
        config = connector.config
        capacity = config.inflight_bytes if inflight_bytes is None else inflight_bytes
        self.arena = Arena(
            capacity,
            connector.backend,
            pin=connector.device.type == "cuda",
            guard=connector.calls.guard,
        )
        self.load_timeout_s = config.load_timeout_s
        self._load_threads = load_threads
        self._cond = threading.Condition()
        self._queues = _Queues()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._finished: collections.deque[Transfer] = collections.deque()
        self._storing: list[_StoreJob] = []  # the batch the store thread is storing
        self._open: dict[int, Transfer] = {}  # submitted and not finished, by id
        self._side: Any = None  # the CUDA stream captures are queued on
        #: Saves dropped because in-flight staging was at its ceiling.
        self.saves_refused = 0
        self._late_log = LogInterval()  # late loads: one warning an interval

    # ------------------------------------------------------------------ submit
    def save(
        self,
        block_hashes: Sequence[bytes],
        slots: Slots,
        *,
        tag: Hashable = None,
        writer_policy: WriterPolicy | str | None = None,
    ) -> Transfer:
        """Capture these blocks' pages now and store them in the background."""
        return self.save_many([SaveRequest(block_hashes, slots, tag, writer_policy)])[0]

    def save_many(self, requests: Sequence[SaveRequest]) -> list[Transfer]:
        """Capture several saves (a step's) and hand them to the store thread together,
        so they reach the store as one ``exists`` and one ``put``.

        Arguments are checked first, for every request, before anything is captured:
        a bad one raises ``ArgumentError`` here, on the caller's thread.
        """
        self._check_open()
        conn = self.connector
        checked = [conn.check_transfer(r.block_hashes, r.slots) for r in requests]
        transfers: list[Transfer] = []
        jobs: list[_StoreJob] = []
        checks: list[_CheckJob] = []
        with self._capture_stream():
            for request, (hashes, slots) in zip(requests, checked):
                probes = conn.replica_probes(hashes, slots, request.writer_policy)
                checks.extend(_CheckJob(probe) for probe in probes)
                transfer = Transfer("save", request.tag, len(hashes))
                transfer._on_done = self._record
                transfers.append(transfer)
                pages = conn.owned_pages(hashes, slots, request.writer_policy)
                parts = list(conn.split_pages(pages))
                if not parts:
                    transfer._finish(SaveResult(blocks=(Outcome.SKIPPED,) * len(hashes)))
                    continue
                transfer._parts = len(parts)
                with self._cond:
                    self._open[id(transfer)] = transfer
                for part in parts:
                    piece = self.arena.try_take(conn.capture_bytes(part))
                    if piece is None:
                        self.saves_refused += 1
                        conn.stats.bump("staging_full")
                        transfer._part_stored(conn.drop(len(hashes), part))
                        continue
                    captured = conn.capture(hashes, slots, part, piece.tensor, piece.view)
                    transfer._captures.append(captured)
                    jobs.append(_StoreJob(transfer, captured, piece))
        if jobs or checks:
            with self._cond:
                self._queues.store.extend(jobs)
                self._queues.load.extend(checks)
                self._start_threads()
                self._cond.notify_all()
        return transfers

    def load(
        self, block_hashes: Sequence[bytes], slots: Slots, *, tag: Hashable = None
    ) -> Transfer:
        """Load these blocks into their slots in the background (see the module docstring)."""
        return self.load_many([LoadRequest(block_hashes, slots, tag)])[0]

    def load_many(self, requests: Sequence[LoadRequest], *, idle: bool = False) -> list[Transfer]:
        """Queue several loads (a step's) and wake the load threads once, after the last.

        Woken after each, a load thread takes the GIL from the submitting (engine) thread
        while it queues the rest: measured inside vLLM, 8 loads of one step kept the
        engine's thread 5.5 ms in ``start_load_kv``. Arguments are checked first, for
        every request: a bad one raises ``ArgumentError`` here, and nothing is queued.

        ``idle``: the engine runs nothing else until these loads are done (a step that
        computes nothing), so they run on this thread's cores rather than on
        :attr:`cpus` (module docstring). Ignored where :attr:`cpus` is None or a CPU
        list the configuration names (``transfer_cpus``), and over a backend that
        declares ``io_threads``.
        """
        self._check_open()
        conn = self.connector
        checked = [conn.check_transfer(r.block_hashes, r.slots) for r in requests]
        here = _own_cpus() if idle and self._idle_moves else None
        transfers: list[Transfer] = []
        jobs: list[_LoadJob] = []
        for request, (hashes, slots) in zip(requests, checked):
            transfer = Transfer("load", request.tag, len(hashes))
            transfer._on_done = self._record
            transfers.append(transfer)
            if not hashes:
                transfer._finish(LoadResult(0))
            else:
                jobs.append(_LoadJob(transfer, hashes, slots, here))
        if jobs:
            with self._cond:
                for job in jobs:
                    self._open[id(job.transfer)] = job.transfer
                self._queues.load.extend(jobs)
                self._start_threads()
                self._cond.notify_all()
        return transfers

    # ------------------------------------------------------------------ completion
    def finished(self) -> list[Transfer]:
        """Transfers finished since the last call, in the order they finished.

        Also cancels loads older than ``load_timeout_s``: an engine polls every step, so
        a stalled store fails its loads within about that long.
        """
        now = time.monotonic()
        with self._cond:
            late = [
                t
                for t in self._open.values()
                if t.kind == "load" and now - t.submitted >= self.load_timeout_s
            ]
        cancelled = [t for t in late if t.cancel()]
        if cancelled:
            self._log_late_loads(cancelled)
        out = []
        with self._cond:
            while self._finished:
                out.append(self._finished.popleft())
        return out

    def _log_late_loads(self, cancelled: Sequence[Transfer]) -> None:
        """Count loads failed for being late; log them at most once an interval, since a
        stalled store fails every load in flight, step after step."""
        stats = self.connector.stats
        stats.bump("late_loads", len(cancelled))
        if not self._late_log.due():
            return
        log.warning(
            "kvconn: %d load(s) of %d blocks (tags %s) did not finish within %.1fs; their "
            "blocks are reported failed (%d late loads so far)",
            len(cancelled),
            sum(t.blocks for t in cancelled),
            ", ".join(repr(t.tag) for t in cancelled[:3]) + (", ..." if len(cancelled) > 3 else ""),
            self.load_timeout_s,
            stats.late_loads,
        )

    @property
    def in_flight(self) -> int:
        """Transfers submitted and not finished (loads queued or running, saves storing)."""
        with self._cond:
            return len(self._open)

    def order_reuse(self, stream: Any = None) -> None:
        """Order ``stream`` (default: the caller's current CUDA stream) after every
        capture queued so far.

        Captures on a CUDA pool run on a side stream; work the engine queues after this
        call (the next forward pass, which may overwrite freed blocks) waits for them on
        the device, not on the host. No-op on a CPU pool, whose captures are done when
        ``save`` returns.
        """
        if self._side is not None:
            if stream is None:
                stream = torch.cuda.current_stream(self.connector.device)
            stream.wait_stream(self._side)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Finish or cancel in-flight work within ``timeout_s``; whether all of it ended.

        Queued and running loads are cancelled (their blocks fail); saves already
        captured get until the deadline to be stored, then are reported dropped. A thread
        still inside a backend call at the deadline is left to finish on its own (daemon):
        the caller should then not close the backend under it.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._closing:
                return not any(t.is_alive() for t in self._threads)
            self._closing = True
            loads = [t for t in self._open.values() if t.kind == "load"]
            if not self.ordered:  # over a group, queued loads still meet the other ranks
                self._queues.load.clear()
            self._cond.notify_all()
        for transfer in loads:
            transfer.cancel()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in self._threads if t.is_alive()]
        with self._cond:
            abandoned = [*self._storing, *self._queues.store]
            self._queues.store.clear()
        for job in abandoned:  # a late store of these is not reported again
            job.transfer._part_stored(_abandoned(job.captured))
        if alive:
            log.warning(
                "kvconn: %d transfer thread(s) still inside a backend call after %.1fs",
                len(alive),
                timeout_s,
            )
            return False
        self.arena.close()
        return True

    # ------------------------------------------------------------------ threads
    def _check_open(self) -> None:
        if self._closing or self.connector.closed:
            raise ConnectorClosed("transfer submitted to a closed kvconn transfer service")

    def _record(self, transfer: Transfer) -> None:
        with self._cond:
            self._open.pop(id(transfer), None)
            self._finished.append(transfer)

    def _start_threads(self) -> None:
        """Start the threads on first use (under ``_cond``)."""
        if self._threads:
            return
        names = ["kvconn-store"] + [f"kvconn-load-{i}" for i in range(self._load_threads)]
        targets = [self._store_loop] + [self._load_loop] * self._load_threads
        for name, target in zip(names, targets):
            thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self, loop: Callable[[], None]) -> None:
        """A transfer thread: on :attr:`cpus` when set, then ``loop`` until closed."""
        if self.cpus is not None:
            _move_to(self.cpus)
        loop()

    def _store_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queues.store and not self._closing:
                    self._cond.wait()
                if not self._queues.store:
                    return
                batch = list(self._queues.store)
                self._queues.store.clear()
                self._storing = batch
            try:
                results = self.connector.store_captured([j.captured for j in batch])
            except Exception:  # a bug, not a store outage: never lose the thread to it
                log.exception("kvconn: storing %d captured saves failed", len(batch))
                results = [_abandoned(j.captured) for j in batch]
            with self._cond:
                self._storing = []
            for job, result in zip(batch, results):
                self.arena.give(job.piece)
                job.transfer._part_stored(result)

    def _load_loop(self) -> None:
        placed = self.cpus
        while True:
            with self._cond:
                while not self._queues.load and not self._closing:
                    self._cond.wait()
                if self._closing and not (self.ordered and self._queues.load):
                    return
                job = self._queues.load.popleft()
            if isinstance(job, _CheckJob):
                self.connector.check_replicas(job.probe)
                continue
            transfer = job.transfer
            want = job.cpus or self.cpus
            if want is not None and want != placed:  # a refusal is logged once, not retried
                _move_to(want)
                placed = want
            try:
                result = self._run_load(job)
            except Exception:
                log.exception("kvconn: a load of %d blocks failed", transfer.blocks)
                result = LoadResult(0, tuple(range(transfer.blocks)))
            if isinstance(result, LoadResult):
                transfer._finish(result)

    def _run_load(self, job: _LoadJob) -> LoadResult | None:
        conn = self.connector
        transfer = job.transfer
        remaining = self.load_timeout_s - (time.monotonic() - transfer.submitted)
        piece = self.arena.take(conn.load_bytes(len(job.hashes)), timeout=max(0.0, remaining))
        if piece is None:  # no room before the deadline, or closing: the blocks fail
            if self.ordered:
                return conn.decline_load(job.hashes, job.slots)
            return LoadResult(0, tuple(range(transfer.blocks)))
        try:
            with self._load_stream():
                return conn.load_into(
                    job.hashes,
                    job.slots,
                    lambda n: (piece.tensor[:n], piece.view[:n]),
                    gate=transfer._gate,
                )
        finally:
            self.arena.give(piece)

    # ------------------------------------------------------------------ CUDA
    @contextlib.contextmanager
    def _capture_stream(self) -> Iterator[None]:
        """On a CUDA pool, queue captures on a side stream after the caller's work."""
        device = self.connector.device
        if device.type != "cuda":
            yield
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            yield

    @contextlib.contextmanager
    def _load_stream(self) -> Iterator[None]:
        """Each load thread scatters on a stream of its own (synchronized before done)."""
        device = self.connector.device
        if device.type != "cuda":
            yield
            return
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            yield


def _move_to(cpus: frozenset[int]) -> None:
    """Run the calling thread on ``cpus``; a set the system refuses is logged, not raised."""
    try:
        os.sched_setaffinity(0, cpus)  # 0: this thread alone, on Linux
    except (AttributeError, OSError, ValueError) as exc:
        log.warning(
            "kvconn: cannot run %s on CPUs %s (%s); it runs where it was",
            threading.current_thread().name,
            sorted(cpus),
            exc,
        )


def _own_cpus() -> frozenset[int] | None:
    """The calling thread's cores, or None where the system does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _merge(a: SaveResult, b: SaveResult) -> SaveResult:
    """Two parts of one save: counts add up, each block keeps its worst outcome."""
    blocks = tuple(x if _RANK[x] >= _RANK[y] else y for x, y in zip(a.blocks, b.blocks))
    return SaveResult(a.written + b.written, a.skipped + b.skipped, a.dropped + b.dropped, blocks)


def _abandoned(captured: CapturedPages) -> SaveResult:
    """A captured save that never reached the store (closed, or a bug): dropped."""
    dropped = {p.block for p in captured.pages}
    blocks = tuple(
        Outcome.DROPPED if i in dropped else Outcome.SKIPPED for i in range(captured.blocks)
    )
    return SaveResult(dropped=len(captured.pages), blocks=blocks)
