"""kvconn as SGLang's HiCache L3 storage (``--hicache-storage-backend dynamic``).

SGLang runs one controller per TP rank, each with its own backend object: this class is
one rank's :class:`~kvconn.Connector` over that rank's host pool. SGLang names pages by
their sha256 hex chain; each becomes a kvconn block hash by ``adopt_hashes``, so ranks,
instances and restarts agree on every key.

What kvconn changes compared with SGLang's own backends:

* bytes identical on several ranks are stored once — an MLA latent page once for the
  group, a GQA head duplicated on two ranks once for the pair — where SGLang keys every
  rank's copy separately;
* the hit is the prefix whose *every* page exists, for every rank, from one lookup
  (SGLang then takes the MIN over ranks, which can only agree with it);
* the writer of a duplicated page is spread over its replicas by the block hash when
  SGLang lets every rank save (MHA). Where SGLang saves from one rank only (MLA: the
  controller skips every other rank's backups), that rank writes every page it holds.

SGLang calls ``batch_exists``, ``batch_get_v1`` and ``batch_set_v1`` from three threads
(prefetch, prefetch I/O, backup). Loads and saves go through kvconn's transfer service
(:mod:`kvconn.transfer`), the one every engine adapter uses: a save is captured out of
the host pool on SGLang's backup thread and stored by the service's store thread, a load
runs on a load thread; each SGLang thread waits only for its own transfer. Over a
backend that declares itself thread-safe (LMDB, Redis, Mooncake) nothing serializes the
three: a large ``batch_set_v1`` does not delay a ``batch_exists``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvconn.backend import Backend
from kvconn.connector import Connector
from kvconn.errors import ConfigError, LayoutError
from kvconn.hashing import adopt_hashes
from kvconn.plan import WriterPolicy
from kvconn.results import Outcome
from kvconn.transfer import TransferService
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

    # ------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.attach(_shape_of(mem_pool_host))

    def attach(self, shape: HostPoolShape, *, backend: Backend | None = None) -> None:
        """Describe the host pool to kvconn and start this rank's connector and service.

        ``backend`` replaces the configured one (tests; a backend object shared in-process).
        """
        units = self._kv_units(shape)
        layout = describe_host_pool(shape, self.storage_config.tp_size, units)
        self.close()
        self.connector = Connector(
            self.settings.connector,
            layout,
            rank=self.storage_config.tp_rank,
            pools=[shape.kv_buffer],
            backend=backend,
        )
        self.transfers = TransferService(self.connector)
        self.page_size = shape.page_size
        log.info(
            "kvconn HiCache storage: rank %d/%d, %s %s pages of %d tokens, backend %r, "
            "K/V units %s, writers %s",
            self.storage_config.tp_rank,
            self.storage_config.tp_size,
            shape.kind,
            shape.layout,
            shape.page_size,
            self.settings.connector.backend,
            units if shape.kind == "mha" else "replicated",
            "spread over replicas" if self.every_rank_saves else "this rank writes all",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid controllers register every pool of their group here, KV included.

        Only the KV pool is stored; a side pool (DeepSeek-V3.2's indexer, Mamba or SWA
        state) would need the v2 calls, which this backend does not provide, so it is
        refused at attach rather than read as a miss on every request.
        """
        if str(host_pool_name) != "kv":
            raise ConfigError(
                f"the kvconn HiCache backend stores only the KV pool; this model also has "
                f"the {str(host_pool_name)!r} pool, which needs SGLang's v2 storage calls"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

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
            raise ConfigError("the kvconn HiCache storage has no host pool registered yet")
        return self.connector

    def _service(self) -> TransferService:
        self._require()
        assert self.transfers is not None
        return self.transfers

    # ------------------------------------------------------------ v1 zero-copy
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages of the longest prefix whose every page, of every rank, is stored."""
        if not keys:
            return 0
        return self._require().lookup(adopt_hashes(HASH_SCHEME, keys)).blocks

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages into their host slots; the first failure and all after it are False."""
        if not keys:
            return []
        service = self._service()
        slots = page_slots(host_indices, self.page_size, len(keys))
        transfer = service.load(adopt_hashes(HASH_SCHEME, keys), slots)
        if not transfer.wait(service.load_timeout_s):
            transfer.cancel()  # nothing of it reaches the host pool after this
            transfer.wait()
        return [o is Outcome.LOADED for o in transfer.outcomes]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store this rank's designated pages; per page, False where one was dropped.

        The pages are captured out of the host pool before the service stores them, so
        SGLang may reuse the host slots as soon as this returns. It waits for the store's
        answer, on SGLang's backup thread, so a dropped page is reported, not hidden.
        """
        if not keys:
            return []
        service = self._service()
        slots = page_slots(host_indices, self.page_size, len(keys))
        policy = None if self.every_rank_saves else WriterPolicy.ALL
        transfer = service.save(adopt_hashes(HASH_SCHEME, keys), slots, writer_policy=policy)
        transfer.wait()
        return [o is not Outcome.DROPPED for o in transfer.outcomes]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

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
        "head splitting across TP sizes (tp_lcm_size)": config.should_split_heads,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ConfigError(f"the kvconn HiCache backend does not support {', '.join(found)} yet")


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
