"""Verifying loaded pages, and deleting stored pages that cannot be loaded.

A load reads every page of a chunk at once; this module decides, per page, whether its
bytes may reach a slot (arrived whole, checksum verified) and repairs the store for the
pages that may not: a page that failed its checksum, or that is stored but cannot be
read (a value of the wrong size), is deleted so the next lookup misses it and the next
save rewrites it. A put never overwrites, so without the delete a bad page would fail
every load until the store evicted it.

Torch-free: it works on byte views of staging memory.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvconn.backend import ReadStatus
from kvconn.calls import BackendCalls, Unavailable
from kvconn.plan import PagePlan, RankShare

log = logging.getLogger("kvconn")


class PageRepair:
    """Checks pages that arrived and repairs the store for those that cannot be used."""

    def __init__(self, calls: BackendCalls) -> None:
        self.calls = calls
        self._lock = threading.Lock()
        self._reported = False

    def usable(
        self,
        shares: Sequence[RankShare],
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        statuses: Sequence[ReadStatus],
        counts: Sequence[int],
    ) -> list[bool]:
        """Per page of a read (``counts[s]`` pages of kind ``s``, kinds in ``shares``
        order), whether it arrived whole and verified; the store is repaired for the
        pages that did not.

        Every page that arrived is verified, also after the first failure: a bad page
        found now is repaired now, before the save that follows the engine's recompute
        would skip it as already stored. A page the backend could not reach is a miss
        and stays stored: it is not the page's fault.
        """
        plans = [share.plan for share, count in zip(shares, counts) for _ in range(count)]
        return self.usable_pages(plans, keys, buffers, statuses)

    def usable_pages(
        self,
        plans: Sequence[PagePlan],
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        statuses: Sequence[ReadStatus],
    ) -> list[bool]:
        """:meth:`usable` for pages of any kinds in any order: ``plans[i]`` is page
        ``i``'s kind (a striped read takes a different number of pages of each kind)."""
        verdict = check_pages(plans, keys, buffers, statuses)
        self.settle(verdict)
        return verdict.usable

    def settle(self, verdict: Verdict) -> None:
        """Count what a :func:`check` found and repair the store (backend calls)."""
        for plan, count in verdict.unreachable.items():
            self.calls.stats.add("unreachable", plan, count)
        if verdict.damaged or verdict.unread:
            self.repair(dict(verdict.damaged), verdict.unread)

    def repair(self, damaged: dict[str, PagePlan], unread: Mapping[str, PagePlan]) -> None:
        """Delete stored pages that cannot be loaded, so the next save rewrites them.

        ``damaged`` pages arrived with a wrong checksum or are stored with the wrong size.
        ``unread`` ones did not arrive and the backend could not say why: those still
        stored are taken as unreadable, the others were evicted since the lookup, which
        is no fault of theirs. A backend error while
        asking or deleting is a backend error (counted, backed off), never corruption.
        Without ``Capabilities.delete`` the pages are counted and logged, and fail until
        the store drops them: a put never overwrites.
        """
        calls = self.calls
        if unread:
            asked = list(unread)
            try:
                stored = calls.exists(asked)
            except Unavailable:
                stored = [False] * len(asked)
            damaged.update((k, unread[k]) for k, there in zip(asked, stored) if there)
        if not damaged:
            return
        for plan, count in Counter(damaged.values()).items():
            calls.stats.add("corrupt", plan, count)
        keys = list(damaged)
        backend = calls.backend
        can_delete = backend.capabilities.delete
        self._report(keys, can_delete)
        if not can_delete:
            return
        try:
            deleted = calls.call("delete", lambda: backend.delete(calls.vetted(keys)))
        except Unavailable:
            return
        for plan, count in Counter(damaged[k] for k, gone in zip(keys, deleted) if gone).items():
            calls.stats.add("repaired", plan, count)

    def _report(self, keys: Sequence[str], can_delete: bool) -> None:
        """A warning the first time, then debug: the ``corrupt`` counter keeps the count."""
        with self._lock:
            first, self._reported = not self._reported, True
        what = (
            "deleting them so the next save rewrites them"
            if can_delete
            else f"the {self.calls.backend.name!r} backend cannot delete, so they fail until "
            "the store drops them"
        )
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "kvconn: %d stored page(s) failed their checksum or could not be read (first: %s); %s",
            len(keys),
            keys[0],
            what,
        )


@dataclass
class Verdict:
    """What verifying one read found, before anything is counted or repaired."""

    usable: list[bool]
    damaged: dict[str, PagePlan] = field(default_factory=dict)  # wrong checksum or size
    unread: dict[str, PagePlan] = field(default_factory=dict)  # failed, reason unknown
    unreachable: dict[PagePlan, int] = field(default_factory=dict)


def check(
    shares: Sequence[RankShare],
    keys: Sequence[str],
    buffers: Sequence[memoryview],
    statuses: Sequence[ReadStatus],
    counts: Sequence[int],
) -> Verdict:
    """Verify the pages of a read (``counts[s]`` pages of kind ``s``, kinds in ``shares``
    order). Pure (no backend call), so it can run while a backend lends the bytes
    (``Backend.borrow``) and the repair after the loan ends."""
    plans = [share.plan for share, count in zip(shares, counts) for _ in range(count)]
    return check_pages(plans, keys, buffers, statuses)


def check_pages(
    plans: Sequence[PagePlan],
    keys: Sequence[str],
    buffers: Sequence[memoryview],
    statuses: Sequence[ReadStatus],
) -> Verdict:
    """:func:`check` for pages of any kinds in any order: ``plans[i]`` is page ``i``'s."""
    verdict = read_verdict(plans, keys, statuses)
    usable = verdict.usable
    # by identity: hashing a plan hashes all of its regions, once per page
    arrived: dict[int, tuple[PagePlan, list[int]]] = {}
    for i, plan in enumerate(plans):
        if usable[i]:
            arrived.setdefault(id(plan), (plan, []))[1].append(i)
    for plan, got in arrived.values():
        checks = plan.checksum.verify([buffers[i] for i in got], [keys[i] for i in got])
        for i, verified in zip(got, checks):
            if not verified:
                usable[i] = False
                verdict.damaged[keys[i]] = plan
    return verdict


def read_verdict(
    plans: Sequence[PagePlan], keys: Sequence[str], statuses: Sequence[ReadStatus]
) -> Verdict:
    """The verdict on a read before any checksum: which pages arrived, and why the
    others did not (a page that arrived is usable until its checksum says otherwise)."""
    verdict = Verdict([s is ReadStatus.LOADED for s in statuses])
    for i, (plan, status) in enumerate(zip(plans, statuses)):
        if status is ReadStatus.WRONG_SIZE:
            verdict.damaged[keys[i]] = plan
        elif status is ReadStatus.FAILED:
            verdict.unread[keys[i]] = plan
        elif status is ReadStatus.UNREACHABLE:
            verdict.unreachable[plan] = verdict.unreachable.get(plan, 0) + 1
    return verdict
