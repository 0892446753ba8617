"""The per-rank connector: lookup, save and load over any backend.

It applies DESIGN.md's rules, each owned by its own module and orchestrated here:

* lookup asks one batched ``exists`` for every page any rank will load, so the whole TP
  group gets one answer (rule 3; :mod:`kvconn.lookup`, usable without torch);
* save writes only the pages this rank is the designated writer of, after skipping
  those already stored (rule 4; :mod:`kvconn.plan`);
* load fills this rank's pool slots with its own shard's pages and the replicated ones,
  and reports the first block that failed and every later one (rule 5);
* every stored value is the page and a checksum seeded by its key (kvconn.integrity),
  sealed on save and verified on load before any byte reaches a slot; a stored page
  that fails it, or that is stored but cannot be read, is deleted so that the next
  lookup misses it and the next save rewrites it (:mod:`kvconn.repair`);
* backend errors become misses and dropped saves, counted and logged, never exceptions
  into the serving loop (rule 6; :mod:`kvconn.calls`);
* the first save that reaches the store also puts the layout manifest of every page kind
  (:mod:`kvconn.manifests`);
* over a TP group, the ranks that hold the same page compare their bytes at the first
  save and on a sample of saves; a page kind whose holders differ is keyed per rank from
  then on (:mod:`kvconn.replica_check`).

``save`` and ``load`` run on the caller's thread. :class:`kvconn.transfer.TransferService`
runs the same steps in the background and reports per-block outcomes through handles:
it captures a save's pages with :meth:`Connector.capture` on the caller's thread and
stores them with :meth:`Connector.store_captured` later.

Threads: one connector may be called from several threads at once (SGLang asks
``exists``, ``get`` and ``set`` from three). Each save or load borrows its own staging
buffer; counters and back-off change under locks; calls to a backend that does not
declare ``Capabilities.thread_safe`` are serialized (:mod:`kvconn.calls`).
``register_pools`` and ``close`` are not meant to race with transfers.

TP group (optional): a connector given the engine's TP ranks as a ``torch.distributed``
process group (``group=``) compares, now and then, the bytes of pages several ranks hold
(``verify_replicas_every``; :mod:`kvconn.replica_check`), and with ``stripe_reads``
reads each such page once per group and passes it to the other ranks over the group
(:mod:`kvconn.striped_load`); striped loads then report the same blocks loaded and
failed on every rank. Checks (at saves) and striped loads are collective: every rank
must make the same saves and loads in the same order (engines do: the scheduler's
metadata names them), one at a time. Building such a connector is collective too: the
ranks check, once, that they agree on the layout and the chunking of loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvconn.backend import Backend, ReadStatus
from kvconn.calls import BackendCalls, Unavailable
from kvconn.config import ConnectorConfig
from kvconn.errors import ConfigError, ConnectorClosed, LayoutError
from kvconn.gate import Gate
from kvconn.group import TpGroup
from kvconn.integrity import PageChecksum
from kvconn.layout import NO_SLOT
from kvconn.lent_load import lent_statuses, verify_and_scatter
from kvconn.lookup import Lookup, PageKeys, check_hashes
from kvconn.manifests import ManifestWriter
from kvconn.movement import HostPage, PageMover, flat_bytes, scatter_host_pages
from kvconn.plan import RankShare, WriterPolicy, share_key, writes
from kvconn.registry import load_backend
from kvconn.repair import PageRepair, Verdict
from kvconn.replica_check import Probe, ReplicaCheck
from kvconn.results import LoadResult, LookupResult, Outcome, SaveResult, save_outcomes
from kvconn.slots import SlotMap, Slots, slot_map
from kvconn.staging import StagingPool
from kvconn.stats import ConnectorStats
from kvconn.striped_load import StripedLoad, Take

log = logging.getLogger("kvconn")

__all__ = [
    "CapturedPages",
    "Connector",
    "LoadResult",
    "LookupResult",
    "Outcome",
    "SaveResult",
    "Slots",
]


@dataclass(frozen=True)
class _Page:
    """One page a rank owns in a save: its page kind (share index), block and key."""

    share: int
    block: int
    key: str


@dataclass
class CapturedPages:
    """Pages of one save, gathered out of the pool into staging rows, not yet stored.

    ``values[i]`` is page ``pages[i]``'s stored value: the page, then room for its
    checksum, which :meth:`Connector.store_captured` seals. Once captured, the pool slots
    may be reused: the bytes are in staging.
    """

    blocks: int  # blocks in the save
    pages: list[_Page]
    values: list[memoryview]
    owned: set[int]  # blocks with at least one page this rank writes
    ready: Callable[[], None] = lambda: None  # waits until the gather has finished
    captured: Callable[[], bool] = lambda: True  # whether it has, without waiting


class Connector:
    """One rank's view of the store; safe to call from several threads (module docstring).

    Without pools it still answers :meth:`lookup`, which needs only the layout's
    geometry; a scheduler that never holds KV tensors should use the torch-free
    :class:`kvconn.lookup.Lookup` instead.

    ``group``: the engine's TP ranks as a ``torch.distributed`` process group (kvconn's
    own, ranks in TP-rank order; gloo, or NCCL for pools on the GPU) to stripe loads
    over (module docstring); without one every rank reads every page it loads.
    """

    def __init__(
        self,
        config: ConnectorConfig | Mapping[str, Any],
        layout: Any,
        *,
        rank: int = 0,
        pools: Sequence[torch.Tensor] | None = None,
        backend: Backend | None = None,
        group: Any = None,
    ) -> None:
        if backend is not None and not isinstance(backend, Backend):
            raise ConfigError(f"backend must be a kvconn Backend instance, got {backend!r:.80}")
        self.keys = PageKeys(config, layout)
        self.config: ConnectorConfig = self.keys.config
        self.layout = self.keys.layout
        self.rank = rank
        self.plans = self.keys.plans
        self.shares: tuple[RankShare, ...] = self.keys.shares(rank)  # validates the rank
        self.prefix = self.keys.prefix
        self.stats = ConnectorStats()
        # Asked once whether this connector's keys are off limits (a Redis ACL user
        # confined to other keys): a start-up error, not a miss on every call.
        self.backend = (
            backend
            if backend is not None
            else load_backend(self.config.backend, self.config.options, key_prefix=self.prefix)
        )
        self.calls = BackendCalls(
            self.backend,
            name=self.config.backend,
            retry_interval_s=self.config.retry_interval_s,
            stats=self.stats,
        )
        self.calls.check_keys(
            self.keys.key_shapes(), model=self.config.model, namespace=self.config.namespace
        )
        # Its keys change with this rank's, at replica checks, never on its own.
        self._lookup = Lookup(
            self.config, self.layout, keys=self.keys, calls=self.calls, follow_markers=False
        )
        self._repair = PageRepair(self.calls)
        self._manifests = ManifestWriter(self.calls, self.keys.manifests)
        self._movers: list[PageMover] | None = None
        self.pools: list[torch.Tensor] = []
        self.device = torch.device("cpu")
        self._staging = StagingPool(self.backend, pin=False, guard=self.calls.guard)
        self.closed = False
        #: The TP group loads stripe their reads over (module docstring), or None.
        self.group: TpGroup | None = None
        self._striped: StripedLoad | None = None
        if group is not None:
            self._join(group)
        # Pages several ranks hold are compared across them over the group now and then,
        # and keyed per rank where they differ (kvconn.replica_check); kinds the store
        # already marks per rank are keyed so from the start (collective with a group).
        self._replicas = ReplicaCheck(
            self.keys,
            rank=rank,
            group=self.group,
            calls=self.calls,
            stats=self.stats,
            every=self.config.verify_replicas_every,
        )
        self._use_keys(self._replicas.start(self.keys))
        if pools is not None:
            self.register_pools(pools)

    def _join(self, group: Any) -> None:
        """Take ``group`` for striped loads, once every rank agrees on what loads are.

        Collective (every rank builds its connector): the ranks compare their TP rank,
        their page kinds and key prefix, and the chunking of a load, which must be the
        same everywhere for the ranks to meet in each chunk's collectives.
        """
        tp = TpGroup(group, rank=self.rank, tp_size=self.layout.tp_size)
        kinds = "|".join([self.prefix, *(p.fingerprint for p in self.plans)])
        digest = int.from_bytes(hashlib.blake2b(kinds.encode(), digest_size=7).digest(), "little")
        chunk = self._load_chunk_blocks()
        rank_ok, digests, chunks = tp.check([int(tp.group_rank == self.rank), digest, chunk])
        if rank_ok != (1, 1):
            raise ConfigError(
                "the group's ranks are not the TP ranks in order (a connector of TP rank "
                f"{self.rank} is rank {tp.group_rank} of its group): hand kvconn a group of "
                "exactly the TP ranks, in TP-rank order"
            )
        if digests[0] != digests[1]:
            raise ConfigError(
                "the ranks of the group have different layouts, models or namespaces; "
                "striped loads need one configuration and layout on every rank"
            )
        if chunks[0] != chunks[1]:
            raise ConfigError(
                f"the ranks of the group chunk loads differently ({chunks[0]} to {chunks[1]} "
                "blocks): give every rank the same staging_bytes"
            )
        self.group = tp
        if self.config.stripe_reads:  # else the group serves replica checks only
            self._striped = StripedLoad(
                tp, self.shares, self.prefix, self.calls, self._repair, self.stats, self._sync
            )

    def _use_keys(self, keys: PageKeys) -> None:
        """Key pages by ``keys`` from now on (page kinds fallen back to per-rank keys):
        this rank's lookups, saves, loads and striped reads.

        Called under the group's lock, so no striped load is under way; a save captured
        under the old keys and stored later is dropped for those kinds
        (:meth:`store_captured`), never written under the shared key it gave up."""
        if keys is self.keys:
            return
        self.keys = keys
        self.plans = keys.plans
        self.shares = keys.shares(self.rank)
        self._lookup.keys = keys
        if self._striped is not None:
            self._striped.shares = self.shares

    # ------------------------------------------------------------------ replicas
    def replica_probes(
        self, hashes: Sequence[bytes], slots: SlotMap, writer_policy: WriterPolicy | str | None
    ) -> list[Probe]:
        """The replica checks a save makes, this rank's bytes copied out of the pool.

        Call for every save, on every rank, in the same order (:mod:`kvconn.replica_check`);
        run each with :meth:`check_replicas` where the group's collectives run.
        """
        policy = self.config.writer_policy
        if writer_policy is not None:
            policy = WriterPolicy.parse(writer_policy)
        # Movers are per page this rank holds; a check copies per page kind. A shared
        # kind is never cut finer than its shard (shard_heads), so it has one page.
        movers = self._require_pools()
        first: dict[int, int] = {}
        for s, share in enumerate(self.shares):
            first.setdefault(id(share.plan), s)
        by_kind = [movers[first[id(plan)]] for plan in self.keys.plans]
        return self._replicas.probes(
            hashes, slots, by_kind, self.device, policy, self.keys.per_rank
        )

    def check_replicas(self, probe: Probe) -> None:
        """Compare ``probe``'s pages with the other ranks' copies (collective, in order
        with striped loads: under the group's lock). Never raises into a save."""
        assert self.group is not None, "replica checks run over a group"
        try:
            with self.group.lock:
                self._use_keys(self._replicas.check(probe, self.keys))
                self._replicas.settle()  # markers, deletions: with the new keys in use
        except Exception:
            log.exception("kvconn: a replica check failed; nothing was decided")

    # ------------------------------------------------------------------ setup
    def register_pools(self, pools: Sequence[torch.Tensor]) -> None:
        """Attach this rank's KV pool tensors (the layout's ``pool`` indices)."""
        if isinstance(pools, torch.Tensor) or not isinstance(pools, Sequence):
            raise LayoutError(
                f"pools must be a list of tensors, one per layout pool (e.g. [pool]), "
                f"got {type(pools).__name__}"
            )
        for i, pool in enumerate(pools):
            if not isinstance(pool, torch.Tensor):
                raise LayoutError(f"pool {i} must be a torch tensor, got {pool!r:.80}")
        if len(pools) != len(self.layout.pool_sizes):
            raise LayoutError(
                f"the layout declares {len(self.layout.pool_sizes)} pools, got {len(pools)} tensors"
            )
        flats = []
        for i, (pool, size) in enumerate(zip(pools, self.layout.pool_sizes)):
            nbytes = pool.numel() * pool.element_size()
            if nbytes < size:
                raise LayoutError(f"pool {i} has {nbytes} bytes, the layout declares {size}")
            if pool.device != pools[0].device:
                raise LayoutError(f"pool {i} is on {pool.device}, pool 0 on {pools[0].device}")
            try:
                flats.append(flat_bytes(pool))
            except ValueError as exc:
                raise LayoutError(f"pool {i}: {exc}") from None
        group = self.group
        if group is not None and group.device.type != "cpu" and pools[0].device != group.device:
            raise LayoutError(
                f"the group ({group.backend}) moves pages on {group.device}, "
                f"the pools are on {pools[0].device}"
            )
        self.device = pools[0].device
        self.pools = list(pools)
        self._movers = [
            PageMover(share.regions, flats, self.layout.group(share.plan.group).num_slots)
            for share in self.shares
        ]
        # CUDA pools need pinned staging; nothing is allocated until the first transfer
        self._staging.release()
        self._staging = StagingPool(
            self.backend, pin=self.device.type == "cuda", guard=self.calls.guard
        )

    def close(self) -> None:
        """Release staging and close the backend; later calls raise ``ConnectorClosed``."""
        if self.closed:
            return
        self.closed = True
        self._lookup.closed = True
        self._staging.release()
        self.backend.close()

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        block_hashes: Sequence[bytes],
        *,
        windows: Mapping[int, int | None] | None = None,
    ) -> LookupResult:
        """The longest prefix of blocks whose every page, for every rank, is stored;
        ``windows`` overrides groups' windows for this lookup (:meth:`Lookup.lookup`)."""
        return self._lookup.lookup(block_hashes, windows=windows)

    # ------------------------------------------------------------------ save
    def save(
        self,
        block_hashes: Sequence[bytes],
        slots: Slots,
        *,
        writer_policy: WriterPolicy | str | None = None,
    ) -> SaveResult:
        """Store the pages of these blocks that this rank is the designated writer of.

        ``writer_policy`` overrides the configured one for this call; ``"all"`` is for
        an engine that decides itself which rank saves (SGLang MLA: rank 0 only): this
        rank then writes every page it holds that is not stored yet.
        """
        hashes, slots_ = self.check_transfer(block_hashes, slots)
        # Before the store: a kind found different is stored per rank by this very save.
        for probe in self.replica_probes(hashes, slots_, writer_policy):
            self.check_replicas(probe)
        pages = self.owned_pages(hashes, slots_, writer_policy)
        if not pages:
            return SaveResult(blocks=(Outcome.SKIPPED,) * len(hashes))
        try:
            present = self.calls.exists([p.key for p in pages])
        except Unavailable:
            return self._give_up(len(hashes), pages)
        todo = _first_missing(pages, present)
        ok_by_key: dict[str, bool] = {}
        with self._staging.borrow() as staging:
            # Only the missing pages are gathered: existence is asked first.
            chosen = [pages[i] for i in todo.values()]
            for part in self.split_pages(chosen):
                buffer, view = staging.take(self.capture_bytes(part))
                values = self._gather(part, slots_, buffer, view)
                ok_by_key.update(zip((p.key for p in part), self._put_values(part, values)))
            self._manifests.store(lambda n: staging.take(n)[1])
        return self._settle(len(hashes), pages, present, todo, ok_by_key)

    def owned_pages(
        self,
        hashes: Sequence[bytes],
        slots: SlotMap,
        writer_policy: WriterPolicy | str | None = None,
    ) -> list[_Page]:
        """The pages of ``hashes`` this rank writes under the policy, page kind by kind.

        A group's ``NO_SLOT`` for a block (no slot: outside a sliding window) stores
        nothing of that group for it.
        """
        policy = self.config.writer_policy
        if writer_policy is not None:
            policy = WriterPolicy.parse(writer_policy)
        pages: list[_Page] = []
        for s, share in enumerate(self.shares):
            slots_of = slots[share.plan.group].tolist()
            for b, h in enumerate(hashes):
                if slots_of[b] != NO_SLOT and writes(share, h, policy):
                    pages.append(_Page(s, b, share_key(self.prefix, share, h)))
        return pages

    def capture(
        self,
        block_hashes: Sequence[bytes],
        slots: SlotMap,
        pages: Sequence[_Page],
        buffer: torch.Tensor,
        view: memoryview,
    ) -> CapturedPages:
        """Gather ``pages`` into ``buffer`` (``capture_bytes(pages)`` long) for a later store.

        On a CUDA pool the gather is queued on a side stream after the caller's current
        stream, and ``ready`` waits for it: the caller's thread does not wait, and work
        the caller queues later on its stream must be ordered after :meth:`ready` or an
        event it records (the transfer service does this).
        """
        values = self._gather(pages, slots, buffer, view, sync=False)
        owned = {p.block for p in pages}
        captured = CapturedPages(len(block_hashes), list(pages), values, owned)
        if self.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            captured.ready = event.synchronize
            captured.captured = event.query
        return captured

    def store_captured(self, batch: Sequence[CapturedPages]) -> list[SaveResult]:
        """Store captured saves together: one ``exists`` and one ``put`` for all of them.

        Seals each page's checksum, skips pages already stored (and a page captured twice:
        it is put once), and returns one result per captured save.
        """
        for captured in batch:
            captured.ready()
        pages = [p for c in batch for p in c.pages]
        values = [v for c in batch for v in c.values]
        if not pages:
            return [SaveResult(blocks=(Outcome.SKIPPED,) * c.blocks) for c in batch]
        try:
            present = self.calls.exists([p.key for p in pages])
        except Unavailable:
            return [self._give_up(c.blocks, c.pages) for c in batch]
        todo = _first_missing(pages, present)
        if self.keys.per_rank:
            # A page captured under a shared key its kind has since given up (a replica
            # check found its ranks' bytes different) is dropped, not stored.
            shares = self.shares
            for key, i in list(todo.items()):
                if f"/{shares[pages[i].share].plan.fingerprint}/" not in key:
                    del todo[key]
        chosen = list(todo.values())
        ok = self._put_values([pages[i] for i in chosen], [values[i] for i in chosen])
        ok_by_key = dict(zip(todo, ok))
        self._manifests.store(lambda n: memoryview(bytearray(n)))
        results = []
        offset = 0
        for captured in batch:
            end = offset + len(captured.pages)
            # indices are per batch; rebase them on this save's pages
            mine = {k: i - offset for k, i in todo.items() if offset <= i < end}
            results.append(
                self._settle(captured.blocks, captured.pages, present[offset:end], mine, ok_by_key)
            )
            offset = end
        return results

    def _settle(
        self,
        blocks: int,
        pages: Sequence[_Page],
        present: Sequence[bool],
        put_here: Mapping[str, int],
        ok_by_key: Mapping[str, bool],
    ) -> SaveResult:
        """Count a save's pages and make its per-block outcomes.

        A page found stored is skipped; the page put for a key is written or dropped by
        the put's answer; another page of the same key (a block given twice) is skipped
        when that put succeeded and dropped when it did not.
        """
        events: dict[str, list[_Page]] = {"written": [], "skipped": [], "dropped": []}
        for i, (page, there) in enumerate(zip(pages, present)):
            if there:
                event = "skipped"
            elif put_here.get(page.key) == i:
                event = "written" if ok_by_key[page.key] else "dropped"
            else:
                event = "skipped" if ok_by_key.get(page.key, False) else "dropped"
            events[event].append(page)
        for event, which in events.items():
            self._count_pages(event, which)
        return SaveResult(
            len(events["written"]),
            len(events["skipped"]),
            len(events["dropped"]),
            save_outcomes(
                blocks,
                {p.block for p in events["written"]},
                {p.block for p in events["dropped"]},
            ),
        )

    def drop(self, blocks: int, pages: Sequence[_Page]) -> SaveResult:
        """A save given up before it reached the store (no staging room): counted."""
        return self._give_up(blocks, pages)

    def capture_bytes(self, pages: Sequence[_Page]) -> int:
        """Staging bytes :meth:`capture` needs for ``pages`` (rows of ``value_size``,
        each page kind's rows starting on an aligned boundary)."""
        total = 0
        for s, count in _kinds(pages):
            total = _aligned(total + count * self.shares[s].plan.value_size)
        return total

    def _give_up(self, blocks: int, pages: Sequence[_Page]) -> SaveResult:
        self._count_pages("dropped", pages)
        dropped = {p.block for p in pages}
        return SaveResult(dropped=len(pages), blocks=save_outcomes(blocks, set(), dropped))

    def split_pages(self, pages: Sequence[_Page]) -> Iterator[list[_Page]]:
        """``pages`` in runs whose capture fits ``staging_bytes`` (at least one page each)."""
        part: list[_Page] = []
        closed = 0  # capture bytes of the finished runs of page kinds in ``part``
        count = 0  # pages in the current run
        for page in pages:
            row = self.shares[page.share].plan.value_size
            if part and part[-1].share == page.share:
                size = _aligned(closed + (count + 1) * row)
            elif part:
                prev = self.shares[part[-1].share].plan.value_size
                size = _aligned(_aligned(closed + count * prev) + row)
            else:
                size = _aligned(row)
            if part and size > self.config.staging_bytes:
                yield part
                part, closed, count = [], 0, 0
            elif part and part[-1].share != page.share:
                closed = _aligned(closed + count * self.shares[part[-1].share].plan.value_size)
                count = 0
            part.append(page)
            count += 1
        if part:
            yield part

    def _gather(
        self,
        pages: Sequence[_Page],
        slots: SlotMap,
        buffer: torch.Tensor,
        view: memoryview,
        *,
        sync: bool = True,
    ) -> list[memoryview]:
        """Copy ``pages`` out of the pool into rows of ``buffer``; their value views."""
        movers = self._require_pools()
        values: list[memoryview] = []
        offset = 0
        i = 0
        for s, count in _kinds(pages):
            plan = self.shares[s].plan
            row = plan.value_size
            part = pages[i : i + count]
            i += count
            rows = buffer[offset : offset + count * row].view(count, row)
            index = slots[plan.group][torch.tensor([p.block for p in part], dtype=torch.long)]
            self._gather_rows(movers[s], index, rows, plan.page_size)
            values.extend(view[offset + j * row : offset + (j + 1) * row] for j in range(count))
            offset = _aligned(offset + count * row)
        if sync:
            self._sync()
        return values

    def _gather_rows(
        self, mover: PageMover, index: torch.Tensor, rows: torch.Tensor, size: int
    ) -> None:
        """Gather pages into the first ``size`` bytes of each staging row (the rest: the
        checksum, written after)."""
        if self.device.type == "cpu" or rows.shape[1] == size:
            mover.gather(index.to(self.device), rows[:, :size])
        else:
            # Gather into rows of the same shape on the device, then copy them whole: a
            # copy into strided pinned memory would go through a bounce buffer.
            on_device = torch.empty(rows.shape, dtype=torch.uint8, device=self.device)
            mover.gather(index.to(self.device), on_device[:, :size])
            rows.copy_(on_device, non_blocking=True)

    def _put_values(self, pages: Sequence[_Page], values: Sequence[memoryview]) -> list[bool]:
        # one call per scheme (one per save in practice): it lets the GIL go once
        batches: dict[PageChecksum, tuple[list[memoryview], list[str]]] = {}
        for page, value in zip(pages, values):
            batch = batches.setdefault(self.shares[page.share].plan.checksum, ([], []))
            batch[0].append(value)
            batch[1].append(page.key)
        for checksum, (sealed, keys) in batches.items():
            checksum.seal(sealed, keys)
        return self._put([p.key for p in pages], values)

    def _put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        if not keys:
            return []
        try:
            return list(
                self.calls.call("put", lambda: self.backend.put(self.calls.vetted(keys), values))
            )
        except Unavailable:
            return [False] * len(keys)

    def _count_pages(self, event: str, pages: Iterator[_Page] | Sequence[_Page]) -> None:
        counts: dict[int, int] = {}
        for page in pages:
            counts[page.share] = counts.get(page.share, 0) + 1
        for s, n in counts.items():
            self.stats.add(event, self.shares[s].plan, n)

    # ------------------------------------------------------------------ load
    def load(
        self,
        block_hashes: Sequence[bytes],
        slots: Slots,
        *,
        stripe: bool = True,
        gate: Gate | None = None,
    ) -> LoadResult:
        """Load this rank's pages of a hit prefix into its slots.

        A block is loaded only if every one of its pages arrived whole and passed its
        checksum; the first block that did not, and every block after it, are returned as
        failed and their slots are not written, so the engine recomputes exactly those.
        ``stripe=False`` reads every page this rank needs itself, even over a group
        (:mod:`kvconn.rounds`: a load the other ranks are not making); ``gate`` as in
        :meth:`load_into`.
        """
        hashes, slots_ = self.check_transfer(block_hashes, slots)
        return self.load_checked(hashes, slots_, stripe=stripe, gate=gate)

    def load_checked(
        self,
        hashes: Sequence[bytes],
        slots: SlotMap,
        *,
        stripe: bool = True,
        gate: Gate | None = None,
    ) -> LoadResult:
        """:meth:`load` of arguments :meth:`check_transfer` returned (not checked again)."""
        if self.closed:
            raise ConnectorClosed("load on a closed kvconn connector")
        with self._staging.borrow() as staging:
            return self.load_into(hashes, slots, staging.take, gate=gate, stripe=stripe)

    def stripes(self, slots: SlotMap) -> bool:
        """Whether a load into ``slots`` is striped over the group (so collective)."""
        return self._striped is not None and not _has_no_slot(slots)

    def load_into(
        self,
        hashes: Sequence[bytes],
        slots: SlotMap,
        take: Take,
        *,
        gate: Gate | None = None,
        done: Callable[[], None] | None = None,
        stripe: bool = True,
    ) -> LoadResult:
        """:meth:`load` of checked arguments, reading through staging that ``take`` lends.

        ``take`` is called once per chunk; ``done`` (if given) after each chunk's bytes
        are no longer needed. ``gate`` is entered before bytes are scattered into slots:
        a load cancelled meanwhile (the engine gave up on it) writes nothing more.
        """
        if stripe and self._striped is not None and self.stripes(slots):
            return self._load_striped(self._striped, hashes, slots, take, gate, done)
        movers = self._require_pools()
        loaded = self._by_chunks(
            len(hashes),
            lambda start, stop: self._load_chunk(hashes, start, stop, slots, movers, take, gate),
            done,
        )
        return self._loaded(loaded, len(hashes), slots)

    def _by_chunks(
        self, blocks: int, load: Callable[[int, int], int], done: Callable[[], None] | None
    ) -> int:
        """Blocks loaded by ``load(start, stop)`` over a load's chunks in order, stopping
        after the first chunk that loads short; ``done`` after each chunk, whatever
        happened. Every rank of a group chunks alike (:meth:`_load_chunk_blocks`)."""
        chunk = self._load_chunk_blocks()
        loaded = 0
        for start in range(0, blocks, chunk):
            stop = min(start + chunk, blocks)
            try:
                good = load(start, stop)
            finally:
                if done is not None:
                    done()
            loaded += good
            if start + good < stop:
                break
        return loaded

    def _loaded(self, loaded: int, blocks: int, slots: SlotMap) -> LoadResult:
        failed = tuple(range(loaded, blocks))
        if failed:
            # pages a failed block would have loaded: none of a group it has no slot in
            wanted = {g: int((t[loaded:blocks] != NO_SLOT).sum()) for g, t in slots.items()}
            for share in self.shares:
                if wanted[share.plan.group]:
                    self.stats.add("failed", share.plan, wanted[share.plan.group])
        return LoadResult(loaded, failed)

    def _load_striped(
        self,
        striped: StripedLoad,
        hashes: Sequence[bytes],
        slots: SlotMap,
        take: Take | None,
        gate: Gate | None,
        done: Callable[[], None] | None,
    ) -> LoadResult:
        """:meth:`load_into` over the group: chunk by chunk, all ranks in step.

        Every rank runs the same chunks, and stops after the same one: the first whose
        agreed good prefix is short (a cancelled load makes its next agreement short).
        """
        movers = self._require_pools()
        with striped.group.lock:
            loaded = self._by_chunks(
                len(hashes),
                lambda start, stop: striped.chunk(
                    hashes, start, stop, slots, movers, take, gate, self.device
                ),
                done,
            )
        return self._loaded(loaded, len(hashes), slots)

    def decline_load(self, hashes: Sequence[bytes], slots: SlotMap) -> LoadResult:
        """Fail a load this rank cannot run (no staging before its deadline, closing).

        Over a group, the rank still joins the load's first agreement, having read
        nothing, so every other rank fails it too instead of waiting for this one.
        """
        if self._striped is not None and hashes:
            return self._load_striped(self._striped, hashes, slots, None, None, None)
        return self._loaded(0, len(hashes), slots)

    def load_bytes(self, blocks: int) -> int:
        """Staging one chunk of a load of ``blocks`` blocks takes at most."""
        per_block = sum(sh.plan.value_size for sh in self.shares)
        chunk = min(blocks, self._load_chunk_blocks())
        return _STAGING_ALIGN * len(self.shares) + chunk * per_block

    def _load_chunk(
        self,
        hashes: Sequence[bytes],
        start: int,
        stop: int,
        slots: SlotMap,
        movers: Sequence[PageMover],
        take: Take,
        gate: Gate | None,
    ) -> int:
        n = stop - start
        # Per page kind, the blocks of the chunk (0..n-1) it has a slot for: a group
        # without a slot for a block (NO_SLOT) neither reads nor needs that page.
        wanted: list[list[int]] = []
        for share in self.shares:
            slots_of = slots[share.plan.group][start:stop].tolist()
            wanted.append([i for i, slot in enumerate(slots_of) if slot != NO_SLOT])
        keys = [
            share_key(self.prefix, share, hashes[start + i])
            for share, blocks in zip(self.shares, wanted)
            for i in blocks
        ]
        if not keys:
            return n
        if self.backend.capabilities.borrowed_reads and self.device.type == "cpu":
            return self._load_borrowed(start, n, wanted, keys, slots, movers, gate)
        # Each page kind starts on an aligned boundary, so its pages can be read as the
        # pool's words in place (an odd page size would otherwise misalign the next).
        # A value is a row: the page, then its checksum.
        offsets: list[int] = []
        total = 0
        for share, blocks in zip(self.shares, wanted):
            offsets.append(total)
            total = _aligned(total + len(blocks) * share.plan.value_size)
        buffer, view = take(total)
        buffers: list[memoryview] = []
        for share, offset, blocks in zip(self.shares, offsets, wanted):
            row = share.plan.value_size
            buffers.extend(
                view[offset + k * row : offset + (k + 1) * row] for k in range(len(blocks))
            )
        # Scratch: staging pages of keys that fail are never scattered (below).
        try:
            statuses = self.calls.call(
                "get", lambda: self.backend.read(self.calls.vetted(keys), buffers, scratch=True)
            )
        except Unavailable:
            return 0
        self._count_read(statuses, wanted)
        ok = self._repair.usable(self.shares, keys, buffers, statuses, [len(b) for b in wanted])
        good = _good_prefix(ok, wanted, n)
        if good == 0:
            return 0
        with gate(good) if gate is not None else contextlib.nullcontext(True) as allowed:
            if not allowed:
                return 0
            if self.device.type == "cpu":
                self._scatter_staged(start, stop, good, wanted, buffers, slots, movers)
                return good
            for s, (share, blocks) in enumerate(zip(self.shares, wanted)):
                count = sum(1 for i in blocks if i < good)  # blocks ascend: a prefix of rows
                if count == 0:
                    continue
                size, row = share.plan.page_size, share.plan.value_size
                rows = buffer[offsets[s] : offsets[s] + count * row].view(count, row)
                if rows.device != self.device:  # whole rows: one contiguous host-to-device copy
                    rows = rows.to(self.device, non_blocking=True)
                chunk_slots = slots[share.plan.group][start:stop]
                index = chunk_slots[torch.tensor(blocks[:count], dtype=torch.long)]
                movers[s].scatter(index.to(self.device), rows[:, :size])
                self.stats.add("loaded", share.plan, count)
            self._sync()
        return good

    def _scatter_staged(
        self,
        start: int,
        stop: int,
        good: int,
        wanted: Sequence[Sequence[int]],
        buffers: Sequence[memoryview],
        slots: SlotMap,
        movers: Sequence[PageMover],
    ) -> None:
        """Scatter a chunk's first ``good`` blocks from staging rows into CPU pools.

        Every page goes in one call that lets the GIL go once and writes the pool with
        streaming stores (:func:`kvconn.movement.scatter_host_pages`, as for lent pages): a
        numpy assignment per run let the GIL go once per run and read every pool line
        before writing it. ``buffers`` holds each kind's rows in turn, as read.
        """
        pages: list[HostPage] = []
        counts: list[int] = []
        pos = 0
        for s, (share, blocks) in enumerate(zip(self.shares, wanted)):
            chunk_slots = slots[share.plan.group][start:stop].tolist()
            count = sum(1 for i in blocks if i < good)  # blocks ascend: a prefix of rows
            pages.extend(
                movers[s].host_page(chunk_slots[block], buffers[pos + k])
                for k, block in enumerate(blocks[:count])
            )
            counts.append(count)
            pos += len(blocks)
        scatter_host_pages(pages)
        for share, count in zip(self.shares, counts):
            if count:
                self.stats.add("loaded", share.plan, count)

    def _load_borrowed(
        self,
        start: int,
        n: int,
        wanted: Sequence[Sequence[int]],
        keys: Sequence[str],
        slots: SlotMap,
        movers: Sequence[PageMover],
        gate: Gate | None,
    ) -> int:
        """:meth:`_load_chunk` from values the store lends where it holds them.

        Each block's pages are verified on the lent bytes and scattered straight from
        them into the slots while still in cache (:mod:`kvconn.lent_load`): about one
        copy of each page instead of three passes (copy into staging, verify, scatter).
        The store is repaired after the loan ends, since a delete may need what the loan
        holds (LMDB: a remap waits for readers).
        """
        sizes = [
            share.plan.value_size for share, blocks in zip(self.shares, wanted) for _ in blocks
        ]
        chunk_slots = [slots[share.plan.group][start : start + n].tolist() for share in self.shares]

        def borrowed() -> tuple[Verdict, int, list[int]]:
            with self.backend.borrow(self.calls.vetted(keys)) as views:
                statuses = lent_statuses(views, sizes)
                self._count_read(statuses, wanted)
                return verify_and_scatter(
                    self.shares, keys, views, statuses, wanted, n, chunk_slots, movers, gate
                )

        try:
            verdict, good, scattered = self.calls.call("get", borrowed)
        except Unavailable:
            return 0
        for share, count in zip(self.shares, scattered):
            if count:
                self.stats.add("loaded", share.plan, count)
        self._repair.settle(verdict)
        return good

    def _count_read(self, statuses: Sequence[ReadStatus], wanted: Sequence[Sequence[int]]) -> None:
        """Count the pages this rank read from the store (``store_read``)."""
        pos = 0
        for share, blocks in zip(self.shares, wanted):
            here = statuses[pos : pos + len(blocks)]
            pos += len(blocks)
            self.stats.add("store_read", share.plan, sum(s is ReadStatus.LOADED for s in here))

    # ------------------------------------------------------------------ helpers
    def check_transfer(
        self, block_hashes: Sequence[bytes], slots: Slots
    ) -> tuple[list[bytes], SlotMap]:
        """A save's or load's arguments, checked before anything is read or written."""
        if self.closed:
            raise ConnectorClosed("save or load on a closed kvconn connector")
        hashes = check_hashes(block_hashes)
        slots_ = slot_map(self.layout, slots, hashes)
        self._require_pools()
        return hashes, slots_

    def _load_chunk_blocks(self) -> int:
        """Blocks per chunk of a load: every rank of a group chunks alike (``_join``)."""
        per_block = sum(sh.plan.value_size for sh in self.shares)
        return self.chunk_blocks(per_block, padding=_STAGING_ALIGN * len(self.shares))

    def chunk_blocks(self, bytes_per_block: int, padding: int = 0) -> int:
        """Blocks per chunk so that a chunk (plus ``padding``) fits ``staging_bytes``."""
        room = self.config.staging_bytes - padding
        return max(1, room // max(1, bytes_per_block))

    def _require_pools(self) -> list[PageMover]:
        if self._movers is None:
            raise ConfigError("this connector has no KV pools: pass pools= or call register_pools")
        return self._movers

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _has_no_slot(slots: SlotMap) -> bool:
    """Whether a group holds no slot for some block (a sliding window's null blocks).

    Such a load is read by every rank for itself, not striped: the slots are the same on
    every rank (the engine's metadata), so every rank of a group decides alike.
    """
    return any(bool((t == NO_SLOT).any()) for t in slots.values())


def _good_prefix(usable: Sequence[bool], wanted: Sequence[Sequence[int]], n: int) -> int:
    """Blocks of a chunk before the first page any kind needed and did not get whole.

    ``usable`` holds each kind's pages in turn, one per block in ``wanted[kind]``.
    """
    good = n
    pos = 0
    for blocks in wanted:
        flags = usable[pos : pos + len(blocks)]
        pos += len(blocks)
        good = min(good, next((blocks[k] for k, ok in enumerate(flags) if not ok), n))
    return good


def _kinds(pages: Sequence[_Page]) -> list[tuple[int, int]]:
    """Runs of consecutive pages of one kind: ``(share index, count)``."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] == page.share:
            runs[-1] = (page.share, runs[-1][1] + 1)
        else:
            runs.append((page.share, 1))
    return runs


def _first_missing(pages: Sequence[_Page], present: Sequence[bool]) -> dict[str, int]:
    """For each missing key, the index of its first page: a key given twice is put once."""
    first: dict[str, int] = {}
    for i, (page, there) in enumerate(zip(pages, present)):
        if not there:
            first.setdefault(page.key, i)
    return first


#: Where each page kind starts in staging: a multiple of every word width.
_STAGING_ALIGN = 64


def _aligned(offset: int) -> int:
    return -(-offset // _STAGING_ALIGN) * _STAGING_ALIGN
