"""Replica checks: the ranks that hold the same page compare their bytes over the TP group.

Why, and what falls back when they differ: :mod:`kvconn.replicas`. This module runs the
comparison for one connector.

**When.** Only over a TP group (``Connector(group=...)``) and with
``verify_replicas_every > 0``; a save under ``writer_policy="all"`` is never checked (the
engine saves from one rank: the others would never join). A save is checked for

* its blocks spread over it, up to :data:`~kvconn.replicas.BLOCKS_PER_CHECK`, if it is the
  connector's first save: the start-up check (at construction there are no meaningful
  bytes to compare);
* every block :func:`~kvconn.replicas.sampled` picks (1 in ``verify_replicas_every``, by
  block hash).

Which blocks a save checks depends only on the save itself (and whether it is the
first), never on a result nor on what was compared before: every rank that makes the
same save makes the same checks, even after an engine once handed its ranks different
saves. So a sampled block saved again is compared again: remembering compared blocks
would let such a slip leave the ranks' memories different, and a later identical save
checked on one rank only would hang the group.

**How.** One check covers up to ``BLOCKS_PER_CHECK`` blocks:

1. :meth:`ReplicaCheck.probes`, on the thread that saves, copies this rank's pages of
   every shared kind for those blocks out of the pool (the slots may be reused once the
   save returns), into host memory;
2. :meth:`ReplicaCheck.check`, where the group's collectives run: digests each role of
   each page (xxh3-64), rank 0 asks the store for the kinds' markers, and one
   ``all_gather`` of ``[digest of the blocks, markers, digests]`` gives every rank the same
   table, so every rank reaches the same verdict (:func:`~kvconn.replicas.judge`);
3. on a disagreement: one ``log.error`` names each role, page kind, block and the ranks
   whose bytes differ; the kinds holding that role key per rank from then on, on every
   rank; then (:meth:`ReplicaCheck.settle`) rank 0 puts their markers (and the per-rank
   kinds' layout manifests), so lookups in other processes follow, and the first holder
   of each disagreeing page deletes its shared copy, if the store can delete. A marker
   found in the store (another instance fell back, or an earlier run) is adopted the
   same way, and one found missing (evicted) for a kind already per rank is put again.

A rank that cannot digest its bytes still joins the collective, with nothing to compare;
ranks that were not comparing the same blocks (an engine that skipped a save on one
rank) find out from the table's first column and take no decision.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from kvconn.backend import tensor_bytes
from kvconn.calls import BackendCalls, Unavailable
from kvconn.errors import ConfigError
from kvconn.group import TpGroup
from kvconn.keys import manifest_key, page_key
from kvconn.layout import NO_SLOT
from kvconn.lookup import PageKeys
from kvconn.movement import PageMover
from kvconn.plan import WriterPolicy
from kvconn.replicas import (
    ABSENT,
    BLOCKS_PER_CHECK,
    DIGEST_MASK,
    Judgement,
    items_per_block,
    judge,
    marker_value,
    per_rank_plan,
    sampled,
)
from kvconn.slots import SlotMap
from kvconn.stats import ConnectorStats
from kvconn.stripe import chunk_digest

log = logging.getLogger("kvconn")

__all__ = ["Probe", "ReplicaCheck"]

_told_unverified = False  # the start-up note of a connector without a group: once


@dataclass
class Probe:
    """One check's bytes, copied out of this rank's pool at the save: per shared kind,
    the pages of the blocks that have a slot in its layer group."""

    hashes: list[bytes]  # the compared blocks, at most BLOCKS_PER_CHECK
    pages: list[torch.Tensor | None]  # per shared kind: [blocks with a slot, page_size]
    has_slot: list[list[bool]]  # per shared kind, per block
    ready: Callable[[], None] = field(default=lambda: None)  # waits for a device copy


class ReplicaCheck:
    """Replica checks of one connector (module docstring)."""

    def __init__(
        self,
        keys: PageKeys,
        *,
        rank: int,
        group: TpGroup | None,
        calls: BackendCalls,
        stats: ConnectorStats,
        every: int,
    ) -> None:
        self.kinds = keys.shared
        self.tp_size = keys.layout.tp_size
        self.rank = rank
        self.group = group
        self.calls = calls
        self.stats = stats
        self.every = every
        #: Whether saves are checked at all: a group, a sampling rate, shared kinds.
        self.active = group is not None and every > 0 and bool(self.kinds)
        self._lock = threading.Lock()  # whether the first save was made; saves may race
        self._first = True
        #: What the last check leaves the store to do (:meth:`settle`).
        self._pending: tuple[PageKeys, set[int], Judgement, Probe] | None = None
        self._told_out_of_step = False

    # ------------------------------------------------------------------ start-up
    def start(self, keys: PageKeys) -> PageKeys:
        """The keys to use from construction on: kinds the store marks per rank are.

        Over a group this is collective: rank 0 asks the store, every rank takes its
        answer (so they key alike), and the ranks check that they sample alike.
        Without a group each rank asks for itself, and nothing will be compared.
        """
        if not self.kinds:
            return keys
        if self.group is None:
            global _told_unverified
            if not _told_unverified:
                _told_unverified = True
                log.info(
                    "kvconn: page kinds %s are stored once for the ranks that hold them, "
                    "unverified: without a TP group (Connector(group=...)) kvconn cannot "
                    "compare what those ranks hold",
                    ", ".join(k.plan.label for k in self.kinds),
                )
            flags = self._ask_markers(keys)
        else:
            mine = self._ask_markers(keys) if self.rank == 0 else [ABSENT] * len(self.kinds)
            agreed = self.group.check([self.every, *mine])
            if agreed[0][0] != agreed[0][1]:
                raise ConfigError(
                    "the ranks of the group have different verify_replicas_every "
                    f"({agreed[0][0]} to {agreed[0][1]}): replica checks are collective, "
                    "give every rank the same value"
                )
            flags = [high for _, high in agreed[1:]]
        marked = {k.index for k, flag in zip(self.kinds, flags) if flag == 1}
        if not marked:
            return keys
        log.warning(
            "kvconn: the store marks page kind(s) %s as kept per rank (ranks were found "
            "holding different bytes of them); this connector keys them per rank",
            _labels(keys, marked),
        )
        return self._keyed(keys.with_per_rank(marked))

    # ------------------------------------------------------------------ at a save
    def probes(
        self,
        hashes: Sequence[bytes],
        slots: SlotMap,
        movers: Sequence[PageMover],
        device: torch.device,
        policy: WriterPolicy,
        per_rank: Collection[int] = (),
    ) -> list[Probe]:
        """The checks a save makes, with this rank's bytes copied out of the pool.

        Call it for every save, on every rank, in the same order (the module docstring).
        Kinds already keyed per rank (``per_rank``) are not copied: by the time the check
        runs they still are, on every rank, and are not compared.
        """
        if not self.active or policy is WriterPolicy.ALL or not hashes:
            return []
        with self._lock:
            startup, self._first = self._first, False
        spread = set(_spread(len(hashes), BLOCKS_PER_CHECK)) if startup else set()
        chosen: list[int] = []
        picked: set[bytes] = set()
        for b, h in enumerate(hashes):
            if h not in picked and (b in spread or sampled(h, self.every)):
                chosen.append(b)
                picked.add(h)
        return [
            self._probe(hashes, chosen[i : i + BLOCKS_PER_CHECK], slots, movers, device, per_rank)
            for i in range(0, len(chosen), BLOCKS_PER_CHECK)
        ]

    def _probe(
        self,
        hashes: Sequence[bytes],
        blocks: Sequence[int],
        slots: SlotMap,
        movers: Sequence[PageMover],
        device: torch.device,
        skip: Collection[int],
    ) -> Probe:
        try:
            return self._copy(hashes, blocks, slots, movers, device, skip)
        except Exception:  # still take part in the check, with nothing to compare
            log.exception("kvconn: copying pages for a replica check failed")
            none: list[torch.Tensor | None] = [None] * len(self.kinds)
            return Probe([hashes[b] for b in blocks], none, [[False] * len(blocks)] * len(none))

    def _copy(
        self,
        hashes: Sequence[bytes],
        blocks: Sequence[int],
        slots: SlotMap,
        movers: Sequence[PageMover],
        device: torch.device,
        skip: Collection[int],
    ) -> Probe:
        pages: list[torch.Tensor | None] = []
        has_slot: list[list[bool]] = []
        for kind in self.kinds:
            group_slots = slots[kind.plan.group]
            flags = [kind.index not in skip and int(group_slots[b]) != NO_SLOT for b in blocks]
            has_slot.append(flags)
            held = [b for b, there in zip(blocks, flags) if there]
            if not held:
                pages.append(None)
                continue
            index = group_slots[torch.tensor(held, dtype=torch.long)].to(device)
            rows = torch.empty((len(held), kind.plan.page_size), dtype=torch.uint8, device=device)
            movers[kind.index].gather(index, rows)
            pages.append(rows)
        probe = Probe([hashes[b] for b in blocks], pages, has_slot)
        if device.type == "cuda":  # to host memory on the save's stream; waited for later
            host: list[torch.Tensor | None] = []
            for on_device in pages:
                if on_device is None:
                    host.append(None)
                    continue
                copy = torch.empty(on_device.shape, dtype=torch.uint8, pin_memory=True)
                copy.copy_(on_device, non_blocking=True)
                host.append(copy)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            probe.pages = host
            probe.ready = event.synchronize
        return probe

    # ------------------------------------------------------------------ the check
    def check(self, probe: Probe, keys: PageKeys) -> PageKeys:
        """Compare ``probe``'s pages across their holders: the keys to use from now on.

        Collective over the group: every rank calls it for the same probe, in the same
        order as the group's other collectives (the caller holds the group's lock).
        """
        group = self.group
        assert group is not None, "replica checks need a group"
        kinds = self.kinds
        try:
            probe.ready()
            digests = self._digests(probe, keys.per_rank)
        except Exception:  # a bug: still join the collective, with nothing to compare
            log.exception("kvconn: digesting pages for a replica check failed")
            digests = [ABSENT] * (BLOCKS_PER_CHECK * items_per_block(kinds))
        marks = self._ask_markers(keys) if self.rank == 0 else [ABSENT] * len(kinds)
        table = group.gather([chunk_digest(probe.hashes), *marks, *digests])
        if len({row[0] for row in table}) > 1:
            self._out_of_step(len(probe.hashes))
            return keys
        marks = table[0][1 : 1 + len(kinds)]
        rows = [row[1 + len(kinds) :] for row in table]
        verdict = judge(rows, kinds, len(probe.hashes), keys.per_rank)
        self.stats.bump("replicas_verified", verdict.verified)
        split = verdict.kinds_to_split(kinds, keys.per_rank)
        adopted = {
            k.index
            for k, mark in zip(kinds, marks)
            if mark == 1 and k.index not in keys.per_rank and k.index not in split
        }
        if verdict.disagreements:
            self.stats.bump("replica_mismatch", verdict.mismatched)
            self._report(verdict, probe, keys, split)
        if adopted:
            log.warning(
                "kvconn: the store marks page kind(s) %s as kept per rank (another "
                "instance found their ranks holding different bytes); keyed per rank "
                "from now on",
                _labels(keys, adopted),
            )
        lost = {k.index for k, m in zip(kinds, marks) if m == 0 and k.index in keys.per_rank}
        self._pending = (keys, split | lost if self.rank == 0 else set(), verdict, probe)
        if split or adopted:
            return self._keyed(keys.with_per_rank(split | adopted))
        return keys

    def settle(self) -> None:
        """The store's side of the last :meth:`check`, once its keys are in use: rank 0
        puts the markers of kinds that fell back (or whose marker was evicted), and the
        first holder of each page found different deletes its shared copy. Never raises.

        After the keys, so that a save stored from then on no longer writes shared pages
        of those kinds; a shared page a store thread was already putting may still land
        after the delete, and is never read by a process that honours the marker.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            keys, marks, verdict, probe = pending
            self._put_markers(keys, marks, verdict)
            self._delete_shared(keys, verdict, probe)

    def _digests(self, probe: Probe, skip: Iterable[int]) -> list[int]:
        """This rank's digest list: per block, per shared kind, per role (ABSENT: none)."""
        skipped = set(skip)
        out = [ABSENT] * (BLOCKS_PER_CHECK * items_per_block(self.kinds))
        pos = 0
        rows = [0] * len(self.kinds)
        for b in range(len(probe.hashes)):
            for k, kind in enumerate(self.kinds):
                if not probe.has_slot[k][b]:
                    pos += len(kind.roles)
                    continue
                pages = probe.pages[k]
                assert pages is not None
                page = tensor_bytes(pages[rows[k]])
                rows[k] += 1
                if kind.index in skipped:
                    pos += len(kind.roles)
                    continue
                for role in kind.roles:
                    digest = xxhash.xxh3_64()
                    for start, end in role.spans:
                        digest.update(page[start:end])
                    out[pos] = digest.intdigest() & DIGEST_MASK
                    pos += 1
        return out

    # ------------------------------------------------------------------ outcomes
    def _report(self, verdict: Judgement, probe: Probe, keys: PageKeys, split: set[int]) -> None:
        """One loud error: every role, page kind and block that differed, and by whom."""
        found: dict[tuple[str, str, str, tuple[int, ...], tuple[int, ...]], list[str]] = {}
        for d in verdict.disagreements:
            shard = f", shard {d.shard}" if d.kind.shards > 1 else ""
            where = (d.kind.plan.label, shard, d.role, d.odd, d.agreeing)
            found.setdefault(where, []).append(probe.hashes[d.block].hex())
        lines = []
        for (label, shard, role, odd, agreeing), blocks in found.items():
            against = f"ranks {list(agreeing)}" if agreeing else "each other"
            lines.append(
                f"role {role!r} of page kind {label}{shard}: ranks {list(odd)} hold other "
                f"bytes than {against} (block{'s' * (len(blocks) > 1)} {', '.join(blocks)})"
            )
        log.error(
            "kvconn: ranks hold different bytes of pages they should share, so a shared "
            "copy would give some ranks another rank's bytes:\n  %s\nPage kind(s) %s are "
            "keyed per rank from now on, on every rank (each rank stores and loads its own "
            "w%dr<rank> page); their shared pages are no longer read. Check the layout's "
            "units for these roles, and the engine.",
            "\n  ".join(lines),
            _labels(keys, split) or "(already per rank)",
            self.tp_size,
        )

    def _put_markers(self, keys: PageKeys, kinds: set[int], verdict: Judgement) -> None:
        """Rank 0 marks ``kinds`` as per rank in the store, with their per-rank manifests
        (so ``kvconn inspect`` can describe those pages). Never raises."""
        if not kinds:
            return
        names: list[str] = []
        values: list[bytes] = []
        for kind in self.kinds:
            if kind.index not in kinds:
                continue
            names.append(keys.markers[kind.index])
            values.append(marker_value(kind, self.tp_size, verdict.disagreements))
            plan = per_rank_plan(kind.plan, self.tp_size)
            names.append(manifest_key(keys.prefix, plan.group, plan.fingerprint))
            values.append(plan.manifest.to_json())
        calls = self.calls
        views = [memoryview(bytearray(v)) for v in values]
        try:
            calls.call("put", lambda: calls.backend.put(calls.vetted(names), views))
        except Unavailable:
            log.warning("kvconn: per-rank markers could not be stored; the next check retries")

    def _delete_shared(self, keys: PageKeys, verdict: Judgement, probe: Probe) -> None:
        """The first holder of each page found different deletes its shared copy, which
        holds some rank's bytes; other shared pages of the kind are simply never read
        again (they cannot be listed here). Never raises."""
        doomed = sorted(
            {
                page_key(
                    keys.prefix,
                    d.kind.plan.shard_class.component(d.shard),
                    d.kind.plan.group,
                    d.kind.plan.fingerprint,
                    probe.hashes[d.block],
                )
                for d in verdict.disagreements
                if d.kind.holders(d.shard)[0] == self.rank
            }
        )
        calls = self.calls
        if not doomed or not calls.backend.capabilities.delete:
            return
        with contextlib.suppress(Unavailable):  # a backend error: counted, logged, backed off
            calls.call("delete", lambda: calls.backend.delete(calls.vetted(doomed)))

    def _ask_markers(self, keys: PageKeys) -> list[int]:
        """Per shared kind: 1 if the store holds its marker, 0 if not, ABSENT if unknown."""
        try:
            present = self.calls.exists([keys.markers[k.index] for k in self.kinds])
        except Unavailable:
            return [ABSENT] * len(self.kinds)
        return [int(there) for there in present]

    def _keyed(self, keys: PageKeys) -> PageKeys:
        self.stats.per_rank = tuple(keys.planned[i].label for i in sorted(keys.per_rank))
        return keys

    def _out_of_step(self, blocks: int) -> None:
        self.stats.bump("group_mismatches")
        if not self._told_out_of_step:
            self._told_out_of_step = True
            log.error(
                "kvconn: the ranks of the TP group were not comparing the same %d blocks in "
                "a replica check; nothing was decided. Replica checks need every rank to "
                "make the same saves in the same order.",
                blocks,
            )


def _spread(n: int, most: int) -> list[int]:
    """Up to ``most`` indices of ``range(n)``, spread from the first to the last."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def _labels(keys: PageKeys, kinds: Iterable[int]) -> str:
    return ", ".join(keys.planned[i].label for i in sorted(kinds))
