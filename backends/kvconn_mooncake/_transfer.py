"""``exists`` / ``put`` / ``get`` / ``delete`` through the client's zero-copy batch calls.

Bytes move with ``batch_put_from`` and ``batch_get_into``: the transfer engine reads
from and writes to the caller's memory directly when it is registered, else through
the scratch area (:mod:`kvconn_mooncake._memory`). Mooncake's copying API (``put`` /
``get``) is never used: it cannot tell a miss from an error, answers a batch put with
one code, and is capped by ``local_buffer_size``. How the contract maps onto Mooncake
(measured, ``docs/notes/mooncake-api.md``):

* ``exists`` is one ``batch_is_exist``; any negative code raises (never a miss).
* ``put`` de-duplicates the batch first (Mooncake stores the *second* of two equal
  keys; the contract wants the first). Mooncake never overwrites: a put of a stored key,
  or of one another writer has in flight, returns 0 → True. ``-200`` (no space) is a
  dropped save → False, not an exception.
* ``get`` must not touch a buffer whose size differs from the stored value's, but
  ``batch_get_into`` writes a shorter value into a larger buffer before anyone can
  compare. So each get first asks the master for the stored sizes
  (``batch_get_replica_desc``, one RPC for the batch, ~0.3-0.9 ms for 64 keys, ~2 % of a
  64 x 1 MiB transfer) and reads only the keys whose size matches. That query also takes
  Mooncake's read lease (``default_kv_lease_ttl``, 10 s), so the object cannot be evicted
  or removed (short of ``remove(force=True)``) between the size check and the read. Only
  ``COMPLETE`` replicas count, so a put still in flight reads as a miss, never torn.
  Duplicate keys are read once and copied: ``batch_get_into`` with a key twice reports
  success for both but fills only one buffer.
* ``get(..., scratch=True)`` (the connector's reads, into staging) skips that query:
  a failed key may leave bytes in a scratch buffer, and a wrong size is still told
  apart (``-600`` for a buffer too small, nothing written; the value's length when the
  buffer is larger). ``batch_get_into`` takes the read lease itself. Copies are only
  described for keys whose transfer failed, to read them from another replica.
* Keys whose copy sits on a dead storage process are read from, or put to, a live one:
  the fail-over policy (:mod:`kvconn_mooncake._failover`) says what to do with each
  key that failed, and this module does it, reading a chosen copy with
  :class:`~kvconn_mooncake._replicas.ReplicaReader`. Data flows one way: this module
  calls the session, the memory, the policy and the replica reader; none of them calls
  back.

Reads say per key why one did not load (:class:`~kvconn.backend.ReadStatus`), from what
each path already learned, never by asking again: absent (no replica described, or an
*absent* code) is ``MISSING``; a value of another size (the size query, ``-600``, or a
shorter length from ``batch_get_into``) is ``WRONG_SIZE``; a key whose every copy failed
to transfer (``-800``, fail-over had no live copy to read) is ``UNREACHABLE``: its bytes
are fine and the master still lists them, but their holder's process is gone, so the
connector keeps the page instead of deleting it as unreadable. Any other per-key code is
``FAILED`` (the backend cannot tell).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from kvconn.backend import ReadStatus
from kvconn.errors import BackendError
from kvconn_mooncake import _codes as codes
from kvconn_mooncake._counters import Counters
from kvconn_mooncake._failover import (
    Reroute,
    Verdict,
    after_description,
    after_failed_transfer,
    bypass_client,
)
from kvconn_mooncake._memory import Round
from kvconn_mooncake._replicas import Read, ReplicaReader, Stored, copies_of
from kvconn_mooncake._session import Session

log = logging.getLogger(__name__)

#: The counter a read that did not load adds to (once per buffer that wanted the key),
#: by the status it ended with.
FAILURE_COUNTERS = {
    ReadStatus.MISSING: "get_miss",
    ReadStatus.WRONG_SIZE: "get_wrong_size",
    ReadStatus.UNREACHABLE: "get_failed",
    ReadStatus.FAILED: "get_failed",
}


@dataclass(slots=True)
class Pending:
    """A key to read once: the buffer it lands in, and buffers that want the same key."""

    key: str
    target: int
    duplicates: list[int]
    stored: Stored | None  # None: read without asking the size and copies first

    @property
    def wanted(self) -> int:
        """Buffers that wanted the key: a failure is counted once per buffer."""
        return 1 + len(self.duplicates)

    def settle(self, status: list[ReadStatus], outcome: ReadStatus) -> None:
        """Record ``outcome`` for every buffer that wanted the key."""
        status[self.target] = outcome
        for other in self.duplicates:
            status[other] = outcome


def positions(keys: list[str]) -> dict[str, list[int]]:
    """Each distinct key and where it appears in the batch, in first-seen order."""
    if len(set(keys)) == len(keys):  # the usual batch, checked at C speed
        return {key: [i] for i, key in enumerate(keys)}
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


class Transfers:
    """The backend's operations over one :class:`Session`."""

    def __init__(self, session: Session, counters: Counters) -> None:
        self.session = session
        self.memory = session.memory
        self.counters = counters
        self._replicate = session.config.replicate_config(session.mc)
        #: Where failed puts go next; remembers the segments puts landed on lately.
        self._reroute = Reroute()

    def exists(self, keys: list[str]) -> Sequence[bool]:
        session = self.session
        store = session.enter()
        try:
            # 1/0 per key; Backend.exists turns them into bools
            return cast("Sequence[bool]", session.exist_codes(store, keys))
        finally:
            session.leave()

    def describe(self, keys: list[str]) -> dict[str, Stored]:
        """Size and copies of each stored key (:meth:`_describe` in a session of its own):
        where the master placed them, for the tools and tests that check placement."""
        session = self.session
        store = session.enter()
        try:
            return self._describe(store, keys)
        finally:
            session.leave()

    def put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        unique = [places[0] for places in positions(keys).values()]  # the first writer wins
        stored: dict[str, bool] = {}
        session = self.session
        store = session.enter()
        try:
            for round_ in self.memory.plan([values[i] for i in unique]):
                config = self._put_config()  # per round: an earlier round's reroute steers
                batch = [unique[j] for j in round_.items]
                round_keys = [keys[i] for i in batch]
                sizes = [values[i].nbytes for i in batch]
                with self.memory.addresses(round_) as (addresses, area):
                    if area is not None:
                        for i, offset in zip(batch, round_.offsets):
                            if offset >= 0:
                                area[offset : offset + values[i].nbytes] = values[i]
                    results = session.moved_codes(
                        "put", store.batch_put_from, round_keys, addresses, sizes, config
                    )
                    if codes.TRANSFER_FAIL in results:
                        results = self._reroute_puts(
                            store, (round_keys, addresses, sizes), results, config
                        )
                copied = sum(1 for offset in round_.offsets if offset >= 0)
                self.counters.merge({"put_zero_copy": len(batch) - copied, "put_scratch": copied})
                for key, code in zip(round_keys, results):
                    ok = code in codes.PRESENT
                    stored[key] = ok
                    if not ok:
                        self._count_put_failure(key, code)
        finally:
            session.leave()
        return [stored[k] for k in keys]

    def read(self, keys: list[str], buffers: list[memoryview]) -> list[ReadStatus]:
        """Read after asking each key's size and copies: a failed key's buffer stays
        untouched; per key, whether it loaded and why not."""
        groups = positions(keys)
        status = [ReadStatus.FAILED] * len(keys)
        session = self.session
        store = session.enter()
        try:
            stored = self._describe(store, list(groups))
            reader = session.reader
            avoid = reader.failed_endpoints() if reader is not None else set()
            direct: list[Pending] = []  # through the client
            rerouted: list[Pending] = []  # copies on an endpoint known to fail: bypass it
            for key, places in groups.items():
                found = stored.get(key)
                if found is None:
                    self.counters.add("get_miss", len(places))
                    for i in places:
                        status[i] = ReadStatus.MISSING
                    continue
                fitting = [i for i in places if buffers[i].nbytes == found.size]
                if len(fitting) < len(places):
                    self.counters.add("get_wrong_size", len(places) - len(fitting))
                    for i in places:
                        if buffers[i].nbytes != found.size:
                            status[i] = ReadStatus.WRONG_SIZE
                if not fitting:
                    continue
                pending = Pending(key, fitting[0], fitting[1:], found)
                if reader is not None and bypass_client(found, avoid):
                    rerouted.append(pending)
                else:
                    direct.append(pending)
            rerouted += self._read_through_client(store, reader, direct, buffers, status)
            if rerouted and reader is not None:
                self._read_from_replicas(reader, rerouted, buffers, status)
        finally:
            session.leave()
        return status

    def read_scratch(self, keys: list[str], buffers: list[memoryview]) -> list[ReadStatus]:
        """Read without asking sizes first: the caller's buffers are scratch.

        ``batch_get_into`` refuses a buffer smaller than the value (``-600``, nothing
        written) and reports a shorter value by its length after copying it, so a
        wrong size is still told apart; only the bytes a failed key leaves behind
        differ, and scratch buffers may hold those. That saves the replica-descriptor
        RPC, as costly as the transfer itself for values of tens of KiB.
        """
        groups = positions(keys)
        if len(groups) < len(keys) and any(
            len({buffers[i].nbytes for i in places}) > 1 for places in groups.values()
        ):
            return self.read(keys, buffers)  # one key into buffers of two sizes: ask first
        status = [ReadStatus.FAILED] * len(keys)
        session = self.session
        store = session.enter()
        try:
            reader = session.reader  # after enter: a delayed set-up makes it
            if reader is not None and reader.failed_endpoints():
                return self.read(keys, buffers)  # a copy failed lately: steer around it
            reads = [Pending(key, p[0], p[1:], None) for key, p in groups.items()]
            failed = self._read_through_client(store, reader, reads, buffers, status)
            if failed and reader is not None:
                self._read_described(store, reader, failed, buffers, status)
        finally:
            session.leave()
        return status

    def delete(self, keys: list[str]) -> Sequence[bool]:
        """``batch_remove(force=True)``: every read takes a 10 s lease that blocks removal."""
        unique = list(dict.fromkeys(keys))
        session = self.session
        store = session.enter()
        try:
            results = session.codes("delete", store.batch_remove, unique, True)
            removed: dict[str, bool] = {}
            for key, code in zip(unique, results):
                if code == codes.OK:
                    removed[key] = True
                elif code == codes.OBJECT_NOT_FOUND:
                    removed[key] = False
                else:
                    raise BackendError(
                        f"mooncake at {session.where}: remove of {key!r} failed with "
                        f"{codes.describe(code)}"
                    )
        finally:
            session.leave()
        return [removed[k] for k in keys]

    # ------------------------------------------------------------------ reads
    def _describe(self, store: Any, keys: list[str], retried: bool = False) -> dict[str, Stored]:
        """Size and copies of each key that has a complete replica; raises if the store failed.

        ``batch_get_replica_desc`` leaves out absent keys *and* answers ``{}`` when the
        master is down, so keys it leaves out are confirmed with ``batch_is_exist``,
        which reports a failure as a code. Only misses pay for that second RPC.
        """
        session = self.session
        described = session.invoke("batch_get_replica_desc", store.batch_get_replica_desc, keys)
        stored = copies_of(described, session.mc.ReplicaStatus.COMPLETE)
        unknown = [k for k in keys if k not in stored]
        if not unknown:
            session.down = False  # the master answered
            return stored
        results = session.exist_codes(store, unknown)
        present = [k for k, r in zip(unknown, results) if r == 1]
        if present and not retried:  # an answer lost to a restart, or a put just finished
            stored.update(self._describe(store, present, retried=True))
        return stored

    def _rounds(
        self, reads: list[Pending], buffers: list[memoryview]
    ) -> list[tuple[Round, list[Pending]]]:
        """``reads`` split into rounds that fit the scratch area, each with its reads."""
        plan = self.memory.plan([buffers[r.target] for r in reads])
        return [(round_, [reads[j] for j in round_.items]) for round_ in plan]

    def _read_through_client(
        self,
        store: Any,
        reader: ReplicaReader | None,
        reads: list[Pending],
        buffers: list[memoryview],
        status: list[ReadStatus],
    ) -> list[Pending]:
        """``batch_get_into``; returns the failed reads another replica could serve.

        Every other read gets its outcome in ``status``; those returned keep ``FAILED``
        until fail-over settles them.
        """
        retry: list[Pending] = []
        landed: Counter[str] = Counter()  # counted per key, added to the counters at once
        for round_, round_reads in self._rounds(reads, buffers):
            lengths = [buffers[r.target].nbytes for r in round_reads]
            with self.memory.addresses(round_) as (addresses, area):
                results = self.session.moved_codes(
                    "get", store.batch_get_into, [r.key for r in round_reads], addresses, lengths
                )
                for n, (read, code) in enumerate(zip(round_reads, results)):
                    offset = round_.offsets[n]
                    if code == lengths[n]:
                        landed[self._finish(read, buffers, status, area, offset)] += 1
                    elif code == codes.TRANSFER_FAIL and reader is not None:
                        landed["get_transfer_failed"] += 1
                        verdict = after_failed_transfer(read.stored)
                        if verdict.retry:
                            retry.append(read)
                        else:
                            self._give_up(reader, read, verdict, status)
                    elif read.stored is None and (code >= 0 or code == codes.INVALID_PARAMS):
                        # Sizes were not asked: the value is shorter than the buffer
                        # (its bytes are in the scratch buffer) or longer (-600, none).
                        landed["get_wrong_size"] += read.wanted
                        read.settle(status, ReadStatus.WRONG_SIZE)
                    else:
                        read.settle(
                            status, self._count_get_failure(read, code, lengths[n], offset >= 0)
                        )
        # A call that raised counts nothing: its caller sees every key fail.
        self.counters.merge(landed)
        return retry

    def _finish(
        self,
        read: Pending,
        buffers: list[memoryview],
        status: list[ReadStatus],
        area: memoryview | None,
        offset: int,
    ) -> str:
        """A read landed: copy it out of scratch if it went there, and to duplicates.

        Returns the counter of the path it took (``get_scratch`` or ``get_zero_copy``),
        for the caller to count with the rest of its batch.
        """
        target = buffers[read.target]
        path = "get_zero_copy"
        if area is not None and offset >= 0:
            target[:] = area[offset : offset + target.nbytes]
            path = "get_scratch"
        for other in read.duplicates:
            buffers[other][:] = target
        read.settle(status, ReadStatus.LOADED)
        return path

    # ------------------------------------------------------------------ fail-over
    def _read_described(
        self,
        store: Any,
        reader: ReplicaReader,
        reads: list[Pending],
        buffers: list[memoryview],
        status: list[ReadStatus],
    ) -> None:
        """Reads whose transfer failed unchecked: ask where copies are, read a live one.

        What each key's description means is the policy's (:func:`after_description`).
        """
        stored = self._describe(store, [r.key for r in reads])
        retry: list[Pending] = []
        for read in reads:
            found = stored.get(read.key)
            verdict = after_description(found, buffers[read.target].nbytes)
            if verdict.retry:
                retry.append(replace(read, stored=found))
            else:
                self._give_up(reader, read, verdict, status)
        if retry:
            self._read_from_replicas(reader, retry, buffers, status)

    def _read_from_replicas(
        self,
        reader: ReplicaReader,
        reads: list[Pending],
        buffers: list[memoryview],
        status: list[ReadStatus],
    ) -> None:
        """Read keys from explicit replicas, skipping endpoints whose transfers failed.

        Every read here has been described (``stored`` is set): copies are only known so.
        A key no copy of which transferred is ``UNREACHABLE``.
        """
        for round_, round_reads in self._rounds(reads, buffers):
            described = [cast("Stored", r.stored) for r in round_reads]
            with self.memory.addresses(round_) as (addresses, area):
                done = reader.read(
                    [
                        Read(r.key, address, d.size, d.copies)
                        for r, d, address in zip(round_reads, described, addresses)
                    ]
                )
                landed: Counter[str] = Counter()
                for n, (read, success) in enumerate(zip(round_reads, done)):
                    if success:
                        offset = round_.offsets[n]
                        landed[self._finish(read, buffers, status, area, offset)] += 1
                        landed["get_failover"] += 1
                    else:
                        landed["get_failed"] += read.wanted
                        read.settle(status, ReadStatus.UNREACHABLE)
                        log.debug("kvconn: mooncake get of %r failed on every replica", read.key)
                self.counters.merge(landed)

    def _give_up(
        self, reader: ReplicaReader, read: Pending, verdict: Verdict, status: list[ReadStatus]
    ) -> None:
        """Carry out the policy's final answer for a read: avoid the endpoints it found
        dead, count the key once per buffer that wanted it, record its status."""
        outcome = cast("ReadStatus", verdict.status)
        if verdict.dead:
            reader.mark_failed(verdict.dead)
        self.counters.add(FAILURE_COUNTERS[outcome], read.wanted)
        if outcome is ReadStatus.UNREACHABLE:
            log.debug("kvconn: mooncake get of %r failed: no live copy to read", read.key)
        read.settle(status, outcome)

    def _avoid(self) -> set[str]:
        """Endpoints a read found dead lately (none without read fail-over)."""
        reader = self.session.reader
        return reader.failed_endpoints() if reader is not None else set()

    def _put_config(self) -> Any:
        """How a put's first try places its keys: freely, or while a storage death is
        recent, preferring the segments its reroutes saw alive (:meth:`Reroute.steer`)."""
        live = self._reroute.steer(self._avoid())
        if not live:
            return self._replicate
        session = self.session
        config = session.config.replicate_config(session.mc)
        config.preferred_segments = live  # steer is only non-empty after a reroute used it
        return config

    def _reroute_puts(
        self,
        store: Any,
        batch: tuple[list[str], list[int], list[int]],
        results: list[int],
        tried: Any,
    ) -> list[int]:
        """Put once more, on segments known alive, the keys of ``batch`` (keys, addresses,
        sizes) placed on a dead storage process (their transfer failed, ``-800``) by the
        first try under ``tried``; which segments, the policy says (:class:`Reroute`).

        When nothing is known alive (a client's first batch after a death, every key of
        it placed on the dead process), the keys are put again once where the master
        chooses: those that land name live segments for the rest. Without it such a
        batch was lost whole, and so was every batch until another one landed. When
        eight keys in a row placed so landed nothing, the next batches skip it for a
        while (:meth:`Reroute.place_anywhere`). A first try steered to remembered segments
        that landed nothing proves the memory stale: it is dropped.
        """
        session = self.session
        config = session.config.replicate_config(session.mc)
        if not hasattr(config, "preferred_segments"):
            return results
        keys = batch[0]
        if tried is not self._replicate and not Reroute.witnesses(keys, results):
            self._reroute.forget()
        live = self._live_segments(store, keys, results)
        if not live:
            if not self._reroute.place_anywhere():
                return results
            retried = Reroute.failed(results)
            results = self._put_again(store, batch, results, self._replicate)
            landed = sum(1 for i in retried if results[i] in codes.PRESENT)
            self._reroute.placed_anywhere(len(retried), landed)
            if codes.TRANSFER_FAIL not in results:
                return results
            live = self._live_segments(store, keys, results)
            if not live:
                return results
        config.preferred_segments = live
        return self._put_again(store, batch, results, config)

    def _live_segments(self, store: Any, keys: list[str], results: list[int]) -> list[str]:
        """Segments to prefer for a batch's failed puts (:meth:`Reroute.segments`), from
        where its landed keys lie. Asking fails softly: the put it serves has partly
        succeeded already."""
        witnesses = Reroute.witnesses(keys, results)
        seen: list[str] = []
        if witnesses:
            try:
                described = self._describe(store, witnesses)
            except BackendError:
                described = {}
            seen = [c.endpoint for found in described.values() for c in found.copies]
        return self._reroute.segments(seen, self._avoid())

    def _put_again(
        self,
        store: Any,
        batch: tuple[list[str], list[int], list[int]],
        results: list[int],
        config: Any,
    ) -> list[int]:
        """``results`` with the keys of ``batch`` (keys, addresses, sizes) whose transfer
        failed put once more under ``config``."""
        keys, addresses, sizes = batch
        retry = Reroute.failed(results)
        again = self.session.moved_codes(
            "put",
            store.batch_put_from,
            [keys[i] for i in retry],
            [addresses[i] for i in retry],
            [sizes[i] for i in retry],
            config,
        )
        results = list(results)
        for i, code in zip(retry, again):
            results[i] = code
        self.counters.add("put_rerouted", sum(1 for code in again if code in codes.PRESENT))
        return results

    def _count_get_failure(
        self, read: Pending, code: int, expected: int, via_scratch: bool
    ) -> ReadStatus:
        """Count a failed read once per buffer that wanted the key, as misses found
        before reading are; return what the code says about the key."""
        key, wanted = read.key, read.wanted
        if code in codes.ABSENT:
            self.counters.add("get_miss", wanted)  # evicted or removed since the size query
            return ReadStatus.MISSING
        if code >= 0:
            # The value changed size between the size query and the read, which the
            # read lease forbids short of a forced remove and a new put under the same
            # key. Through scratch the caller's buffer is untouched; a registered one
            # may hold the first bytes of the new value: say so loudly.
            self.counters.add("get_wrong_size", wanted)
            level = logging.DEBUG if via_scratch else logging.ERROR
            log.log(
                level,
                "kvconn: mooncake value %r changed size during a read (%d, expected %d)",
                key,
                code,
                expected,
            )
            return ReadStatus.WRONG_SIZE
        self.counters.add("get_failed", wanted)  # e.g. -800: its segment's process died
        log.debug("kvconn: mooncake get of %r failed with %s", key, codes.describe(code))
        if code == codes.TRANSFER_FAIL:
            # Stored, and its bytes are fine, but no copy could be fetched now (the copy
            # the client chose, or the only one, is on a dead storage process).
            return ReadStatus.UNREACHABLE
        return ReadStatus.FAILED

    def _count_put_failure(self, key: str, code: int) -> None:
        if code in codes.FULL:
            self.counters.add("put_full")  # eviction lags a fast writer: a dropped save
        else:
            self.counters.add("put_failed")
            log.debug("kvconn: mooncake put of %r failed with %s", key, codes.describe(code))
