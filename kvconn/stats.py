"""Counters of what a connector moved, by shard class, by role and in total.

These are the numbers an operator needs to see the replicated-bytes saving in
production, and the ones the tests read to prove who wrote what.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kvconn.plan import PagePlan

#: written: stored by this rank; skipped: already stored by someone; loaded; failed: a
#: load that did not complete; dropped: a save given up (backend down or put refused);
#: corrupt: a stored page found bad on load (its checksum failed, or it is stored but
#: could not be read: a value of the wrong size); repaired: a corrupt page this rank
#: deleted, so that the next lookup misses it and the next save rewrites it;
#: unreachable: a stored page whose bytes the backend could not fetch right now (its
#: holder died), a miss that is kept, not repaired; store_read: a page a load got from
#: the store (whole, before its checksum was checked); group_received / group_sent: a
#: verified page a striped load got from / gave to another rank of the TP group
#: (:mod:`kvconn.stripe`), instead of every rank reading it from the store. Bytes are
#: payload bytes (``page_size``); checksum trailers are not counted.
EVENTS = (
    "written",
    "skipped",
    "loaded",
    "failed",
    "dropped",
    "corrupt",
    "repaired",
    "unreachable",
    "store_read",
    "group_received",
    "group_sent",
)


@dataclass
class Count:
    pages: int = 0
    bytes: int = 0


class ConnectorStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total: dict[str, Count] = defaultdict(Count)
        self.by_class: dict[tuple[str, str], Count] = defaultdict(Count)
        self.by_role: dict[tuple[str, str], Count] = defaultdict(Count)
        self.backend_errors = 0
        self.lookups = 0
        self.lookup_errors = 0
        #: Asynchronous saves dropped because in-flight staging was at its ceiling.
        self.staging_full = 0
        #: Background loads failed because they did not finish within ``load_timeout_s``.
        self.late_loads = 0
        #: Striped loads whose ranks were not loading the same blocks (an engine that
        #: skipped a load on some rank): failed on every rank, nothing exchanged; and
        #: replica checks whose ranks were not comparing the same blocks.
        self.group_mismatches = 0
        #: Pages several ranks hold whose copies a replica check compared and found
        #: identical on every holder (kvconn.replicas)...
        self.replicas_verified = 0
        #: ...and found different: their page kind is keyed per rank from then on.
        self.replica_mismatch = 0
        #: Page kinds keyed per rank (``lg0/replicated``…): found different here, or
        #: marked so in the store by another instance.
        self.per_rank: tuple[str, ...] = ()

    def add(self, event: str, plan: PagePlan, pages: int) -> None:
        if pages <= 0:
            return
        assert event in EVENTS, event
        with self._lock:
            self.total[event].pages += pages
            self.total[event].bytes += pages * plan.page_size
            cls = self.by_class[(event, plan.shard_class.label)]
            cls.pages += pages
            cls.bytes += pages * plan.page_size
            for role, nbytes in plan.role_bytes:
                r = self.by_role[(event, role)]
                r.pages += pages
                r.bytes += pages * nbytes

    def bump(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a plain counter (``lookups``, ``lookup_errors``, ``backend_errors``,
        ``staging_full``, ``late_loads``, ``group_mismatches``, ``replicas_verified``,
        ``replica_mismatch``), thread-safely."""
        assert counter in (
            "lookups",
            "lookup_errors",
            "backend_errors",
            "staging_full",
            "late_loads",
            "group_mismatches",
            "replicas_verified",
            "replica_mismatch",
        ), counter
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)

    def pages(self, event: str) -> int:
        return self.total[event].pages if event in self.total else 0

    def bytes(self, event: str) -> int:
        return self.total[event].bytes if event in self.total else 0

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy: ``{"total": {event: {pages, bytes}}, "by_class": …}``."""
        with self._lock:

            def nest(table: dict[tuple[str, str], Count]) -> dict[str, dict[str, dict[str, int]]]:
                out: dict[str, dict[str, dict[str, int]]] = {}
                for (event, name), c in sorted(table.items()):
                    out.setdefault(event, {})[name] = {"pages": c.pages, "bytes": c.bytes}
                return out

            return {
                "total": {
                    e: {"pages": c.pages, "bytes": c.bytes} for e, c in sorted(self.total.items())
                },
                "by_class": nest(self.by_class),
                "by_role": nest(self.by_role),
                "backend_errors": self.backend_errors,
                "lookups": self.lookups,
                "lookup_errors": self.lookup_errors,
                "staging_full": self.staging_full,
                "late_loads": self.late_loads,
                "group_mismatches": self.group_mismatches,
                "replicas_verified": self.replicas_verified,
                "replica_mismatch": self.replica_mismatch,
                "per_rank": list(self.per_rank),
            }
