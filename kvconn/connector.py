"""The per-rank connector: lookup, save and load over any backend.

It applies DESIGN.md's rules in one place:

* lookup asks one batched ``exists`` for every page any rank will load, so the whole TP
  group gets one answer (rule 3);
* save writes only the pages this rank is the designated writer of, after skipping
  those already stored (rule 4);
* load fills this rank's pool slots with its own shard's pages and the replicated ones,
  and reports the first block that failed and every later one (rule 5);
* every stored value is the page and a checksum seeded by its key (kvconn.integrity),
  sealed on save and verified on load before any byte reaches a slot; a stored page
  that fails it, or that is stored but cannot be read (a value of the wrong size), is
  deleted so that the next lookup misses it and the next save rewrites it;
* backend errors become misses and dropped saves, counted and logged, never exceptions
  into the serving loop (rule 6);
* the first save that reaches the store also puts the layout manifest of every page kind
  (one batched put, after the save's pages), so ``kvconn inspect`` can tell which roles a
  page holds; a failure there is retried on a later save and is never a dropped page.

Threads: one connector may be called from several threads at once (SGLang asks
``exists``, ``get`` and ``set`` from three). Each save or load borrows its own staging
buffer; back-off, counters and manifest state change under a lock; and calls to a
backend that does not declare ``Capabilities.thread_safe`` are serialized by a lock
shared by every connector over that backend object. ``register_pools`` and ``close``
are not meant to race with transfers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvconn.backend import Backend, VettedKeys
from kvconn.config import ConnectorConfig
from kvconn.errors import ArgumentError, BackendError, ConfigError, InvalidKeyError, LayoutError
from kvconn.hashing import DIGEST_SIZE
from kvconn.keys import key_prefix, manifest_key, page_key
from kvconn.layout import NO_SLOT, KvLayout, shard_position
from kvconn.movement import PageMover, flat_bytes
from kvconn.plan import (
    PagePlan,
    RankShare,
    WriterPolicy,
    count_prefix_hit,
    lookup_keys,
    lookup_windows,
    plan_pages,
    rank_shares,
    share_key,
    writes,
)
from kvconn.redaction import redact_url
from kvconn.registry import load_backend
from kvconn.staging import Staging, StagingPool
from kvconn.stats import ConnectorStats

log = logging.getLogger("kvconn")

T = TypeVar("T")
Slots = Sequence[int] | torch.Tensor | Mapping[int, Sequence[int] | torch.Tensor]


@dataclass(frozen=True)
class LookupResult:
    """The group-wide prefix hit: the same on every rank that asks at the same time."""

    blocks: int
    tokens: int
    available: bool = True  # False: the backend could not answer; the hit reads as 0


@dataclass(frozen=True)
class SaveResult:
    written: int = 0  # pages this rank stored
    skipped: int = 0  # pages it owned but found already stored
    dropped: int = 0  # pages it owned but could not store (backend down or put refused)


@dataclass(frozen=True)
class LoadResult:
    """``loaded`` leading blocks are in the pool; ``failed`` must be recomputed.

    Slots of failed blocks are left untouched by this load.
    """

    loaded: int
    failed: tuple[int, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.failed


class _Skipped(Exception):
    """The backend is in its back-off window: treat as unavailable without asking."""


class Connector:
    """One rank's view of the store; safe to call from several threads (module docstring).

    Without pools it still answers :meth:`lookup`, which needs only the layout's
    geometry: an engine's scheduler builds one from ``KvLayout.from_dict`` and never
    holds KV tensors.
    """

    def __init__(
        self,
        config: ConnectorConfig | Mapping[str, Any],
        layout: KvLayout,
        *,
        rank: int = 0,
        pools: Sequence[torch.Tensor] | None = None,
        backend: Backend | None = None,
    ) -> None:
        if not isinstance(config, ConnectorConfig):
            config = ConnectorConfig.from_dict(config)
        if not isinstance(layout, KvLayout):
            raise LayoutError(f"layout must be a KvLayout, got {layout!r:.80}")
        if backend is not None and not isinstance(backend, Backend):
            raise ConfigError(f"backend must be a kvconn Backend instance, got {backend!r:.80}")
        shard_position(rank, layout.tp_size, 1)  # validates rank against tp_size
        self.config = config
        self.layout = layout
        self.rank = rank
        self.plans: tuple[PagePlan, ...] = plan_pages(layout, config.checksum)
        self.shares: tuple[RankShare, ...] = rank_shares(layout, self.plans, rank)
        self.prefix = key_prefix(config.namespace, config.model)
        # One manifest per page kind (two plans never share a group and fingerprint: the
        # fingerprint hashes the class). Put once, lazily, by the first save that
        # reaches the store; put never overwrites, so every rank doing it is harmless.
        self._manifests: dict[str, bytes] = {
            manifest_key(self.prefix, p.group, p.fingerprint): p.manifest.to_json()
            for p in self.plans
        }
        self._manifests_stored = False
        self.stats = ConnectorStats()
        self.backend = (
            backend if backend is not None else load_backend(config.backend, config.options)
        )
        self._check_key_length()
        self._down_until = 0.0
        self._down = False
        self._corruption_reported = False
        #: Guards back-off and manifest state; never held across a backend call.
        self._state_lock = threading.Lock()
        self._backend_guard = _call_guard(self.backend)
        self._movers: list[PageMover] | None = None
        self.pools: list[torch.Tensor] = []
        self._device = torch.device("cpu")
        self._staging = StagingPool(self.backend, pin=False, guard=self._backend_guard)
        if pools is not None:
            self.register_pools(pools)

    # ------------------------------------------------------------------ setup
    def _check_key_length(self) -> None:
        """Fail at start-up if some key would exceed the backend's limit.

        Otherwise every call would raise ``InvalidKeyError`` inside ``_call`` and read
        as a store outage: the cache silently never works and the log blames the store.
        """
        longest_hash = b"\xff" * DIGEST_SIZE
        keys = [
            page_key(
                self.prefix,
                plan.shard_class.component(plan.shard_class.shard_count - 1),
                plan.group,
                plan.fingerprint,
                longest_hash,
            )
            for plan in self.plans
        ]
        longest = max([*keys, *self._manifests], key=len)
        limit = self.backend.max_key_length
        if len(longest) > limit:
            raise ConfigError(
                f"keys would be {len(longest)} characters, over the {self.backend.name!r} "
                f"backend's limit of {limit}: shorten the model name ({self.config.model!r}) "
                f"or the namespace ({self.config.namespace!r})"
            )
        # Every key this connector makes has one of these shapes with a fixed-size hex
        # digest, so checking the shapes once vouches for every batch (VettedKeys).
        VettedKeys([*keys, *self._manifests], limit)
        self._key_limit = limit

    def _vetted(self, keys: Sequence[str]) -> VettedKeys:
        return VettedKeys.unchecked(keys, self._key_limit)

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
        self._device = pools[0].device
        self.pools = list(pools)
        self._movers = [
            PageMover(share.plan.regions, flats, self.layout.group(share.plan.group).num_slots)
            for share in self.shares
        ]
        # CUDA pools need pinned staging; nothing is allocated until the first transfer
        self._staging.release()
        self._staging = StagingPool(
            self.backend, pin=self._device.type == "cuda", guard=self._backend_guard
        )

    def close(self) -> None:
        self._staging.release()
        self.backend.close()

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lookup
    def lookup(self, block_hashes: Sequence[bytes]) -> LookupResult:
        """The longest prefix of blocks whose every needed page, for every rank, is stored.

        A page of a group with a window is needed only inside the window that ends at
        the hit (``LayerGroup.window``; :func:`kvconn.plan.count_prefix_hit`).
        """
        hashes = _check_hashes(block_hashes)
        self.stats.bump("lookups")
        if not hashes:
            return LookupResult(0, 0)
        per_block = lookup_keys(self.prefix, self.plans, hashes)
        flat = [k for keys in per_block for k in keys]
        try:
            present = self._call("exists", lambda: self.backend.exists(self._vetted(flat)))
        except _Skipped:
            self.stats.bump("lookup_errors")
            return LookupResult(0, 0, available=False)
        it = iter(present)
        blocks = count_prefix_hit(
            [[next(it) for _ in keys] for keys in per_block], lookup_windows(self.plans)
        )
        return LookupResult(blocks, blocks * self.layout.tokens_per_block)

    # ------------------------------------------------------------------ save
    def save(
        self,
        block_hashes: Sequence[bytes],
        slots: Slots,
        *,
        writer_policy: WriterPolicy | str | None = None,
    ) -> SaveResult:
        """Store the pages of these blocks that this rank is the designated writer of.

        A group's slot ``NO_SLOT`` (-1) for a block stores nothing of that group for it.

        ``writer_policy`` overrides the configured one for this call; ``"all"`` is for
        an engine that decides itself which rank saves (SGLang MLA: rank 0 only): this
        rank then writes every page it holds that is not stored yet.
        """
        hashes = _check_hashes(block_hashes)
        slot_map = self._slot_map(slots, hashes)
        movers = self._require_pools()
        policy = self.config.writer_policy
        if writer_policy is not None:
            policy = WriterPolicy.parse(writer_policy)
        owned: list[tuple[int, list[int], list[str]]] = []  # (share index, blocks, keys)
        for s, share in enumerate(self.shares):
            slots_of = slot_map[share.plan.group].tolist()
            blocks = [
                i
                for i, h in enumerate(hashes)
                if slots_of[i] != NO_SLOT and writes(share, h, policy)
            ]
            owned.append((s, blocks, [share_key(self.prefix, share, hashes[i]) for i in blocks]))
        all_keys = [k for _, _, keys in owned for k in keys]
        if not all_keys:
            return SaveResult()
        try:
            present = self._call("exists", lambda: self.backend.exists(self._vetted(all_keys)))
        except _Skipped:
            for s, blocks, _ in owned:
                self.stats.add("dropped", self.shares[s].plan, len(blocks))
            return SaveResult(dropped=len(all_keys))
        with self._staging.borrow() as staging:
            result = self._write_missing(owned, present, movers, slot_map, staging)
        return result

    def _write_missing(
        self,
        owned: Sequence[tuple[int, list[int], list[str]]],
        present: Sequence[bool],
        movers: Sequence[PageMover],
        slot_map: Mapping[int, torch.Tensor],
        staging: Staging,
    ) -> SaveResult:
        written = skipped = dropped = 0
        pos = 0
        for s, blocks, keys in owned:
            plan = self.shares[s].plan
            flags = present[pos : pos + len(keys)]
            pos += len(keys)
            todo = [(b, k) for b, k, there in zip(blocks, keys, flags) if not there]
            todo = list(dict(((k, (b, k)) for b, k in todo)).values())  # a block twice: once
            skipped_here = len(keys) - len(todo)
            self.stats.add("skipped", plan, skipped_here)
            skipped += skipped_here
            chunk = self._chunk_blocks(plan.value_size)
            for start in range(0, len(todo), chunk):
                part = todo[start : start + chunk]
                ok = self._put_pages(s, movers[s], slot_map, part, staging)
                self.stats.add("written", plan, ok)
                self.stats.add("dropped", plan, len(part) - ok)
                written += ok
                dropped += len(part) - ok
        if not self._manifests_stored:
            self._store_manifests(staging)
        return SaveResult(written, skipped, dropped)

    def _store_manifests(self, staging: Staging) -> None:
        """Put every page kind's layout manifest in one batch; on failure, a later save retries.

        Runs after the save's own pages, so its failure cannot cost this save a page, and
        it is not a page: nothing is counted as written or dropped. A backend error is
        still a backend error (counted, logged once, backed off), like any other call.
        """
        keys = list(self._manifests)
        # Put from the staging buffer, like pages: a zero-copy store (Mooncake) then moves
        # them from its registered memory instead of copying through scratch space.
        _, view = staging.take(sum(len(v) for v in self._manifests.values()))
        values: list[memoryview] = []
        offset = 0
        for value in self._manifests.values():
            view[offset : offset + len(value)] = value
            values.append(view[offset : offset + len(value)])
            offset += len(value)
        try:
            stored = self._call("put", lambda: self.backend.put(self._vetted(keys), values))
        except _Skipped:
            return
        with self._state_lock:  # a concurrent save may have stored them meanwhile
            self._manifests_stored = self._manifests_stored or all(stored)
        if not all(stored):
            log.debug("kvconn: a layout manifest put was refused; a later save retries")

    def _put_pages(
        self,
        s: int,
        mover: PageMover,
        slot_map: Mapping[int, torch.Tensor],
        part: Sequence[tuple[int, str]],
        staging: Staging,
    ) -> int:
        plan = self.shares[s].plan
        n, row = len(part), plan.value_size
        buffer, view = staging.take(n * row)
        index = slot_map[plan.group][torch.tensor([b for b, _ in part], dtype=torch.long)]
        self._gather_rows(mover, index, buffer[: n * row].view(n, row), plan.page_size)
        values = [view[i * row : (i + 1) * row] for i in range(n)]
        keys = [k for _, k in part]
        plan.checksum.seal(values, keys)
        try:
            return sum(self._call("put", lambda: self.backend.put(self._vetted(keys), values)))
        except _Skipped:
            return 0

    def _gather_rows(
        self, mover: PageMover, index: torch.Tensor, rows: torch.Tensor, size: int
    ) -> None:
        """Gather pages into the first ``size`` bytes of each staging row (the rest: the
        checksum, written after)."""
        if self._device.type == "cpu" or rows.shape[1] == size:
            mover.gather(index.to(self._device), rows[:, :size])
        else:
            # Gather into rows of the same shape on the device, then copy them whole: a
            # copy into strided pinned memory would go through a bounce buffer.
            on_device = torch.empty(rows.shape, dtype=torch.uint8, device=self._device)
            mover.gather(index.to(self._device), on_device[:, :size])
            rows.copy_(on_device, non_blocking=True)
        self._sync()

    # ------------------------------------------------------------------ load
    def load(self, block_hashes: Sequence[bytes], slots: Slots) -> LoadResult:
        """Load this rank's pages of a hit prefix into its slots.

        A block is loaded only if every one of its pages arrived whole and passed its
        checksum; the first block that did not, and every block after it, are returned as
        failed and their slots are not written, so the engine recomputes exactly those.
        A group's slot ``NO_SLOT`` (-1) for a block loads nothing of that group for it
        and is not needed for the block to count as loaded.
        """
        hashes = _check_hashes(block_hashes)
        slot_map = self._slot_map(slots, hashes)
        movers = self._require_pools()
        per_block = sum(sh.plan.value_size for sh in self.shares)
        chunk = self._chunk_blocks(per_block, padding=_STAGING_ALIGN * len(self.shares))
        loaded = 0
        with self._staging.borrow() as staging:
            for start in range(0, len(hashes), chunk):
                stop = min(start + chunk, len(hashes))
                good = self._load_chunk(hashes, start, stop, slot_map, movers, staging)
                loaded += good
                if start + good < stop:
                    break
        failed = tuple(range(loaded, len(hashes)))
        if failed:
            for share in self.shares:
                self.stats.add("failed", share.plan, len(failed))
        return LoadResult(loaded, failed)

    def _load_chunk(
        self,
        hashes: Sequence[bytes],
        start: int,
        stop: int,
        slot_map: Mapping[int, torch.Tensor],
        movers: Sequence[PageMover],
        staging: Staging,
    ) -> int:
        n = stop - start
        # Per page kind, the blocks of the chunk (0..n-1) it has a slot for: a group
        # without a slot for a block (NO_SLOT) neither reads nor needs that page.
        wanted: list[list[int]] = []
        for share in self.shares:
            slots_of = slot_map[share.plan.group][start:stop].tolist()
            wanted.append([i for i, slot in enumerate(slots_of) if slot != NO_SLOT])
        # Each page kind starts on an aligned boundary, so its pages can be read as the
        # pool's words in place (an odd page size would otherwise misalign the next).
        # A value is a row: the page, then its checksum.
        offsets: list[int] = []
        total = 0
        for share, blocks in zip(self.shares, wanted):
            offsets.append(total)
            total = _aligned(total + len(blocks) * share.plan.value_size)
        buffer, view = staging.take(total)
        keys: list[str] = []
        buffers: list[memoryview] = []
        for share, offset, blocks in zip(self.shares, offsets, wanted):
            row = share.plan.value_size
            for k, i in enumerate(blocks):
                keys.append(share_key(self.prefix, share, hashes[start + i]))
                buffers.append(view[offset + k * row : offset + (k + 1) * row])
        if not keys:
            return n
        # Scratch: staging pages of keys that fail are never scattered (below).
        try:
            arrived = self._call(
                "get", lambda: self.backend.get(self._vetted(keys), buffers, scratch=True)
            )
        except _Skipped:
            return 0
        counts = [len(blocks) for blocks in wanted]
        ok = self._usable(keys, buffers, arrived, counts)
        good = n
        pos = 0
        for blocks in wanted:
            flags = ok[pos : pos + len(blocks)]
            pos += len(blocks)
            good = min(good, next((blocks[k] for k, f in enumerate(flags) if not f), n))
        if good == 0:
            return 0
        for s, (share, blocks) in enumerate(zip(self.shares, wanted)):
            count = sum(1 for i in blocks if i < good)  # blocks ascend: a prefix of rows
            if count == 0:
                continue
            size, row = share.plan.page_size, share.plan.value_size
            rows = buffer[offsets[s] : offsets[s] + count * row].view(count, row)
            if rows.device != self._device:  # whole rows: one contiguous host-to-device copy
                rows = rows.to(self._device, non_blocking=True)
            chunk_slots = slot_map[share.plan.group][start:stop]
            index = chunk_slots[torch.tensor(blocks[:count], dtype=torch.long)]
            movers[s].scatter(index.to(self._device), rows[:, :size])
            self.stats.add("loaded", share.plan, count)
        self._sync()
        return good

    def _usable(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        arrived: Sequence[bool],
        counts: Sequence[int],
    ) -> list[bool]:
        """Per page of a get (``counts[s]`` of page kind ``s``, kinds in order), whether it
        arrived whole and verified.

        Every page that arrived is verified, also after the first failure: a bad page
        found now is repaired now, before the save that follows the engine's recompute
        would skip it as already stored.
        """
        usable = list(arrived)
        damaged: dict[str, PagePlan] = {}
        unread: dict[str, PagePlan] = {}
        pos = 0
        for share, count in zip(self.shares, counts):
            here = range(pos, pos + count)
            pos += count
            got = [i for i in here if arrived[i]]
            checks = share.plan.checksum.verify([buffers[i] for i in got], [keys[i] for i in got])
            for i, verified in zip(got, checks):
                if not verified:
                    usable[i] = False
                    damaged[keys[i]] = share.plan
            unread.update((keys[i], share.plan) for i in here if not arrived[i])
        if damaged or unread:
            self._repair(damaged, unread)
        return usable

    def _repair(self, damaged: dict[str, PagePlan], unread: Mapping[str, PagePlan]) -> None:
        """Delete stored pages that cannot be loaded, so the next save rewrites them.

        ``damaged`` pages arrived with a wrong checksum. ``unread`` ones did not arrive:
        those still stored are unreadable (a value of the wrong size), the others were
        evicted since the lookup, which is no fault of theirs. A backend error while
        asking or deleting is a backend error (counted, backed off), never corruption.
        Without ``Capabilities.delete`` the pages are counted and logged, and fail until
        the store drops them: a put never overwrites.
        """
        if unread:
            asked = list(unread)
            try:
                stored = self._call("exists", lambda: self.backend.exists(self._vetted(asked)))
            except _Skipped:
                stored = [False] * len(asked)
            damaged.update((k, unread[k]) for k, there in zip(asked, stored) if there)
        if not damaged:
            return
        for plan, count in Counter(damaged.values()).items():
            self.stats.add("corrupt", plan, count)
        keys = list(damaged)
        can_delete = self.backend.capabilities.delete
        self._report_corruption(keys, can_delete)
        if not can_delete:
            return
        try:
            deleted = self._call("delete", lambda: self.backend.delete(self._vetted(keys)))
        except _Skipped:
            return
        for plan, count in Counter(damaged[k] for k, gone in zip(keys, deleted) if gone).items():
            self.stats.add("repaired", plan, count)

    def _report_corruption(self, keys: Sequence[str], can_delete: bool) -> None:
        """A warning the first time, then debug: the ``corrupt`` counter keeps the count."""
        with self._state_lock:
            first, self._corruption_reported = not self._corruption_reported, True
        what = (
            "deleting them so the next save rewrites them"
            if can_delete
            else f"the {self.backend.name!r} backend cannot delete, so they fail until the "
            "store drops them"
        )
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "kvconn: %d stored page(s) failed their checksum or could not be read (first: %s); %s",
            len(keys),
            keys[0],
            what,
        )

    # ------------------------------------------------------------------ helpers
    def _call(self, op: str, fn: Callable[[], T]) -> T:
        """Run a backend call; on failure log, count, back off and raise ``_Skipped``."""
        if time.monotonic() < self._down_until:
            raise _Skipped
        try:
            with self._backend_guard:
                result = fn()
        except InvalidKeyError:
            raise  # our own key is at fault, not the store: never hide it as an outage
        except Exception as exc:
            self.stats.bump("backend_errors")
            with self._state_lock:
                # From the failure, not the start: a call that timed out after longer
                # than the interval must still leave a window in which no call waits.
                self._down_until = time.monotonic() + self.config.retry_interval_s
                first = not self._down
                self._down = True
            if first:
                log.warning(
                    "kvconn: backend %r failed in %s (%s); serving without the cache, "
                    "retrying after %.1fs",
                    self.config.backend,
                    op,
                    redact_url(str(exc)),
                    self.config.retry_interval_s,
                    exc_info=not isinstance(exc, (OSError, BackendError)),
                )
            raise _Skipped from exc
        if self._down:
            with self._state_lock:
                recovered, self._down = self._down, False
            if recovered:
                log.info("kvconn: backend %r answers again", self.config.backend)
        return result

    def _chunk_blocks(self, bytes_per_block: int, padding: int = 0) -> int:
        """Blocks per chunk so that a chunk (plus ``padding``) fits ``staging_bytes``."""
        room = self.config.staging_bytes - padding
        return max(1, room // max(1, bytes_per_block))

    def _require_pools(self) -> list[PageMover]:
        if self._movers is None:
            raise ConfigError("this connector has no KV pools: pass pools= or call register_pools")
        return self._movers

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _slot_map(self, slots: Slots, hashes: Sequence[bytes]) -> dict[int, torch.Tensor]:
        """Each layer group's slots, one per block, as a CPU long tensor.

        Refused before anything is read or written: a count other than one slot per
        block, a slot outside its group, and one slot named for two different blocks --
        a load would leave only the last of them in it while reporting both loaded, and
        a save would store that slot's bytes under both blocks' keys. (The same block
        twice in one slot is harmless and allowed.) ``NO_SLOT`` (-1) is allowed any number
        of times: the group has no slot for that block.
        """
        groups = [g.index for g in self.layout.groups]
        if isinstance(slots, Mapping):
            missing = sorted(set(groups) - set(slots))
            if missing:
                raise ArgumentError(f"slots are missing for layer group(s) {missing}")
            unknown = sorted(map(repr, set(slots) - set(groups)))
            if unknown:
                raise ArgumentError(
                    f"slots name layer group(s) {', '.join(unknown)} that the layout does not "
                    f"have (its groups: {groups})"
                )
        # One conversion per distinct sequence: usually one list serves every group.
        converted: dict[int, tuple[torch.Tensor, list[int]]] = {}
        out: dict[int, torch.Tensor] = {}
        for g in groups:
            seq = slots[g] if isinstance(slots, Mapping) else slots
            if id(seq) not in converted:
                converted[id(seq)] = _slot_list(seq, g, hashes)
            t, values = converted[id(seq)]
            num_slots = self.layout.group(g).num_slots
            if values and (min(values) < NO_SLOT or max(values) >= num_slots):
                raise ArgumentError(
                    f"layer group {g}: slot out of range [0, {num_slots}) "
                    f"(or NO_SLOT, {NO_SLOT}): {values[:8]}"
                )
            out[g] = t
        return out


def _slot_list(seq: object, g: int, hashes: Sequence[bytes]) -> tuple[torch.Tensor, list[int]]:
    """``seq`` as a 1-D long tensor and a list, one slot per block, no slot shared."""
    n = len(hashes)
    if isinstance(seq, (str, bytes, bytearray)):
        raise ArgumentError(f"layer group {g}: slots must be a sequence of ints, got {seq!r:.80}")
    try:
        given = torch.as_tensor(seq)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ArgumentError(
            f"layer group {g}: slots must be a sequence of ints, got {seq!r:.80}"
        ) from None
    if given.dim() != 1:
        raise ArgumentError(
            f"layer group {g}: slots must be one-dimensional, one per block, "
            f"got shape {tuple(given.shape)}"
        )
    if given.numel() and (
        given.is_floating_point() or given.is_complex() or given.dtype == torch.bool
    ):
        raise ArgumentError(f"layer group {g}: slots must be integers, got {given.dtype}")
    t = given.to(torch.long).cpu()
    if t.numel() != n:
        raise ArgumentError(f"layer group {g}: {t.numel()} slots for {n} blocks")
    values: list[int] = t.tolist()
    if len(set(values)) < n:
        owner: dict[int, bytes] = {}
        for i, (slot, h) in enumerate(zip(values, hashes)):
            if slot != NO_SLOT and owner.setdefault(slot, h) != h:
                raise ArgumentError(
                    f"layer group {g}: slot {slot} is given for two different blocks "
                    f"(block {values.index(slot)} and block {i}); each block needs its own slot"
                )
    return t, values


#: Where each page kind starts in a load's staging: a multiple of every word width.
_STAGING_ALIGN = 64

#: One lock per backend object that is not thread-safe, shared by every connector over it
#: (a TP group in one process may share a backend); weak, so a closed backend goes.
_BACKEND_LOCKS: weakref.WeakKeyDictionary[Backend, threading.Lock] = weakref.WeakKeyDictionary()
_BACKEND_LOCKS_LOCK = threading.Lock()


def _call_guard(backend: Backend) -> contextlib.AbstractContextManager[object]:
    """What to hold around a call to ``backend``: nothing when it declares thread safety."""
    if backend.capabilities.thread_safe:
        return contextlib.nullcontext()
    with _BACKEND_LOCKS_LOCK:
        try:
            return _BACKEND_LOCKS.setdefault(backend, threading.Lock())
        except TypeError:  # not weak-referenceable (__slots__): a lock of its own
            return threading.Lock()


def _check_hashes(block_hashes: Sequence[bytes]) -> list[bytes]:
    if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(block_hashes, Iterable):
        raise ArgumentError(
            f"block_hashes must be a list of {DIGEST_SIZE}-byte digests (kvconn.block_hashes), "
            f"got {block_hashes!r:.80}"
        )
    hashes = list(block_hashes)
    for h in hashes:
        if not isinstance(h, (bytes, bytearray)) or len(h) != DIGEST_SIZE:
            raise ArgumentError(
                f"block hashes are {DIGEST_SIZE}-byte digests (kvconn.hashing), got {h!r:.80}"
            )
    return [bytes(h) for h in hashes]


def _aligned(offset: int) -> int:
    return -(-offset // _STAGING_ALIGN) * _STAGING_ALIGN
