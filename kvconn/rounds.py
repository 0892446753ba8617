"""Striped loads for engines whose ranks may each skip a load: agree on it first.

A striped load is collective (:mod:`kvconn.striped_load`), so every rank must make the
same loads in the same order. vLLM and TensorRT-LLM do (their scheduler names every
load to every worker), and :class:`kvconn.transfer.TransferService` relies on it. SGLang
does not: each rank's prefetch I/O thread checks on its own whether an operation was
terminated and skips the rest of its batches, so one rank may never make a load another
rank is making. A collective load there would wait for that rank forever.

:class:`LoadRounds` never waits for a load that may not come. One thread per rank runs
*rounds*, and every rank's thread takes part in every round, with a load or without:

1. one ``all_gather`` of each rank's *head*: a digest of the blocks of the oldest load
   handed to it (:meth:`LoadRounds.load`), :data:`IDLE` for none, :data:`CLOSING`;
2. a decision every rank derives alike from what was gathered:

   * every rank has the same head: that load runs striped on every rank, now;
   * some rank is closing: every thread stops after this round, and loads still queued
     (or handed over later) are read per rank;
   * otherwise nothing runs over the group. A rank whose head has stood unmatched for
     ``patience_s`` while what the ranks gathered did not change hands it back: its
     caller reads it by itself, as without a group. That is the load a peer skipped
     (or one it reaches too late), and every byte of it is still checked.

   Each rank also gathers the heads it handed back since the ranks were last in step
   (up to :data:`HISTORY`). A head another rank has already read alone is handed back
   at once: that rank will never make the load again, so ranks that fell one load apart
   (each gave up on the other's head in the same round) are back in step after one
   round, not one ``patience_s`` per load.

Rounds with no load anywhere are paced: 1 ms apart just after a load, twice as far
apart after each idle round, up to ``idle_s`` (20 ms). A load handed over waits at most
about the current pace for the other ranks' next round (loads come in bursts: a
prefetch's batches follow each other), and a long-idle group costs one small
``all_gather`` per ``idle_s`` on each rank. A collective that fails (a rank died)
ends the rounds; every load is then read per rank.

The rounds' thread is the only one that uses the connector's group: a replica check
(a collective at saves) would have to be made in the same order on every rank, which an
engine that skips loads does not promise for saves either, so the connector must not
check replicas (``verify_replicas_every = 0``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvconn.connector import Connector
from kvconn.gate import ScatterGate
from kvconn.results import LoadResult
from kvconn.slots import SlotMap, Slots
from kvconn.stripe import chunk_digest

log = logging.getLogger("kvconn")

__all__ = ["CLOSING", "IDLE", "LoadRounds"]

#: A rank's head when it has no load.
IDLE = 0
#: A rank's head when it is closing: every rank's rounds end with this round.
CLOSING = -1
#: How many of the loads a rank read alone it tells the others of, in every round.
HISTORY = 8
#: How long a round waits before the next while ranks hold different heads.
_MISMATCH_PAUSE_S = 0.001
#: The pace of idle rounds just after a load: doubled after each idle round.
_FIRST_IDLE_PAUSE_S = 0.001


@dataclass(eq=False)  # compared by identity: the queue's head is this very load
class _Load:
    hashes: list[bytes]
    slots: SlotMap
    head: int
    done: threading.Event = field(default_factory=threading.Event)
    #: What the striped load did; None when handed back to be read per rank.
    result: LoadResult | None = None
    #: Held while a chunk is scattered; shut when the caller gives up on the load.
    gate: ScatterGate = field(default_factory=ScatterGate)

    def cancel(self) -> LoadResult:
        """Give up: the blocks scattered so far are loaded, the rest failed."""
        with self.gate.lock:
            loaded = self.gate.close()
        return LoadResult(loaded, tuple(range(loaded, len(self.hashes))))


class LoadRounds:
    """Agreed striped loads over a connector's TP group (module docstring)."""

    def __init__(
        self, connector: Connector, *, patience_s: float = 0.1, idle_s: float = 0.02
    ) -> None:
        if connector.group is None:
            raise ValueError("LoadRounds needs a connector built with a TP group (group=...)")
        if connector.config.verify_replicas_every:
            raise ValueError(
                "LoadRounds owns the connector's group, so the connector must not check "
                "replicas at saves: set verify_replicas_every = 0"
            )
        if patience_s <= 0 or idle_s <= 0:
            raise ValueError(f"patience_s and idle_s must be > 0, got {patience_s}, {idle_s}")
        self.connector = connector
        self.patience_s = patience_s
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: collections.deque[_Load] = collections.deque()
        self._closing = False
        self._ended = False  # no more rounds: every load is read per rank
        #: Heads this rank handed back since the ranks were last in step, newest first.
        self._alone: collections.deque[int] = collections.deque(maxlen=HISTORY)
        #: Loads run striped over the group, and loads handed back to be read per rank.
        self.striped = 0
        self.handed_back = 0
        self._thread = threading.Thread(target=self._run, name="kvconn-rounds", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side
    def load(
        self, block_hashes: Sequence[bytes], slots: Slots, *, timeout_s: float | None = None
    ) -> LoadResult:
        """Load blocks into slots: striped if every rank makes this load, else per rank.

        Blocks the caller's thread until the load is done; it is never left waiting for a
        rank that skipped this load longer than about ``patience_s``. A striped load not
        done after ``timeout_s`` is given up: the blocks scattered so far are loaded, the
        rest failed, and nothing more reaches the slots (the load still runs with the
        other ranks, who are making it).
        """
        conn = self.connector
        hashes, slots_ = conn.check_transfer(block_hashes, slots)
        if not hashes or not conn.stripes(slots_):
            return conn.load_checked(hashes, slots_, stripe=False)
        job = _Load(hashes, slots_, chunk_digest(hashes) or 1)
        with self._cond:
            queued = not self._ended
            if queued:
                self._queue.append(job)
                self._cond.notify_all()
        if queued:
            if not job.done.wait(timeout_s):
                return job.cancel()
            if job.result is not None:
                return job.result
        return conn.load_checked(hashes, slots_, stripe=False)

    def close(self, timeout_s: float = 5.0) -> bool:
        """End the rounds on every rank (one more round); whether they ended in time."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the rounds
    def _run(self) -> None:
        try:
            self._rounds()
        except Exception:
            log.exception("kvconn: a load round over the TP group failed; loads read per rank")
        finally:
            with self._cond:
                self._ended = True
                pending = list(self._queue)
                self._queue.clear()
            for job in pending:  # result None: read per rank
                job.done.set()

    def _rounds(self) -> None:
        group = self.connector.group
        assert group is not None
        me = group.group_rank
        last: list[list[int]] | None = None
        since = time.monotonic()
        idle_pause = _FIRST_IDLE_PAUSE_S
        while True:
            with self._cond:
                job = self._queue[0] if self._queue else None
                mine = CLOSING if self._closing else (job.head if job else IDLE)
            padded = [*self._alone, *[IDLE] * (HISTORY - len(self._alone))]
            with group.lock:
                gathered = group.gather([mine, *padded])
            heads = [values[0] for values in gathered]
            if CLOSING in heads:
                return
            now = time.monotonic()
            if gathered != last:
                last, since = gathered, now
            if job is not None and all(h == job.head for h in heads):
                self._pop(job)
                idle_pause = _FIRST_IDLE_PAUSE_S
                self._alone.clear()  # the ranks are in step: what came before is settled
                try:
                    job.result = self.connector.load_checked(job.hashes, job.slots, gate=job.gate)
                    self.striped += 1
                finally:
                    job.done.set()
                continue
            if job is not None and (
                any(job.head in v[1:] for r, v in enumerate(gathered) if r != me)  # read alone
                or now - since >= self.patience_s
            ):
                self._pop(job)
                idle_pause = _FIRST_IDLE_PAUSE_S
                self._alone.appendleft(job.head)
                self.handed_back += 1
                job.done.set()
                continue
            if all(h == IDLE for h in heads):
                pause, idle_pause = idle_pause, min(2 * idle_pause, self.idle_s)
            else:
                pause, idle_pause = _MISMATCH_PAUSE_S, _FIRST_IDLE_PAUSE_S
            with self._cond:
                head = self._queue[0] if self._queue else None
                if not self._closing and head is job:  # else the next round starts at once
                    self._cond.wait(pause)

    def _pop(self, job: _Load) -> None:
        with self._cond:
            assert self._queue and self._queue[0] is job
            self._queue.popleft()
