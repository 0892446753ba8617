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
timeout again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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
