"""Where each copy of a key lies, and reading one key from a copy of our choosing.

The lowest layer of the backend's fail-over: it knows the transfer engine and the
replica descriptors, not the client's session, the batches or the policy, so every
module above may use it and it calls none of them.

Measured with ``mooncake-transfer-engine`` 0.3.13 (``docs/notes/mooncake-api.md``):
``batch_get_into`` cannot be told which replica to read, and while the master still
lists a dead storage process's segment (``client_ttl``) it keeps choosing the dead copy
of some keys. But ``batch_get_replica_desc`` says where every copy lies
(:func:`copies_of`), and a transfer engine the client shares
(:func:`make_engine`) can read any of them: :class:`ReplicaReader` does so, and
remembers for :data:`AVOID_S` which endpoints failed, so the policy above
(:mod:`kvconn_mooncake._failover`) can steer later reads around them.

Threads: :class:`ReplicaReader` may be used from several threads at once; its only
state, the failed endpoints, changes under its own lock, never held across a transfer.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvconn_mooncake._flight import Flight

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


def copies_of(described: Mapping[str, Sequence[Any]], complete: Any) -> dict[str, Stored]:
    """Size and copies of each key ``batch_get_replica_desc`` described a complete replica of.

    ``complete`` is ``ReplicaStatus.COMPLETE``: any other replica is a put in flight or
    a replica being removed, and must not be read. A key whose memory copies disagree
    in size keeps the first size seen (and only the copies of that size); a disk
    replica gives a size but no copy the engine could read.
    """
    stored: dict[str, Stored] = {}
    for key, replicas in described.items():
        size = -1
        copies: list[Copy] = []
        for replica in replicas:
            if replica.status != complete:
                continue  # a put in flight, or a replica being removed
            if replica.is_memory_replica():
                buffer = replica.get_memory_descriptor().buffer_descriptor
                if size in (-1, int(buffer.size)):
                    size = int(buffer.size)
                    copies.append(Copy(str(buffer.transport_endpoint), int(buffer.buffer_address)))
            elif size == -1:
                size = int(replica.get_disk_descriptor().object_size)
        if size >= 0:
            stored[key] = Stored(size, tuple(copies))
    return stored


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

    The port of a name is only a label (the engine listens on another), so a free port
    can be a live peer's name; the metadata server then refuses ours as a duplicate and
    initialize() gives -1. An engine that failed so must never be destroyed: its
    destructor deletes the name's entry, the peer's: RDMA peers can no longer handshake
    with it, and the next process to draw the port takes the name while the master may
    still list a killed peer's segment under it; its reads of copies there segfault
    (measured, ``docs/notes/mooncake-api.md``). So such an engine is kept alive for good
    (:func:`_keep_alive`), and the next attempt takes a new port.
    """
    host = bare_host(hostname)
    code: object = None
    for _ in range(attempts):
        name = f"{host}:{_free_port()}"
        try:
            engine = module.TransferEngine()
        except Exception as exc:
            code = repr(exc)
            continue
        try:
            code = engine.initialize(name, metadata, protocol, devices)
        except Exception as exc:
            code = repr(exc)
        if code == 0:
            return engine, name
        _keep_alive(engine)
        log.info("kvconn: mooncake transfer engine %s did not start (%s); new port", name, code)
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


def _keep_alive(engine: Any) -> None:
    """Never run ``engine``'s destructor, not even when the interpreter exits.

    One reference more than anyone holds: a module-level list would not do, as modules
    are cleared at exit and the destructor would then delete the peer's entry as the
    process ends. A clash of ports is rare, and a failed engine holds little.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(engine))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


class ReplicaReader:
    """Reads keys from explicit replicas through the client's transfer engine."""

    def __init__(
        self, engine: Any, flight: Flight | None = None, *, avoid_s: float = AVOID_S
    ) -> None:
        self.engine = engine
        #: Shared with the client that shares the engine: one queue per peer for both.
        self.flight = Flight(None) if flight is None else flight
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

    @staticmethod
    def order(copies: Sequence[Copy], avoid: set[str]) -> list[Copy]:
        """Copies on endpoints not known to fail first; the others as a last resort."""
        return [c for c in copies if c.endpoint not in avoid] + [
            c for c in copies if c.endpoint in avoid
        ]

    def read(self, reads: Sequence[Read]) -> list[bool]:
        """Read each key from its first copy that transfers; per key, whether one did.

        One ``batch_transfer_sync_read`` per endpoint, pass and slice (:mod:`._flight`);
        a failed transfer marks the endpoint and moves the keys of its slice on to their
        next copy. The bytes of a key that fails everywhere may be partly written: the
        caller reads into staging or scratch memory and copies out only what succeeded,
        as it does for ``batch_get_into``.
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
                outcomes = self._transfer_from(
                    endpoint,
                    [reads[i].address for i in items],
                    peers,
                    [reads[i].size for i in items],
                )
                failed = [i for i, code in zip(items, outcomes) if code != 0]
                for i, code in zip(items, outcomes):
                    done[i] = code == 0
                if not failed:
                    continue
                log.debug(
                    "kvconn: mooncake read from %s failed (%s)",
                    endpoint,
                    next(c for c in outcomes if c != 0),
                )
                self.mark_failed([endpoint])
                for i in failed:
                    reads[i].tried += 1
                pending.extend(failed)
        return done

    def _transfer_from(
        self, endpoint: str, locals_: list[int], peers: list[int], sizes: list[int]
    ) -> list[int | str]:
        """Per key, 0 or its slice's failure (a code, or what the binding raised): one
        transfer per slice of the bound on keys in flight (:mod:`._flight`)."""

        def read(mine: list[int], theirs: list[int], lengths: list[int]) -> list[int | str]:
            code: int | str
            try:
                code = int(self.engine.batch_transfer_sync_read(endpoint, mine, theirs, lengths))
            except Exception as exc:  # a binding error is a failed transfer, not a crash
                code = repr(exc)
            return [code] * len(mine)

        return self.flight.run(read, locals_, peers, sizes)
