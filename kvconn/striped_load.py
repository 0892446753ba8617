"""One chunk of a load over a TP group: each shared page read once, then exchanged.

Every rank of the group runs these steps for the same chunk of the same load:

1. **Read** the pages it is the reader of (:mod:`kvconn.stripe`: every page only it
   holds, and of each page several replicas hold, those the spread rule gives it) into
   its staging rows, and verify them; a bad stored page is repaired as in any load.
2. **Agree** (:meth:`kvconn.group.TpGroup.agree`): the first block whose page failed on
   *any* rank, and whether every rank is loading the same blocks. From here on every
   rank knows the same good prefix; a failed page, wherever it was read, fails its block
   and every later block on every rank, so the group loads the same prefix and reports
   the same failed blocks.
3. **Exchange** the rows of the good prefix between the replicas of each shard: each
   reader sends the rows it read and verified, each replica receives the rest. Nothing
   outside the agreed prefix moves, so no rank ever receives a page its reader did not
   verify.
4. **Scatter** the good prefix into the slots, as an unstriped load does.

A rank never leaves these steps early: a read that fails (store down, or a bug) or a
load the engine cancelled still takes part in the agreement, having read nothing, so
the other ranks are never left waiting in a collective (the group then fails the chunk).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from kvconn.backend import ReadStatus, tensor_bytes
from kvconn.calls import BackendCalls, Unavailable
from kvconn.gate import Gate
from kvconn.group import TpGroup, Transfer
from kvconn.lograte import LogInterval
from kvconn.movement import HostPage, PageMover, scatter_host_pages
from kvconn.plan import PagePlan, RankShare, share_key
from kvconn.repair import PageRepair
from kvconn.slots import SlotMap
from kvconn.stats import ConnectorStats
from kvconn.stripe import StripedRows, chunk_digest, striped_rows

log = logging.getLogger("kvconn")

#: Lends staging memory: ``take(nbytes) -> (uint8 tensor, byte view)`` of the same bytes.
Take = Callable[[int], tuple[torch.Tensor, memoryview]]

#: Where each page kind's rows start in staging, as in an unstriped load.
_ALIGN = 64


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class StripedLoad:
    """Loads chunks over a :class:`~kvconn.group.TpGroup` for one connector."""

    def __init__(
        self,
        group: TpGroup,
        shares: Sequence[RankShare],
        prefix: str,
        calls: BackendCalls,
        repair: PageRepair,
        stats: ConnectorStats,
        sync: Callable[[], None],
    ) -> None:
        self.group = group
        self.shares = tuple(shares)
        self.prefix = prefix
        self.calls = calls
        self.repair = repair
        self.stats = stats
        self._sync = sync  # waits for device copies (CUDA pools)
        self._mismatch_log = LogInterval()  # a group out of step: one warning an interval

    def chunk(
        self,
        hashes: Sequence[bytes],
        start: int,
        stop: int,
        slots: SlotMap,
        movers: Sequence[PageMover],
        take: Take | None,
        gate: Gate | None,
        device: torch.device,
    ) -> int:
        """Blocks of ``[start, stop)`` the group loaded (the same on every rank).

        ``take`` is ``None`` for a rank that cannot load (no staging): it joins the
        agreement having read nothing, so the chunk fails on every rank.
        """
        n = stop - start
        chunk_hashes = hashes[start:stop]
        rows = [striped_rows(share, chunk_hashes) for share in self.shares]
        offsets: list[int] = []
        total = 0
        for share in self.shares:
            offsets.append(total)
            total = _aligned(total + n * share.plan.value_size)
        first_bad = 0
        buffer: torch.Tensor | None = None
        if take is not None and _still_wanted(gate):
            buffer, view = take(total)
            first_bad = self._read(chunk_hashes, rows, offsets, view, n)
        agreed = self.group.agree(first_bad, chunk_digest(chunk_hashes))
        if not agreed.same_blocks:
            self._mismatch(n)
        good = agreed.good
        if good == 0:
            return 0
        assert buffer is not None  # this rank's first_bad > 0, so it read into staging
        wire = self._exchange(rows, offsets, buffer[:total], good)
        with gate(good) if gate is not None else contextlib.nullcontext(True) as allowed:
            if not allowed:  # cancelled meanwhile: the next chunk's agreement stops the group
                return good
            if device.type == "cpu" and wire.device.type == "cpu":
                self._scatter_host(start, n, good, rows, offsets, wire, slots, movers)
                return good
            if wire.device != device:  # whole chunk: one contiguous host-to-device copy
                wire = wire.to(device, non_blocking=True)
            for s, (share, striped) in enumerate(zip(self.shares, rows)):
                plan = share.plan
                kind = wire[offsets[s] : offsets[s] + n * plan.value_size].view(n, plan.value_size)
                group_slots = slots[plan.group]
                for segment in striped.segments:
                    count = segment.below(good)
                    if count == 0:
                        continue
                    blocks = torch.tensor(segment.blocks[:count], dtype=torch.long) + start
                    part = kind[segment.first_row : segment.first_row + count]
                    movers[s].scatter(group_slots[blocks].to(device), part[:, : plan.page_size])
                self.stats.add("loaded", plan, good)
            self._sync()
        return good

    def _scatter_host(
        self,
        start: int,
        n: int,
        good: int,
        rows: Sequence[StripedRows],
        offsets: Sequence[int],
        wire: torch.Tensor,
        slots: SlotMap,
        movers: Sequence[PageMover],
    ) -> None:
        """The chunk's first ``good`` blocks from the wire's rows into CPU pools, every
        page in one call that lets the GIL go once, with streaming stores
        (:func:`kvconn.movement.scatter_host_pages`), as a rank's own load does."""
        data = tensor_bytes(wire)  # wire lives until the scatter returns
        pages: list[HostPage] = []
        for s, (share, striped) in enumerate(zip(self.shares, rows)):
            row = share.plan.value_size
            group_slots = slots[share.plan.group][start : start + n].tolist()
            for segment in striped.segments:
                for k, block in enumerate(segment.blocks[: segment.below(good)]):
                    at = offsets[s] + (segment.first_row + k) * row
                    pages.append(movers[s].host_page(group_slots[block], data[at : at + row]))
        scatter_host_pages(pages)
        for share in self.shares:
            self.stats.add("loaded", share.plan, good)

    # ------------------------------------------------------------------ steps
    def _read(
        self,
        hashes: Sequence[bytes],
        rows: Sequence[StripedRows],
        offsets: Sequence[int],
        view: memoryview,
        n: int,
    ) -> int:
        """Read and verify this rank's pages of the chunk; the first block that failed
        (``n`` when none did). Never raises: a rank that failed to read still agrees."""
        keys: list[str] = []
        buffers: list[memoryview] = []
        plans: list[PagePlan] = []
        blocks: list[int] = []
        for share, striped, offset in zip(self.shares, rows, offsets):
            row = share.plan.value_size
            mine = striped.mine
            for j, block in enumerate(mine.blocks):
                r = mine.first_row + j
                keys.append(share_key(self.prefix, share, hashes[block]))
                buffers.append(view[offset + r * row : offset + (r + 1) * row])
                plans.append(share.plan)
                blocks.append(block)
        if not keys:
            return n
        calls = self.calls
        try:
            statuses = calls.call(
                "get", lambda: calls.backend.read(calls.vetted(keys), buffers, scratch=True)
            )
            _count_read(self.stats, plans, statuses)
            ok = self.repair.usable_pages(plans, keys, buffers, statuses)
        except Unavailable:
            return 0
        except Exception:  # a bug: still take part in the agreement, or the others hang
            log.exception("kvconn: a striped read of %d pages failed", len(keys))
            return 0
        return min((b for b, good in zip(blocks, ok) if not good), default=n)

    def _exchange(
        self,
        rows: Sequence[StripedRows],
        offsets: Sequence[int],
        staging: torch.Tensor,
        good: int,
    ) -> torch.Tensor:
        """Send this rank's verified rows of the good prefix to the other replicas and
        receive theirs; the chunk's rows, complete up to ``good`` (on the group's device:
        staging itself for gloo, a device copy for NCCL)."""
        wire = staging
        if self.group.device.type != "cpu":
            # NCCL moves device memory: this rank's verified rows go to the device first
            wire = torch.empty(staging.shape, dtype=torch.uint8, device=self.group.device)
            for share, striped, offset in zip(self.shares, rows, offsets):
                mine = striped.mine
                span = _span(offset, share.plan.value_size, mine.first_row, mine.below(good))
                wire[span].copy_(staging[span], non_blocking=True)
        transfers: list[Transfer] = []
        for s, (share, striped, offset) in enumerate(zip(self.shares, rows, offsets)):
            if share.dup == 1:
                continue
            row = share.plan.value_size
            mine = striped.mine
            sent = mine.below(good)
            for peer, segment in striped.peers():
                received = segment.below(good)
                if sent:
                    span = _span(offset, row, mine.first_row, sent)
                    transfers.append(Transfer(peer, wire[span], True, s))
                if received:
                    span = _span(offset, row, segment.first_row, received)
                    transfers.append(Transfer(peer, wire[span], False, s))
                self.stats.add("group_sent", share.plan, sent)
                self.stats.add("group_received", share.plan, received)
        self.group.exchange(transfers)
        return wire

    def _mismatch(self, n: int) -> None:
        self.stats.bump("group_mismatches")
        if self._mismatch_log.due():
            log.warning(
                "kvconn: the ranks of the TP group were not loading the same blocks; the "
                "load of %d blocks fails on every rank (mismatched loads so far: %d). A striped "
                "load needs every rank to submit the same loads in the same order.",
                n,
                self.stats.group_mismatches,
            )


def _span(offset: int, row: int, first: int, count: int) -> slice:
    """The bytes of rows ``[first, first + count)`` of a page kind starting at ``offset``."""
    return slice(offset + first * row, offset + (first + count) * row)


def _still_wanted(gate: Gate | None) -> bool:
    """Whether the load has not been cancelled (a gate of no blocks asks without loading)."""
    if gate is None:
        return True
    with gate(0) as allowed:
        return allowed


def _count_read(
    stats: ConnectorStats, plans: Sequence[PagePlan], statuses: Sequence[ReadStatus]
) -> None:
    counts: dict[int, tuple[PagePlan, int]] = {}
    for plan, status in zip(plans, statuses):
        if status is ReadStatus.LOADED:
            seen = counts.get(id(plan))
            counts[id(plan)] = (plan, 1 if seen is None else seen[1] + 1)
    for plan, count in counts.values():
        stats.add("store_read", plan, count)
