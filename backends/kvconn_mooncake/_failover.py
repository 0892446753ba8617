"""Reads from a surviving replica while the master still lists a dead one.

Measured with ``mooncake-transfer-engine`` 0.3.13 (``docs/notes/mooncake-api.md``): when
a storage process dies, the master keeps its segment for ``client_ttl`` (10 s by
default). Meanwhile ``batch_get_into`` keeps choosing the dead replica of an object that
has a live one too: every such key fails with ``-800`` after a ~0.5 s connect timeout,
call after call, so ``replica_num=2`` protected nothing during that window.

The client cannot be told which replica to read, but the replica descriptors the backend
already fetches for its size check (``batch_get_replica_desc``, which also takes the read
lease, so the object cannot be evicted or removed meanwhile) say where every copy lies.
With the transfer engine the client was set up with, :class:`ReplicaReader` reads a
failed key from another copy, remembers which endpoints failed, and lets the backend
send later reads of keys with a copy there straight to a live copy, without paying the
timeout again. Keys whose only copy is gone, or every copy, read ``UNREACHABLE``: a
failed load that the engine recomputes, of a page that is kept (its bytes are not at
fault; another copy or the master dropping the dead segment settles it).

Puts the master places on the dead segment fail the same way (``-800``, the key stays
absent); :meth:`Failover.reroute_puts` puts them once more, preferring the segments
that took the batch's other keys.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from kvconn.backend import ReadStatus
from kvconn.errors import BackendError
from kvconn_mooncake import _codes as codes

if TYPE_CHECKING:  # _transfer uses this module: only its types are needed here
    from kvconn_mooncake._transfer import Pending, Transfers

log = logging.getLogger(__name__)

#: How long an endpoint that failed a transfer is avoided. The master drops a dead
#: segment after its ``client_ttl`` (default 10 s), after which descriptors stop naming
#: it; longer than that, so a dead endpoint costs one timeout, not one per ttl.
AVOID_S = 30.0


@dataclass(frozen=True)
class Copy:
    """One complete in-memory replica: the segment's endpoint and the object's address."""

    endpoint: str
    address: int


@dataclass(frozen=True)
class Stored:
    """What the size check learned about a key: its size and where its copies lie."""

    size: int
    copies: tuple[Copy, ...] = ()


@dataclass
class Read:
    """One key to read from a replica into ``address`` (registered or scratch memory)."""

    key: str
    address: int
    size: int
    copies: tuple[Copy, ...]
    tried: int = 0  # how many of ``copies`` (in :meth:`ReplicaReader.order`) failed


def make_engine(
    module: Any, hostname: str, metadata: str, protocol: str, devices: str, *, attempts: int = 3
) -> tuple[Any, str] | None:
    """A transfer engine for the client to share and its name, or None if it cannot start.

    The client is then set up with it (``setup(name, ..., engine)``), so memory the
    backend registers with the client is registered with this engine too, which RDMA
    reads need. Each engine publishes itself in the metadata server under ``host:port``:
    a bare host would collide between the processes of one machine (initialize() then
    fails with -1), so a free port is picked, as the client does for its own engine. The
    client must be set up under that same name, or peers reading a segment this client
    mounts look for it under a name nobody serves (measured: ``-800``).
    """
    host = bare_host(hostname)
    code: object = None
    for _ in range(attempts):
        name = f"{host}:{_free_port()}"
        try:
            engine = module.TransferEngine()
            code = engine.initialize(name, metadata, protocol, devices)
        except Exception as exc:
            code = repr(exc)
            continue
        if code == 0:
            return engine, name
    log.warning("kvconn: mooncake replica fail-over is off: engine initialize() gave %s", code)
    return None


def bare_host(hostname: str) -> str:
    """``host`` of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if hostname.startswith("["):
        return hostname[: hostname.index("]") + 1] if "]" in hostname else hostname
    host, sep, port = hostname.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host
    return hostname


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


