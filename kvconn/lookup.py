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
from kvconn.keys import key_prefix, manifest_key, page_key
from kvconn.layout import KvLayout, shard_position
from kvconn.plan import (
    PagePlan,
    RankShare,
    count_prefix_hit,
    lookup_keys,
    lookup_windows,
    plan_pages,
    rank_shares,
    share_key,
)
from kvconn.registry import load_backend
from kvconn.results import LookupResult
from kvconn.stats import ConnectorStats

log = logging.getLogger("kvconn")

__all__ = ["DeadlineLookup", "Lookup", "LookupResult", "PageKeys", "check_hashes"]


class PageKeys:
    """Every page key of a layout under one configuration.

    Pure: any process that builds it from the same configuration and layout (the
    scheduler, every rank, another instance) derives the same keys without talking.
    """

    def __init__(self, config: ConnectorConfig | Mapping[str, Any], layout: KvLayout) -> None:
        if not isinstance(config, ConnectorConfig):
            config = ConnectorConfig.from_dict(config)
        if not isinstance(layout, KvLayout):
            raise LayoutError(f"layout must be a KvLayout, got {layout!r:.80}")
        self.config = config
        self.layout = layout
        self.prefix = key_prefix(config.namespace, config.model)
        self.plans: tuple[PagePlan, ...] = plan_pages(layout, config.checksum, config.shard_heads)
        #: One layout manifest per page kind (two plans never share a group and
        #: fingerprint: the fingerprint hashes the class), key -> JSON value.
        self.manifests: dict[str, bytes] = {
            manifest_key(self.prefix, p.group, p.fingerprint): p.manifest.to_json()
            for p in self.plans
        }
        #: Each lookup key's window, in :meth:`block_keys` order (None: every block).
        self.windows = lookup_windows(self.plans)

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
        return rank_shares(self.layout, self.plans, rank)

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
        return [*pages, *self.manifests]


class Lookup:
    """Answers the group-wide prefix hit from one batched ``exists``; no tensors.

    Shares a :class:`BackendCalls` (back-off, serialization) with the connector that
    built it, or owns a backend of its own when built alone (a scheduler process).
    """

    def __init__(
        self,
        config: ConnectorConfig | Mapping[str, Any],
        layout: KvLayout,
        *,
        backend: Backend | None = None,
        keys: PageKeys | None = None,
        calls: BackendCalls | None = None,
    ) -> None:
        self.keys = keys if keys is not None else PageKeys(config, layout)
        self.config = self.keys.config
        self.layout = self.keys.layout
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
                self.keys.key_shapes(), model=self.config.model, namespace=self.config.namespace
            )
            self._owns_backend = True
        else:
            self._owns_backend = False
        self.calls = calls
        self.stats = calls.stats
        self.closed = False

    @property
    def backend(self) -> Backend:
        return self.calls.backend

    def lookup(self, block_hashes: Sequence[bytes]) -> LookupResult:
        """The longest prefix of blocks whose every page, for every rank, is stored."""
        hashes = check_hashes(block_hashes)
        if self.closed:
            raise ConnectorClosed("lookup on a closed kvconn connector")
        self.stats.bump("lookups")
        if not hashes:
            return LookupResult(0, 0)
        per_block = lookup_keys(self.keys.prefix, self.keys.plans, hashes)
        flat = [k for keys in per_block for k in keys]
        try:
            present = self.calls.exists(flat)
        except Unavailable:
            self.stats.bump("lookup_errors")
            return LookupResult(0, 0, available=False)
        it = iter(present)
        blocks = self.keys.hit([[next(it) for _ in keys] for keys in per_block])
        return LookupResult(blocks, blocks * self.layout.tokens_per_block)

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
    lookups unanswered (a stalled store), new ones are misses at once: a stalled store
    must not queue up work, nor keep the scheduler waiting.
    """

    def __init__(
        self,
        lookup: Lookup,
        *,
        wait_s: float | None = None,
        timeout_s: float | None = None,
        threads: int = 2,
        max_pending: int = 64,
    ) -> None:
        self.lookup = lookup
        self.wait_s = lookup.config.lookup_wait_s if wait_s is None else wait_s
        self.timeout_s = lookup.config.lookup_timeout_s if timeout_s is None else timeout_s
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvconn-lookup")
        self._lock = threading.Lock()
        self._pending: dict[Hashable, tuple[float, Future[LookupResult]]] = {}
        self.timed_out = 0  # lookups answered as misses because the store was too slow

    def ask(self, tag: Hashable, block_hashes: Sequence[bytes]) -> LookupResult | None:
        """The hit for ``block_hashes``, ``None`` to be asked again, or a miss when late.

        The hashes of a repeated ask are not compared with the first: a tag names one
        question until it is answered (or :meth:`forget` drops it).
        """
        with self._lock:
            entry = self._pending.get(tag)
            if entry is None:
                if self.lookup.calls.down:
                    return LookupResult(0, 0, available=False)  # back-off: no thread needed
                if len(self._pending) >= self.max_pending:
                    self.timed_out += 1
                    return LookupResult(0, 0, available=False)
                hashes = check_hashes(block_hashes)
                entry = (time.monotonic(), self._pool.submit(self.lookup.lookup, hashes))
                self._pending[tag] = entry
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
            return LookupResult(0, 0, available=False)
        return None

    def forget(self, tag: Hashable) -> None:
        """Drop an unanswered question (the request went away)."""
        with self._lock:
            self._pending.pop(tag, None)

    def close(self) -> None:
        """Stop without waiting: a lookup stuck in a stalled store is left to its timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._pending.clear()


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
