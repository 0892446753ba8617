"""The key and hit planner, and lookups: torch-free, for an engine's scheduler.

An engine's scheduler decides prefix hits for the whole TP group without holding a KV
tensor (vLLM's scheduler process, TensorRT-LLM's rank-0 scheduler, a router). It needs
the page keys of every rank and the hit rule, nothing else:

* :class:`PageKeys` is the public planner: the page kinds of a layout under one
  configuration, the keys of a block's pages (all of them, or one rank's), and the keys
  a lookup checks;
* :class:`Lookup` answers ``lookup(block_hashes)`` from one batched ``exists``
  (DESIGN rule 3), with the same back-off as the connector;
* :class:`DeadlineLookup` answers within a deadline: a scheduler asks, and a store
  that is slow to answer gets "ask again later" and then a miss, never a blocked
  scheduler loop.

Nothing here imports torch or allocates staging memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvconn.backend import Backend
from kvconn.calls import BackendCalls, Unavailable
from kvconn.config import ConnectorConfig
from kvconn.errors import ArgumentError, ConfigError, ConnectorClosed, LayoutError
from kvconn.hashing import DIGEST_SIZE
from kvconn.keys import key_prefix, manifest_key, page_key, per_rank_key
from kvconn.layout import KvLayout, Window, shard_position
from kvconn.lograte import DEFAULT_INTERVAL_S, LogInterval
from kvconn.plan import (
    PagePlan,
    RankShare,
    count_prefix_hit,
    lookup_keys,
    lookup_windows,
    plan_pages,
    rank_shares,
    restorable_prefixes,
    share_key,
)
from kvconn.registry import load_backend
from kvconn.replicas import SharedKind, per_rank_plan, per_rank_share, shared_kinds
from kvconn.results import LookupResult
from kvconn.stats import ConnectorStats

log = logging.getLogger("kvconn")

__all__ = ["DeadlineLookup", "Lookup", "LookupResult", "PageKeys", "check_hashes"]


class PageKeys:
    """Every page key of a layout under one configuration.

    Pure: any process that builds it from the same configuration and layout (the
    scheduler, every rank, another instance) derives the same keys without talking.

    ``per_rank``: indices of page kinds several ranks hold that are keyed per rank
    instead, because their holders were found holding different bytes
    (:mod:`kvconn.replicas`); :meth:`with_per_rank` derives such a planner.
    """

    def __init__(
        self,
        config: ConnectorConfig | Mapping[str, Any],
        layout: KvLayout,
        *,
        per_rank: Iterable[int] = (),
    ) -> None:
        if not isinstance(config, ConnectorConfig):
            config = ConnectorConfig.from_dict(config)
        if not isinstance(layout, KvLayout):
            raise LayoutError(f"layout must be a KvLayout, got {layout!r:.80}")
        self.config = config
        self.layout = layout
        self.prefix = key_prefix(config.namespace, config.model)
        #: The page kinds as planned, shared pages under shared keys.
        self.planned: tuple[PagePlan, ...] = plan_pages(layout, config.checksum, config.shard_heads)
        #: The kinds several ranks hold (``dup > 1``): what replica checks compare.
        self.shared: tuple[SharedKind, ...] = shared_kinds(layout.tp_size, self.planned)
        #: Each shared kind's marker key (:func:`kvconn.keys.per_rank_key`), by index.
        self.markers: dict[int, str] = {
            k.index: per_rank_key(self.prefix, k.plan.group, k.plan.fingerprint)
            for k in self.shared
        }
        self.per_rank = frozenset(per_rank)
        if not self.per_rank <= set(self.markers):
            raise ValueError(
                f"only page kinds several ranks hold can be keyed per rank: "
                f"{sorted(self.per_rank - set(self.markers))} are not"
            )
        #: The page kinds as keyed now: a kind in ``per_rank`` by its per-rank plan.
        self.plans: tuple[PagePlan, ...] = tuple(
            per_rank_plan(p, layout.tp_size) if i in self.per_rank else p
            for i, p in enumerate(self.planned)
        )
        #: One layout manifest per planned page kind (two plans never share a group and
        #: fingerprint: the fingerprint hashes the class), key -> JSON value.
        self.manifests: dict[str, bytes] = {
            manifest_key(self.prefix, p.group, p.fingerprint): p.manifest.to_json()
            for p in self.planned
        }
        #: Each lookup key's window, in :meth:`block_keys` order (None: every block).
        self.windows = lookup_windows(self.plans)

    def with_per_rank(self, kinds: Iterable[int]) -> PageKeys:
        """This planner with the shared kinds ``kinds`` keyed per rank as well."""
        return PageKeys(self.config, self.layout, per_rank=self.per_rank | set(kinds))

    def block_keys(self, block_hash: bytes) -> list[str]:
        """Keys of every page any rank loads for this block: what a lookup checks."""
        return lookup_keys(self.prefix, self.plans, [_digest(block_hash)])[0]

    def lookup_keys(self, block_hashes: Sequence[bytes]) -> list[list[str]]:
        """Per block, the keys a lookup checks (every shard, every group)."""
        return lookup_keys(self.prefix, self.plans, check_hashes(block_hashes))

    def shares(self, rank: int) -> tuple[RankShare, ...]:
        """Per page ``rank`` holds of a block (one per page kind, or ``shard_heads /
        num_shards`` of a kind cut finer than its shard), the shard it loads and its
        replica position for writing."""
        shard_position(rank, self.layout.tp_size, 1)  # validates rank against tp_size
        shares: list[RankShare] = []
        for i, plan in enumerate(self.plans):
            if i in self.per_rank:
                shares.append(per_rank_share(plan, rank))
            else:  # ``parts`` pages of a kind cut finer than the rank's shard
                shares.extend(rank_shares(self.layout, (plan,), rank))
        return tuple(shares)

    def rank_keys(self, rank: int, block_hash: bytes) -> list[str]:
        """Keys of the pages ``rank`` loads for this block, in :meth:`shares` order."""
        digest = _digest(block_hash)
        return [share_key(self.prefix, share, digest) for share in self.shares(rank)]

    def hit(self, per_block_present: Sequence[Sequence[bool]]) -> int:
        """The hit in blocks from what a lookup found (DESIGN rule 3): the largest N whose
        every needed page is present, a sliding-window group's pages needed only inside
        the window that ends at N (``LayerGroup.window``)."""
        return count_prefix_hit(per_block_present, self.windows)

    def key_shapes(self) -> list[str]:
        """The longest key of every shape made here, for a backend's length check."""
        longest_hash = b"\xff" * DIGEST_SIZE
        pages = [
            page_key(
                self.prefix,
                plan.shard_class.component(plan.shard_class.shard_count - 1),
                plan.group,
                plan.fingerprint,
                longest_hash,
            )
            for plan in self.plans
        ]
        # what a fall-back to per-rank keys would make (kvconn.replicas), checked now too
        tp = self.layout.tp_size
        per_rank = [
            page_key(
                self.prefix,
                plan.shard_class.component(tp - 1),
                plan.group,
                plan.fingerprint,
                longest_hash,
            )
            for plan in (per_rank_plan(k.plan, tp) for k in self.shared)
        ]
        return [*pages, *self.manifests, *per_rank, *self.markers.values()]