class ReplicaReader:
    """Reads keys from explicit replicas through the client's transfer engine."""

    def __init__(self, engine: Any, *, avoid_s: float = AVOID_S) -> None:
        self.engine = engine
        self.avoid_s = avoid_s
        self._lock = threading.Lock()
        self._failed: dict[str, float] = {}  # endpoint -> avoid until (monotonic)

    def failed_endpoints(self) -> set[str]:
        """Endpoints to avoid now (a transfer from them failed in the last ``avoid_s``)."""
        now = time.monotonic()
        with self._lock:
            for endpoint in [e for e, until in self._failed.items() if until <= now]:
                del self._failed[endpoint]
            return set(self._failed)

    def mark_failed(self, endpoints: Iterable[str]) -> None:
        until = time.monotonic() + self.avoid_s
        with self._lock:
            for endpoint in endpoints:
                self._failed[endpoint] = until

    def should_bypass(self, stored: Stored, avoid: set[str]) -> bool:
        """True when the client might pick a copy known to fail while another is live."""
        if not avoid or len(stored.copies) < 2:
            return False
        endpoints = {c.endpoint for c in stored.copies}
        return bool(endpoints & avoid) and bool(endpoints - avoid)

    @staticmethod
    def order(copies: Sequence[Copy], avoid: set[str]) -> list[Copy]:
        """Copies on endpoints not known to fail first; the others as a last resort."""
        return [c for c in copies if c.endpoint not in avoid] + [
            c for c in copies if c.endpoint in avoid
        ]

    def read(self, reads: Sequence[Read]) -> list[bool]:
        """Read each key from its first copy that transfers; per key, whether one did.

        One ``batch_transfer_sync_read`` per endpoint and pass; a failed transfer marks
        the endpoint and moves its keys on to their next copy. The bytes of a key that
        fails everywhere may be partly written: the caller reads into staging or scratch
        memory and copies out only what succeeded, as it does for ``batch_get_into``.
        """
        avoid = self.failed_endpoints()
        plans = [self.order(r.copies, avoid) for r in reads]
        done = [False] * len(reads)
        pending = list(range(len(reads)))
        while pending:
            by_endpoint: dict[str, list[int]] = {}
            for i in pending:
                if reads[i].tried < len(plans[i]):
                    by_endpoint.setdefault(plans[i][reads[i].tried].endpoint, []).append(i)
            if not by_endpoint:
                break
            pending = []
            for endpoint, items in by_endpoint.items():
                peers = [plans[i][reads[i].tried].address for i in items]
                code = self._transfer(
                    endpoint,
                    [reads[i].address for i in items],
                    peers,
                    [reads[i].size for i in items],
                )
                if code == 0:
                    for i in items:
                        done[i] = True
                    continue
                log.debug("kvconn: mooncake read from %s failed (%s)", endpoint, code)
                self.mark_failed([endpoint])
                for i in items:
                    reads[i].tried += 1
                pending.extend(items)
        return done

    def _transfer(
        self, endpoint: str, locals_: list[int], peers: list[int], sizes: list[int]
    ) -> int | str:
        try:
            return int(self.engine.batch_transfer_sync_read(endpoint, locals_, peers, sizes))
        except Exception as exc:  # a binding error is a failed transfer, not a crash
            return repr(exc)


