"""kvconn as SGLang's HiCache L3 storage (``--hicache-storage-backend dynamic``).

SGLang runs one controller per TP rank, each with its own backend object: this class is
one rank's :class:`~kvconn.Connector` over that rank's host pool. SGLang names pages by
their sha256 hex chain; each becomes a kvconn block hash by ``adopt_hashes``, so ranks,
instances and restarts agree on every key.

What kvconn changes compared with SGLang's own backends:

* bytes identical on several ranks are stored once: a GQA head duplicated on two ranks
  once for the pair, where SGLang's backends key every rank's copy separately (the MLA
  latent and DeepSeek-V3.2's indexer are stored once for the group, as SGLang's own
  backends store them);
* the hit is the prefix whose *every* page exists, for every rank, from one lookup
  (SGLang then takes the MIN over ranks, which can only agree with it);
* the writer of a duplicated page is spread over its replicas by the block hash when
  SGLang lets every rank save (MHA). Where SGLang saves from one rank only (MLA: the
  controller skips every other rank's backups), that rank writes every page it holds.

SGLang's hybrid controller also moves side pools through its v2 calls (``batch_*_v2``,
one :class:`PoolTransfer` per pool): DeepSeek-V3.2's DSA indexer, registered with
``register_mem_host_pool_v2``, is stored once for the group like the MLA latent, as a
layer group of its own (:mod:`kvconn_sglang.host_layout`). Each call moves the pool it
names and answers for it alone, as SGLang expects; the hit stays one lookup over every
pool. Side pools that are not KV per page (Mamba, SWA state, DeepSeek-V4's compressed
pools, draft pools) are refused by name when SGLang registers them.

SGLang calls ``batch_exists(_v2)``, ``batch_get_v1/v2`` and ``batch_set_v1/v2`` from
three threads (prefetch, prefetch I/O, backup). Loads and saves go through kvconn's
transfer service (:mod:`kvconn.transfer`), the one every engine adapter uses: a save is
captured out of the host pool on SGLang's backup thread and stored by the service's
store thread, a load runs on a load thread; each SGLang thread waits only for its own
transfers. Over a backend that declares itself thread-safe (LMDB, Redis, Mooncake)
nothing serializes the three: a large ``batch_set_v1`` does not delay a ``batch_exists``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvconn.backend import Backend
from kvconn.connector import Connector
from kvconn.errors import ConfigError, LayoutError
from kvconn.hashing import adopt_hashes
from kvconn.layout import NO_SLOT
from kvconn.plan import WriterPolicy
from kvconn.results import Outcome
from kvconn.transfer import Transfer, TransferService
from kvconn_sglang.host_layout import HostPoolShape, describe_host_pool, kv_units, page_slots
from kvconn_sglang.settings import AdapterSettings, engine_model

log = logging.getLogger("kvconn.sglang")

#: The hash scheme of SGLang's page keys: hex sha256 over (parent digest, u32 tokens).
HASH_SCHEME = "sglang:sha256"


class KvconnHiCacheStorage(HiCacheStorage):
    """One TP rank's HiCache L3 store, backed by any kvconn backend."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        _check_supported(storage_config)
        self.storage_config = storage_config
        self.settings = AdapterSettings.from_extra_config(
            storage_config.extra_config,
            engine_model(_published_server_args(), storage_config.model_name),
        )
        #: Whether SGLang has every TP rank save (else only the writer ranks do, and
        #: each of them must write every page it holds).
        self.every_rank_saves = _every_rank_saves(storage_config)
        self.connector: Connector | None = None
        self.transfers: TransferService | None = None
        self.page_size = 0
        #: The layer group of each pool SGLang names in its calls (``kv`` is group 0).
        self.pool_groups: dict[str, int] = {}
        # The pools registered so far: the layout is made once SGLang has registered
        # them all (on_host_pools_registered), since a connector's layout is fixed.
        self._kv_shape: HostPoolShape | None = None
        self._side_pools: dict[str, HostPoolShape] = {}
        self._attach_lock = threading.Lock()

    # ------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV pool (SGLang's anchor); the connector starts once every pool is known."""
        super().register_mem_pool_host(mem_pool_host)
        self._kv_shape = _shape_of(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid controllers register every pool of their group here, KV included.

        The KV pool is the one ``register_mem_pool_host`` described. A side pool kvconn
        can store per page (DeepSeek-V3.2's DSA indexer) becomes a layer group of its
        own; any other is refused here, by name, rather than read as a miss on every
        request. SGLang registers dynamic side pools after start-up too; a connector's
        layout is fixed by then, so those are refused as well.
        """
        name = str(host_pool_name)
        if name != PoolName.KV:
            shape = _side_pool_shape(host_pool, name)
            if self.connector is not None:
                raise ConfigError(
                    f"the {name!r} pool was registered after the kvconn HiCache backend "
                    "started; its layout (the pools it stores) is fixed at start-up"
                )
            self._side_pools[name] = shape
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        """SGLang has registered every pool: describe them and start the connector."""
        self._attach_registered()

    def _attach_registered(self) -> None:
        with self._attach_lock:
            if self.connector is None and self._kv_shape is not None:
                self.attach(self._kv_shape, side_pools=tuple(self._side_pools.values()))

    def attach(
        self,
        shape: HostPoolShape,
        *,
        side_pools: Sequence[HostPoolShape] = (),
        backend: Backend | None = None,
    ) -> None:
        """Describe the host pools to kvconn and start this rank's connector and service.

        ``shape`` is the KV pool, ``side_pools`` the side pools (each a layer group of its
        own); ``backend`` replaces the configured one (tests; a backend shared in-process).
        """
        units = self._kv_units(shape)
        layout = describe_host_pool(shape, self.storage_config.tp_size, units, side_pools)
        self.close()
        self.connector = Connector(
            self.settings.connector,
            layout,
            rank=self.storage_config.tp_rank,
            pools=[shape.kv_buffer, *(pool.kv_buffer for pool in side_pools)],
            backend=backend,
        )
        self.transfers = TransferService(self.connector)
        self.page_size = shape.page_size
        self.pool_groups = {str(PoolName.KV): 0} | {
            pool.name: group for group, pool in enumerate(side_pools, start=1)
        }
        log.info(
            "kvconn HiCache storage: rank %d/%d, %s %s pages of %d tokens%s, backend %r, "
            "K/V units %s, writers %s",
            self.storage_config.tp_rank,
            self.storage_config.tp_size,
            shape.kind,
            shape.layout,
            shape.page_size,
            "".join(f" + {pool.name} pool" for pool in side_pools),
            self.settings.connector.backend,
            units if shape.kind == "mha" else "replicated",
            "spread over replicas" if self.every_rank_saves else "this rank writes all",
        )

    def _kv_units(self, shape: HostPoolShape) -> int:
        tp = self.storage_config.tp_size
        if shape.kind != "mha":
            return 1
        if self.settings.kv_heads is not None:  # stated by the operator: must fit
            return kv_units(shape.head_num, tp, self.settings.kv_heads)
        served = _served_kv_heads()
        try:
            return kv_units(shape.head_num, tp, served)
        except LayoutError as exc:
            log.warning("kvconn HiCache storage: %s; keying every rank's K/V separately", exc)
            return kv_units(shape.head_num, tp, None)

    def _require(self) -> Connector:
        if self.connector is None:
            # an engine that never says its pools are all registered: start on first use
            self._attach_registered()
        if self.connector is None:
            raise ConfigError("the kvconn HiCache storage has no host pool registered yet")
        return self.connector

    def _service(self) -> TransferService:
        self._require()
        assert self.transfers is not None
        return self.transfers

    def _group_of(self, pool_name: Any) -> int:
        group = self.pool_groups.get(str(pool_name))
        if group is None:
            raise ConfigError(
                f"SGLang named the {str(pool_name)!r} pool, which is not registered with "
                f"the kvconn HiCache backend (its pools: {', '.join(self.pool_groups)})"
            )
        return group

    # ------------------------------------------------------------ transfers
    def _slots(self, group: int, host_indices: torch.Tensor, pages: int) -> dict[int, torch.Tensor]:
        """The slots of one pool's pages; every other pool's group has none (``NO_SLOT``),
        so the transfer moves exactly the pool SGLang named."""
        if not isinstance(host_indices, torch.Tensor):
            raise LayoutError(f"{pages} pages to move without host indices ({host_indices!r})")
        slots = page_slots(host_indices, self.page_size, pages)
        none = torch.full((pages,), NO_SLOT, dtype=torch.long)
        return {g: slots if g == group else none for g in self.pool_groups.values()}

    def _start_load(
        self, service: TransferService, keys: list[str], host_indices: torch.Tensor, group: int
    ) -> Transfer:
        slots = self._slots(group, host_indices, len(keys))
        return service.load(adopt_hashes(HASH_SCHEME, keys), slots)

    def _start_save(
        self, service: TransferService, keys: list[str], host_indices: torch.Tensor, group: int
    ) -> Transfer:
        slots = self._slots(group, host_indices, len(keys))
        policy = None if self.every_rank_saves else WriterPolicy.ALL
        return service.save(adopt_hashes(HASH_SCHEME, keys), slots, writer_policy=policy)

    @staticmethod
    def _loaded(service: TransferService, transfer: Transfer) -> list[bool]:
        """Per page, whether it arrived; a load past its deadline is cancelled first, so
        nothing of it reaches the host pool afterwards."""
        if not transfer.wait(service.load_timeout_s):
            transfer.cancel()
            transfer.wait()
        service.finished()  # the service keeps finished transfers until asked: drop them
        return [o is Outcome.LOADED for o in transfer.outcomes]

    @staticmethod
    def _stored(service: TransferService, transfer: Transfer) -> list[bool]:
        """Per page, whether it is in the store (written now or already there).

        Waited for on SGLang's backup thread, so a dropped page is reported, not hidden.
        """
        transfer.wait()
        service.finished()
        return [o is not Outcome.DROPPED for o in transfer.outcomes]

    # ------------------------------------------------------------ v1 zero-copy
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages of the longest prefix whose every page, of every rank and every pool,
        is stored."""
        if not keys:
            return 0
        return self._require().lookup(adopt_hashes(HASH_SCHEME, keys)).blocks

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load KV pages into their host slots; the first failure and all after it are False."""
        if not keys:
            return []
        service = self._service()
        return self._loaded(service, self._start_load(service, keys, host_indices, 0))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store this rank's designated KV pages; per page, False where one was dropped.

        The pages are captured out of the host pool before the service stores them, so
        SGLang may reuse the host slots as soon as this returns.
        """
        if not keys:
            return []
        service = self._service()
        return self._stored(service, self._start_save(service, keys, host_indices, 0))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ v2: pools by name
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The hit of every registered pool together, from one lookup (DESIGN rule 3).

        ``kv_hit_pages`` is the longest prefix whose every page of every pool is stored,
        whichever pools SGLang lists; each pool listed, and KV, is reported at that hit:
        no pool can serve a page there without the others. Pools whose hit is zero are
        left out, as SGLang's own backends do.
        """
        self._require()
        transfers = list(pool_transfers or [])
        for transfer in transfers:
            self._group_of(transfer.name)
            if transfer.hit_policy != PoolHitPolicy.ALL_PAGES:
                policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
                raise ConfigError(
                    f"the {str(transfer.name)!r} pool asks for hit policy {policy}; kvconn "
                    "stores only pools needed for every page of a hit (all_pages)"
                )
        hit = self.batch_exists(keys)
        if hit == 0:
            return PoolTransferResult(0, {}, [])
        pools = {PoolName.KV: hit} | {transfer.name: hit for transfer in transfers}
        return PoolTransferResult(hit, pools, list(range(1, hit + 1)))

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool; per pool, per page, whether it arrived
        (the first failure and all after it are False). The pools load concurrently."""
        service = self._service()
        started = [
            (t.name, self._start_load(service, t.keys, t.host_indices, self._group_of(t.name)))
            for t in transfers
            if t.keys
        ]
        results: dict[str, list[bool]] = {t.name: [] for t in transfers}
        for name, transfer in started:
            results[name] = self._loaded(service, transfer)
        return results

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Store this rank's designated pages of each transfer's pool; per pool, per page,
        False where one was dropped. Every pool is captured before this returns."""
        service = self._service()
        started = [
            (t.name, self._start_save(service, t.keys, t.host_indices, self._group_of(t.name)))
            for t in transfers
            if t.keys
        ]
        results: dict[str, list[bool]] = {t.name: [] for t in transfers}
        for name, transfer in started:
            results[name] = self._stored(service, transfer)
        return results

    # ------------------------------------------------------------ copying interface
    # SGLang calls these only without "interface_v1", which the constructor refuses.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise _copying_interface("get")

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> Any:
        raise _copying_interface("batch_get")

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        raise _copying_interface("set")

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        raise _copying_interface("batch_set")

    # ------------------------------------------------------------ lifecycle
    def clear(self) -> None:
        """Leaves the store alone: its pages are content-addressed and shared with
        every other instance, so one engine's cache flush must not delete them."""
        log.info("kvconn HiCache storage: clear() leaves the shared store untouched")

    def close(self) -> None:
        """Finish or cancel transfers in flight, then close the store.

        A service thread still inside a stalled backend call after the deadline keeps the
        backend open (closing it under the call could crash a native client).
        """
        if self.transfers is not None:
            clean = self.transfers.close()
            self.transfers = None
            if not clean:
                self.connector = None
                return
        if self.connector is not None:
            self.connector.close()
            self.connector = None


def _copying_interface(name: str) -> ConfigError:
    return ConfigError(
        f"the kvconn HiCache backend has no {name}(): it moves pages in place through "
        'batch_get_v1/batch_set_v1; set "interface_v1": 1 in the extra config'
    )


def _check_supported(config: HiCacheStorageConfig) -> None:
    """Refuse parallel shapes whose pages the adapter would key wrongly."""
    unsupported = {
        "pipeline parallelism (pp_size > 1)": config.pp_size > 1,
        "attention context parallelism (attn_cp_size > 1)": config.attn_cp_size > 1,
        "decode context parallelism (dcp_size > 1)": getattr(config, "dcp_size", 1) > 1,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ConfigError(f"the kvconn HiCache backend does not support {', '.join(found)} yet")
    if config.should_split_heads:
        # SGLang sets it for MHA page_head pools when tp_lcm_size > tp_size: instances
        # of different TP sizes share one store, K/V split at tp_lcm_size head shards.
        raise ConfigError(
            f"the kvconn HiCache backend does not split K/V heads across TP sizes yet "
            f"(tp_lcm_size={config.tp_lcm_size} at TP={config.tp_size}): kvconn serves "
            "this with its shard_heads setting (pages cut at tp_lcm_size head shards), "
            "which this kvconn does not have; remove tp_lcm_size from the extra config "
            "(each TP size then keeps its own K/V pages)"
        )


def _every_rank_saves(config: HiCacheStorageConfig) -> bool:
    """Whether SGLang's controller backs up from every TP rank.

    Asked of SGLang's own rule (``is_storage_writer``: MLA saves from rank 0 only) for
    each rank; versions without it saved MLA from rank 0 and everything else from all.
    """
    if not hasattr(type(config), "is_storage_writer"):
        return not config.is_mla_model
    return all(
        dataclasses.replace(config, tp_rank=rank).is_storage_writer
        for rank in range(config.tp_size)
    )


def _shape_of(pool: Any) -> HostPoolShape:
    if type(pool) is MHATokenToKVPoolHost:
        kind, heads = "mha", pool.head_num
    elif type(pool) is MLATokenToKVPoolHost:
        kind, heads = "mla", 1
    else:
        raise LayoutError(
            f"the kvconn HiCache backend supports MHATokenToKVPoolHost and "
            f"MLATokenToKVPoolHost host pools, not {type(pool).__name__}"
        )
    buffer = pool.kv_buffer
    if not isinstance(buffer, torch.Tensor):
        raise LayoutError(f"{type(pool).__name__} has no single kv_buffer tensor")
    return HostPoolShape(
        kind=kind,
        layout=pool.layout,
        page_size=pool.page_size,
        layer_num=pool.layer_num,
        size=pool.size,
        kv_buffer=buffer,
        head_num=heads,
    )


#: Why each side pool SGLang may register (``PoolName``) is not stored.
_SIDE_POOLS_REFUSED = {
    "mamba": "it holds recurrent state at checkpoint pages, needed only at a hit's last "
    "page (hit policy trailing_pages), not KV per page",
    "swa": "its sliding-window KV is needed only in the pages that end a hit (hit policy "
    "trailing_pages), which this adapter does not describe yet",
    "auxiliary_swa": "its sliding-window KV is needed only in the pages that end a hit "
    "(hit policy trailing_pages), which this adapter does not describe yet",
    "draft": "speculative decoding's draft pools are not stored yet",
    "draft_indexer": "speculative decoding's draft pools are not stored yet",
    "draft_swa": "speculative decoding's draft pools are not stored yet",
}


def _side_pool_shape(pool: Any, name: str) -> HostPoolShape:
    """A side pool kvconn stores per page (DeepSeek-V3.2's DSA indexer), or a
    :class:`ConfigError` naming the pool and why it is not stored.

    The DSA index keys are computed from a projection every rank holds whole, so every
    rank's indexer pool holds the same bytes: stored once for the group, like the MLA
    latent, and saved from the rank SGLang saves the latent from.
    """
    kind = type(pool).__name__
    if name == PoolName.INDEXER and type(pool) is DSAIndexerPoolHost:
        buffer = pool.index_k_with_scale_buffer
        if not isinstance(buffer, torch.Tensor):
            raise LayoutError(f"the {name!r} pool ({kind}) has no buffer on this rank")
        return HostPoolShape(
            kind="indexer",
            layout=pool.layout,
            page_size=pool.page_size,
            layer_num=pool.layer_num,
            size=pool.size,
            kv_buffer=buffer,
            name=name,
        )
    if name == PoolName.INDEXER:
        reason = "kvconn stores DeepSeek-V3.2's DSA indexer (DSAIndexerPoolHost), not this one"
    elif name.startswith("deepseek_v4_"):
        reason = "DeepSeek-V4's compressed and state pools are not stored"
    else:
        reason = _SIDE_POOLS_REFUSED.get(name, "kvconn does not know this pool")
    raise ConfigError(
        f"the kvconn HiCache backend cannot store the {name!r} pool ({kind}): {reason}; "
        "run this model without L3 storage or with another HiCache storage backend"
    )


def _published_server_args() -> Any:
    """SGLang's ``ServerArgs`` of this server, or ``None`` when none were published."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception as exc:  # a storage built outside a server (tests, tools)
        log.info("kvconn HiCache storage: no published server arguments (%s)", exc)
        return None


def _served_kv_heads() -> int | None:
    """The served model's global KV head count, from the config SGLang published."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        server_args = _published_server_args()
        if server_args is None:
            return None
        return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())
    except Exception as exc:  # a config SGLang cannot read
        log.info("kvconn HiCache storage: the model's KV head count is unknown (%s)", exc)
        return None