class Lookup:
    """Answers the group-wide prefix hit from one batched ``exists``; no tensors.

    Shares a :class:`BackendCalls` (back-off, serialization) with the connector that
    built it, or owns a backend of its own when built alone (a scheduler process).

    ``follow_markers`` (a scheduler's lookup): every lookup also asks for the per-rank
    markers of the shared page kinds it still keys shared (one key per kind, in the same
    ``exists``). A marker found means the ranks key that kind per rank now
    (:mod:`kvconn.replicas`): the lookup switches to the per-rank keys for good and asks
    again, so its hits are the pages the ranks will load. A connector's own lookup does
    not follow markers: its keys change with its ranks', at their checks.

    ``stages``: under pipeline parallelism, the layouts of the other stages (``layout``
    is one stage's). Each stage's ranks hold other layers, hence other pages; a block is
    a hit only where every stage holds its pages (the smallest of the stages' hits),
    still from one batched ``exists``.
    """

    def __init__(
        self,
        config: ConnectorConfig | Mapping[str, Any],
        layout: KvLayout,
        *,
        backend: Backend | None = None,
        keys: PageKeys | None = None,
        calls: BackendCalls | None = None,
        follow_markers: bool = True,
        stages: Sequence[KvLayout] = (),
    ) -> None:
        self.keys = keys if keys is not None else PageKeys(config, layout)
        self.config = self.keys.config
        self.layout = self.keys.layout
        #: The other pipeline stages' planners (``keys`` is the first stage's).
        self.stages: tuple[PageKeys, ...] = tuple(
            PageKeys(self.config, _stage_layout(stage, self.layout)) for stage in stages
        )
        if calls is None:
            if backend is not None and not isinstance(backend, Backend):
                raise ConfigError(f"backend must be a kvconn Backend instance, got {backend!r:.80}")
            if backend is None:
                backend = load_backend(
                    self.config.backend, self.config.options, key_prefix=self.keys.prefix
                )
            calls = BackendCalls(
                backend,
                name=self.config.backend,
                retry_interval_s=self.config.retry_interval_s,
                stats=ConnectorStats(),
            )
            calls.check_keys(
                [shape for keys in (self.keys, *self.stages) for shape in keys.key_shapes()],
                model=self.config.model,
                namespace=self.config.namespace,
            )
            self._owns_backend = True
        else:
            self._owns_backend = False
        self.calls = calls
        self.stats = calls.stats
        self.closed = False
        self.follow_markers = follow_markers

    @property
    def backend(self) -> Backend:
        return self.calls.backend

    def lookup(
        self,
        block_hashes: Sequence[bytes],
        *,
        windows: Mapping[int, int | None] | None = None,
    ) -> LookupResult:
        """The longest prefix of blocks whose every page, for every rank, is stored.

        ``windows`` overrides, per layer group, the window the layout gives it
        (``LayerGroup.window``) for this lookup: ``None`` needs the group's pages for
        every block of the hit, ``W >= 1`` only for the last ``W`` blocks, and ``0`` not
        at all (none of its keys is asked). An engine whose reader decides per request
        how far back it needs a sliding-window pool (SGLang's ``trailing_pages``) asks
        so. With any window in effect the result lists every restorable prefix.
        """
        return self.lookup_checked(check_hashes(block_hashes), windows=windows)

    def lookup_checked(
        self, hashes: list[bytes], *, windows: Mapping[int, int | None] | None = None
    ) -> LookupResult:
        """:meth:`lookup` of hashes that :func:`check_hashes` passed already (a caller
        that checks them on the engine's thread, then asks on another)."""
        if self.closed:
            raise ConnectorClosed("lookup on a closed kvconn connector")
        overrides = self._window_overrides(windows)
        self.stats.bump("lookups")
        if not hashes:
            return LookupResult(0, 0)
        while True:  # twice at most per marker: markers only add per-rank kinds
            stages = (self.keys, *self.stages)
            watched = (
                [
                    (stage, i, k)
                    for stage, keys in enumerate(stages)
                    for i, k in keys.markers.items()
                    if i not in keys.per_rank
                ]
                if self.follow_markers
                else []
            )
            # a group whose window is 0 is not needed: none of its keys is asked
            asked = [[p for p in keys.plans if overrides[p.group] != 0] for keys in stages]
            per_stage = [
                lookup_keys(keys.prefix, plans, hashes) for keys, plans in zip(stages, asked)
            ]
            flat = [k for per_block in per_stage for block in per_block for k in block]
            try:
                present = self.calls.exists([*flat, *(k for _, _, k in watched)])
            except Unavailable:
                self.stats.bump("lookup_errors")
                return LookupResult(0, 0, available=False)
            marked: dict[int, list[int]] = {}
            for (stage, i, _), there in zip(watched, present[len(flat) :]):
                if there:
                    marked.setdefault(stage, []).append(i)
            if not marked:
                break
            renewed = [
                keys.with_per_rank(marked[stage]) if stage in marked else keys
                for stage, keys in enumerate(stages)
            ]
            self.keys, self.stages = renewed[0], tuple(renewed[1:])
            log.warning(
                "kvconn: page kind(s) %s are kept per rank (their ranks were found holding "
                "different bytes); lookups ask for per-rank pages from now on",
                ", ".join(
                    stages[stage].planned[i].label
                    for stage, kinds in sorted(marked.items())
                    for i in sorted(kinds)
                ),
            )
        it = iter(present)
        rows = [[[next(it) for _ in block] for block in per_block] for per_block in per_stage]
        page_windows = [lookup_windows(plans, overrides) for plans in asked]
        tokens = self.layout.tokens_per_block
        if all(w is None for stage in page_windows for w in stage):  # a prefix: the shortest
            blocks = min(count_prefix_hit(r, w) for r, w in zip(rows, page_windows))
            return LookupResult(blocks, blocks * tokens)
        # with windows, the lengths every stage can restore (N may be one, N - 1 not)
        common = set.intersection(
            *(set(restorable_prefixes(r, w)) for r, w in zip(rows, page_windows))
        )
        ends = tuple(sorted(common))
        blocks = ends[-1] if ends else 0
        return LookupResult(blocks, blocks * tokens, restorable=ends)

    def _window_overrides(self, windows: Mapping[int, int | None] | None) -> dict[int, Window]:
        """``windows`` checked against the layout's groups (an :class:`ArgumentError`
        naming the group otherwise); what every group's window is for this lookup."""
        groups: dict[int, Window] = {g.index: g.window for g in self.layout.groups}
        if windows is None:
            return groups
        for group, window in windows.items():
            if group not in groups:
                raise ArgumentError(
                    f"windows names layer group {group!r}; the layout's groups are {sorted(groups)}"
                )
            if window is not None and (
                isinstance(window, bool) or not isinstance(window, int) or window < 0
            ):
                raise ArgumentError(
                    f"the window of layer group {group} must be None (every block), 0 (not "
                    f"needed) or a number of blocks >= 1, got {window!r}"
                )
        merged = groups | dict(windows)
        if all(w == 0 for w in merged.values()):
            raise ArgumentError("windows leave no layer group a lookup needs (all are 0)")
        return merged

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._owns_backend:
            self.calls.backend.close()

    def __enter__(self) -> Lookup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeadlineLookup:
    """Lookups a scheduler may ask without ever waiting on a slow store.

    ``ask(tag, hashes)`` starts a lookup in a background thread and waits for it at most
    ``wait_s``. If the answer is not in by then it returns ``None`` ("ask again later",
    vLLM's contract for ``get_num_new_matched_tokens``); asking again with the same tag
    returns the answer once it has come. A lookup still unanswered ``timeout_s`` after it
    started is answered as a miss (``available=False``). With more than ``max_pending``
    lookups unanswered, or while a lookup that timed out is still unanswered (the store
    has stalled), new ones are misses at once: a stalled store must not queue up work,
    nor keep the scheduler waiting once per request (TensorRT-LLM's scheduler cannot be
    asked again later, so it waits up to ``timeout_s``: only its first request after a
    stall does). If that late lookup then fails (a silent server behind a client timeout),
    new ones stay misses at once while one at a time asks the store in the background,
    until one is answered in full: else every client timeout and back-off would make one
    more request wait. A timed-out or forgotten lookup that no thread has started is
    cancelled; one that a thread runs, forgotten and unanswered past ``timeout_s``,
    counts as timed out (the request went away, not the evidence that the store hangs).

    A store that answers from this host (``Capabilities.local``, LMDB) is asked on the
    caller's thread instead, unless ``lookup_inline`` is false: its answer (0.2 ms for 63
    blocks) is quicker than the hand-off to a lookup thread and back (0.4 ms, and 1.2 ms
    for a new process's first lookup; ``benchmarks/bench_lookup.py``). ``inline`` says
    whether it still is: after ``SLOW_INLINE_ANSWERS`` answers in a row slower than
    ``wait_s`` and than ``SLOW_INLINE_S`` (a disk that has stopped being quick), lookups
    go to the thread and the deadline for good. A disk that hangs holds the caller for
    that one answer, as a file check on the same disk would.

    A miss served because the store was late is logged (at most once per
    ``log_interval_s``, a minute by default, with the count so far), and so is how long
    that store then took to answer: a hit that became a recompute is otherwise
    invisible, and "late by 10 ms" and "hung for a minute" call for different fixes.
    """

    #: Inline answers in a row, each slower than ``wait_s`` and ``SLOW_INLINE_S``,
    #: after which a local store is asked on the lookup thread: more than one, so one
    #: unlucky answer does not cost every later lookup a hand-off.
    SLOW_INLINE_ANSWERS = 3
    #: What a stalled disk costs, not a busy CPU: ~250x a 63-block LMDB lookup. A lookup
    #: slowed by the GIL or by the CPUs' other work (2.2 ms seen three times in a row on
    #: a 2-CPU machine) would be slower still through a thread, so it stays here.
    SLOW_INLINE_S = 0.05

    def __init__(
        self,
        lookup: Lookup,
        *,
        wait_s: float | None = None,
        timeout_s: float | None = None,
        threads: int = 2,
        max_pending: int = 64,
        log_interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.lookup = lookup
        self.wait_s = lookup.config.lookup_wait_s if wait_s is None else wait_s
        self.timeout_s = lookup.config.lookup_timeout_s if timeout_s is None else timeout_s
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvconn-lookup")
        self._lock = threading.Lock()
        self._pending: dict[Hashable, tuple[float, Future[LookupResult]]] = {}
        #: lookups answered as misses for being late that the store has not answered yet
        self._overdue: set[Future[LookupResult]] = set()
        #: forgotten lookups a thread was running, by when they were asked: one the store
        #: has not answered within ``timeout_s`` is as overdue as one that timed out
        self._orphans: dict[Future[LookupResult], float] = {}
        #: a lookup was late and no lookup since has been answered in full: the store
        #: may time out every call (a silent server), so new ones probe it, one at a time
        self._stalled = False
        self.timed_out = 0  # lookups answered as misses because the store was too slow
        self._late_log = LogInterval(log_interval_s)
        caps = lookup.backend.capabilities
        # thread_safe too: once inline is off, the lookup thread calls the store as well
        self.inline = lookup.config.lookup_inline and caps.local and caps.thread_safe
        self._slow_s = max(self.wait_s, self.SLOW_INLINE_S)  # an inline answer this slow counts
        self._slow_in_a_row = 0

    def ask(self, tag: Hashable, block_hashes: Sequence[bytes]) -> LookupResult | None:
        """The hit for ``block_hashes``, ``None`` to be asked again, or a miss when late.

        The hashes of a repeated ask are not compared with the first: a tag names one
        question until it is answered (or :meth:`forget` drops it).
        """
        probe = None
        with self._lock:
            entry = self._pending.get(tag)
            if entry is None:
                if self.lookup.calls.down:
                    return LookupResult(0, 0, available=False)  # back-off: no thread needed
                if self._orphans:
                    self._adopt_late_orphans()
                if self._overdue:
                    self.timed_out += 1
                    self._log_late(
                        f"{len(self._overdue)} lookups are still unanswered after "
                        f"lookup_timeout_s ({self.timeout_s * 1000:.0f} ms)"
                    )
                    return LookupResult(0, 0, available=False)
                if len(self._pending) >= self.max_pending:
                    self.timed_out += 1
                    self._log_late(f"{len(self._pending)} lookups are still unanswered")
                    return LookupResult(0, 0, available=False)
                hashes = check_hashes(block_hashes)
                if self._stalled and not self.inline:
                    # the late one failed (a client timeout): waiting on the next one
                    # would likely cost the caller timeout_s again; it probes instead
                    self.timed_out += 1
                    self._log_late(
                        "a lookup that was late then failed; the store is asked again "
                        "in the background"
                    )
                    probe = self._pool.submit(self.lookup.lookup_checked, hashes)
                    self._overdue.add(probe)
                elif not self.inline:
                    entry = (
                        time.monotonic(),
                        self._pool.submit(self.lookup.lookup_checked, hashes),
                    )
                    self._pending[tag] = entry
        if probe is not None:  # outside the lock: it runs at once if the probe is done
            probe.add_done_callback(self._answered)
            return LookupResult(0, 0, available=False)
        if entry is None:
            return self._ask_here(hashes)
        started, future = entry
        remaining = self.wait_s - (time.monotonic() - started)
        if not future.done() and remaining > 0:
            with contextlib.suppress(Exception):  # read below, with the other outcomes
                future.result(timeout=remaining)
        if future.done():
            with self._lock:
                self._pending.pop(tag, None)
            exc = future.exception()
            if exc is not None:
                raise exc
            return future.result()
        if time.monotonic() - started >= self.timeout_s:
            with self._lock:
                self._pending.pop(tag, None)
                self.timed_out += 1
                logged = self._log_late(
                    f"a lookup got no answer within lookup_timeout_s "
                    f"({self.timeout_s * 1000:.0f} ms)"
                )
                overdue = not future.cancel()  # cancelled: it had not started
                if overdue:
                    self._overdue.add(future)
                    self._stalled = True
            # outside the lock: a callback runs at once if the lookup has just finished
            if overdue:
                future.add_done_callback(self._answered)
            if logged and overdue:
                future.add_done_callback(lambda f: self._log_answered_late(f, started))
            return LookupResult(0, 0, available=False)
        return None

    def _answered(self, future: Future[LookupResult]) -> None:
        """An overdue, probing or forgotten lookup has come back: the store answers again,
        in full unless it failed the lookup (a call that timed out in the client)."""
        whole = not future.cancelled() and future.exception() is None and future.result().available
        with self._lock:
            self._overdue.discard(future)
            self._orphans.pop(future, None)
            if whole:
                self._stalled = False

    def _adopt_late_orphans(self) -> None:
        """Count forgotten lookups unanswered past ``timeout_s`` as overdue (under the lock)."""
        now = time.monotonic()
        late = [f for f, asked in self._orphans.items() if now - asked >= self.timeout_s]
        for future in late:
            del self._orphans[future]
            if not future.done():  # else its callback is about to run, or has
                self._overdue.add(future)
                self._stalled = True

    def _log_late(self, why: str) -> bool:
        """Log a miss served because the store was late, at most once an interval."""
        if not self._late_log.due():
            return False
        log.warning(
            "kvconn: backend %r is slow to answer lookups: %s, so it was served as a miss "
            "(%d such misses so far)",
            self.lookup.config.backend,
            why,
            self.timed_out,
        )
        return True

    def _log_answered_late(self, future: Future[LookupResult], started: float) -> None:
        took_ms = (time.monotonic() - started) * 1000
        if future.cancelled():
            return  # closed before the store answered
        exc = future.exception()
        if exc is not None:
            log.warning("kvconn: that late lookup failed after %.0f ms (%s)", took_ms, exc)
        else:
            log.warning("kvconn: that late lookup was answered after %.0f ms", took_ms)

    def _ask_here(self, hashes: list[bytes]) -> LookupResult:
        """A local store's answer, on the caller's thread; slow ones are counted."""
        started = time.monotonic()
        try:
            return self.lookup.lookup_checked(hashes)
        finally:
            took = time.monotonic() - started
            with self._lock:
                self._slow_in_a_row = self._slow_in_a_row + 1 if took > self._slow_s else 0
                if self.inline and self._slow_in_a_row >= self.SLOW_INLINE_ANSWERS:
                    self.inline = False
                    log.warning(
                        "kvconn: %d lookups in a row in the local store %r took over %.0f ms "
                        "(the last %.1f ms); lookups run on a thread from now on, under "
                        "lookup_wait_s",
                        self._slow_in_a_row,
                        self.lookup.config.backend,
                        self._slow_s * 1000,
                        took * 1000,
                    )

    def forget(self, tag: Hashable) -> None:
        """Drop an unanswered question (the request went away)."""
        with self._lock:
            entry = self._pending.pop(tag, None)
            if entry is None:
                return
            started, future = entry
            if future.cancel():  # no thread asks the store for a request that is gone
                return
            self._orphans[future] = started  # running: the store may be hanging on it
        future.add_done_callback(self._answered)  # outside the lock: it may run at once

    def close(self) -> None:
        """Stop without waiting: a lookup stuck in a stalled store is left to its timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._pending.clear()
            self._overdue.clear()
            self._orphans.clear()
            self._stalled = False


def _stage_layout(stage: object, first: KvLayout) -> KvLayout:
    """A pipeline stage's layout, checked against the first stage's: a block is the same
    tokens on every stage, so they must agree on its size."""
    if not isinstance(stage, KvLayout):
        raise LayoutError(f"a pipeline stage's layout must be a KvLayout, got {stage!r:.80}")
    if stage.tokens_per_block != first.tokens_per_block:
        raise LayoutError(
            f"pipeline stages disagree on the block size: {first.tokens_per_block} and "
            f"{stage.tokens_per_block} tokens per block"
        )
    return stage


def check_hashes(block_hashes: Iterable[bytes]) -> list[bytes]:
    """Block hashes as a list of digests; anything else is the caller's bug."""
    if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(block_hashes, Iterable):
        raise ArgumentError(
            f"block_hashes must be a list of {DIGEST_SIZE}-byte digests "
            f"(kvconn.block_hashes), got {block_hashes!r:.80}"
        )
    return [_digest(h) for h in block_hashes]


def _digest(h: object) -> bytes:
    if not isinstance(h, (bytes, bytearray)) or len(h) != DIGEST_SIZE:
        raise ArgumentError(
            f"block hashes are {DIGEST_SIZE}-byte digests (kvconn.hashing), got {h!r:.80}"
        )
    return bytes(h)