class Failover:
    """The backend's reads from live replicas and puts rerouted to live segments."""

    def __init__(self, transfers: Transfers) -> None:
        self._transfers = transfers
        self._session = transfers.session
        self._counters = transfers.counters
        #: Segments puts landed on lately, and until when to trust that; see _live_segments.
        #: Threads replace the pair whole and read it once, so they never mix two.
        self._live: tuple[list[str], float] = ([], 0.0)

    def read_described(
        self,
        store: Any,
        reader: ReplicaReader,
        reads: list[Pending],
        buffers: list[memoryview],
        status: list[ReadStatus],
    ) -> None:
        """Reads whose transfer failed unchecked: ask where copies are, read a live one.

        The size query tells what the failed transfer could not: gone since (``MISSING``),
        of another size (``WRONG_SIZE``), or stored with no other copy to try
        (``UNREACHABLE``).
        """
        stored = self._transfers.describe(store, [r.key for r in reads])
        retry: list[Pending] = []
        for read in reads:
            found = stored.get(read.key)
            if found is None:
                self._counters.add("get_miss", read.wanted)
                read.settle(status, ReadStatus.MISSING)
            elif found.size != buffers[read.target].nbytes:
                self._counters.add("get_wrong_size", read.wanted)
                read.settle(status, ReadStatus.WRONG_SIZE)
            elif len(found.copies) > 1:
                retry.append(replace(read, stored=found))
            else:
                reader.mark_failed(c.endpoint for c in found.copies)
                self._counters.add("get_failed", read.wanted)
                read.settle(status, ReadStatus.UNREACHABLE)
        if retry:
            self.read_from_replicas(reader, retry, buffers, status)

    def read_from_replicas(
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
        transfers = self._transfers
        for round_, round_reads in transfers.rounds(reads, buffers):
            described = [cast("Stored", r.stored) for r in round_reads]
            with transfers.memory.addresses(round_) as (addresses, area):
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
                        landed[transfers.finish(read, buffers, status, area, offset)] += 1
                        landed["get_failover"] += 1
                    else:
                        landed["get_failed"] += read.wanted
                        read.settle(status, ReadStatus.UNREACHABLE)
                        log.debug("kvconn: mooncake get of %r failed on every replica", read.key)
                self._counters.merge(landed)

    def reroute_puts(
        self,
        store: Any,
        keys: list[str],
        addresses: list[int],
        sizes: list[int],
        results: list[int],
    ) -> list[int]:
        """Put again the keys whose copy was placed on a dead storage process.

        Until the master drops a dead process's segment (``client_ttl``) it keeps placing
        new objects there; their transfer fails (``-800``) and the key stays absent.
        The segments that took this batch's other keys (or, when none landed, a recent
        batch's) are alive, so the failed keys are put once more preferring those
        (``preferred_segments``, a hint: a wrong guess only means a random placement
        again). Measured with one of two storage processes killed: about half a batch
        failed, every retried key was stored. With ``replica_num`` 2 and two segments
        every put needs the dead one: nothing lands, and nothing is retried.
        """
        session = self._session
        config = session.config.replicate_config(session.mc)
        if not hasattr(config, "preferred_segments"):
            return results
        live = self._live_segments(store, [k for k, c in zip(keys, results) if c in codes.PRESENT])
        if not live:
            return results
        config.preferred_segments = live
        retry = [i for i, code in enumerate(results) if code == codes.TRANSFER_FAIL]
        again = session.codes(
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
        self._counters.add("put_rerouted", sum(1 for code in again if code in codes.PRESENT))
        return results

    def _live_segments(self, store: Any, landed: list[str]) -> list[str]:
        """Segments that just took a put: where the replicas of ``landed`` keys lie.

        Remembered for a while (``AVOID_S``), so a batch none of whose keys landed can
        use the last answer. Endpoints a read found dead are left out (a key that was
        already stored, answered as landed, may have its copy on the dead one). Asking
        fails softly: the put it serves has partly succeeded already.
        """
        now = time.monotonic()
        live: list[str] = []
        if landed:
            try:
                stored = self._transfers.describe(store, landed[:8])
            except BackendError:
                stored = {}
            live = sorted({c.endpoint for found in stored.values() for c in found.copies})
            if live:
                self._live = (live, now + AVOID_S)
        if not live:
            recent, until = self._live
            if until > now:
                live = recent
        reader = self._session.reader
        avoid = reader.failed_endpoints() if reader is not None else set()
        return [endpoint for endpoint in live if endpoint not in avoid]
