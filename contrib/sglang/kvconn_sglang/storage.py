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
  controller skips every other rank's backups), that rank writes every page it holds;
* with ``stripe_reads``, a page several ranks hold is read once per TP group and passed
  over a gloo group of kvconn's own. SGLang's ranks may each skip a load (a terminated
  prefetch), so loads are agreed round by round first (:mod:`kvconn.rounds`), and one
  no other rank makes is read by its rank alone.

SGLang's hybrid controller also moves side pools through its v2 calls (``batch_*_v2``,
one :class:`PoolTransfer` per pool), each a layer group of its own
(:mod:`kvconn_sglang.host_layout`), registered with ``register_mem_host_pool_v2``:

* DeepSeek-V3.2's DSA indexer is stored once for the group like the MLA latent, and a
  hit needs it for every page; so is MiniMax-M3's sparse index keys' pool
  (``MHATokenToKOnlyPoolHost``: one head every rank computes whole; MiniMax-M3.1's NVFP4
  index rows), beside each rank's own K/V pages (NVFP4: packed K/V rows, keyed by the
  heads they hold like an MHA pool's);
* a hybrid sliding-window model's SWA K/V (gpt-oss, Gemma: SGLang's ``SWAKVPool``)
  is keyed by head like the KV pool. SGLang keeps it, on host slots of its own, only for
  the last pages of each node, and resumes a request from the window that ends its hit
  (hit policy ``trailing_pages``): a hit of ``N`` pages needs the SWA pages of the
  last ``W`` of them only, ``W`` being the window SGLang names in the query. So ``N``
  may be a hit where ``N - 1`` is not, and ``batch_exists_v2`` lists every such ``N``
  (``restorable_prefix_pages``), which SGLang intersects over its ranks.

* a hybrid linear-attention model's Mamba state (Qwen3-Next, Nemotron-H: SGLang's
  ``MambaPoolHost``, one state slot per checkpoint page over several buffers) likewise,
  with a window of one page: a hit needs the state at its last page. Each rank's state
  is a page of its own (it is split by heads).

* a speculative draft model's pools (``draft``, ``draft_indexer``, ``draft_swa``), like
  their target counterparts; SGLang registers them after the storage has started, and
  the connector starts again with them before it has answered anything.

Each call moves the pool it names and answers for it alone, as SGLang expects; the hit
stays one lookup over every pool. Other side pools (DeepSeek-V4's compressed pools) are
refused by name when SGLang registers them.

Under pipeline parallelism each stage's controller has a backend object of its own over
the stage's layers; pages are keyed by the model's layer numbers (the host pool's
``start_layer`` onwards), so the stages' pages of one block never share a key, and SGLang's
MIN over the pipeline's group makes a block a hit only where every stage holds it.

Instances at different TP sizes share K/V pages when SGLang splits heads
(``tp_lcm_size`` in the extra config, ``should_split_heads``): the adapter sets kvconn's
``shard_heads`` to ``min(tp_lcm_size, KV heads)``, so every TP size dividing
``tp_lcm_size`` cuts the same pages, ``w<G>r<j>``, out of its host pool's heads.

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
import functools
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
from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import msa_v1_page_row_bytes
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost, MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4 import (
    MiniMaxM3Nvfp4IndexKPoolHost,
    MiniMaxM3Nvfp4MainKVPoolHost,
)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvconn.backend import Backend
from kvconn.connector import Connector
from kvconn.cpus import connecting_on
from kvconn.engine_settings import EngineModel
from kvconn.errors import ConfigError, LayoutError
from kvconn.hashing import adopt_hashes
from kvconn.layout import NO_SLOT
from kvconn.lograte import LogInterval
from kvconn.plan import WriterPolicy, plan_pages
from kvconn.results import Outcome
from kvconn.rounds import LoadRounds
from kvconn.transfer import Transfer, TransferService
from kvconn_sglang.host_layout import HostPoolShape, describe_host_pool, kv_units, page_slots
from kvconn_sglang.settings import AdapterSettings, engine_model

log = logging.getLogger("kvconn.sglang")

#: Host pool kinds whose K/V are split by heads over the ranks (a head duplicated on
#: several ranks is stored once for them).
KV_BY_HEADS = ("mha", "kv_rows")

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
        #: kvconn's own group over this rank's TP ranks when reads are striped (made
        #: here, on every rank alike: creating a group is collective over the world).
        self.group = _striping_group(storage_config, self.settings.connector.stripe_reads)
        self.connector: Connector | None = None
        self.transfers: TransferService | None = None
        #: Striped loads, agreed round by round (loads go through it when it is set).
        self.rounds: LoadRounds | None = None
        self.page_size = 0
        self.slot_tokens: dict[int, int] = {}
        #: The layer group of each pool SGLang names in its calls (``kv`` is group 0).
        self.pool_groups: dict[str, int] = {}
        self.trailing_groups: frozenset[int] = frozenset()
        # The pools registered so far: the layout is made once SGLang has registered
        # them all (on_host_pools_registered), since a connector's layout is fixed.
        self._kv_shape: HostPoolShape | None = None
        self._side_pools: dict[str, HostPoolShape] = {}
        self._attach_lock = threading.RLock()
        #: Whether SGLang has asked anything of the store (then no pool may join).
        self._used = False
        #: Saves SGLang was told are not stored because the store had not finished them
        #: within ``load_timeout_s`` (a stalled store); logged once a minute at most.
        self.late_saves = 0
        self._late_log = LogInterval()

    # ------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV pool (SGLang's anchor); the connector starts once every pool is known."""
        super().register_mem_pool_host(mem_pool_host)
        self._kv_shape = _shape_of(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid controllers register every pool of their group here, KV included.

        The KV pool is the one ``register_mem_pool_host`` described. A side pool kvconn
        can store per page (DeepSeek-V3.2's DSA indexer, SWA, Mamba, a speculative
        draft model's pools) becomes a layer group of its own; any other is refused
        here, by name, rather than read as a miss on every request.

        SGLang registers dynamic side pools (a draft model's) after the storage has
        started, when the draft worker comes up: the connector is started again with
        the new pool, as long as it has not answered or moved anything yet (its
        layout decides every key). One registered after that is refused.
        """
        name = str(host_pool_name)
        if name != PoolName.KV:
            shape = _side_pool_shape(host_pool, name)
            if name.startswith("draft"):  # a draft model's pools: named by its weights
                shape = dataclasses.replace(shape, weights=_draft_weights())
            if not shape.model_layers and self.storage_config.pp_size > 1:
                raise ConfigError(
                    f"the kvconn HiCache backend cannot store the {name!r} pool under "
                    f"pipeline parallelism (pp_size={self.storage_config.pp_size}): "
                    "its host pool does not carry the model's layer numbers (SGLang's "
                    "SWAKVPool and MiniMax-M3's index-key pool number their layers from 0 "
                    "on every stage; a Mamba pool has none), so two stages' pages would "
                    "share keys; run without L3 storage or at pp_size=1"
                )
            with self._attach_lock:
                if self.connector is not None and self._used:
                    raise ConfigError(
                        f"the {name!r} pool was registered after the kvconn HiCache "
                        "backend started and answered SGLang; its layout (the pools it "
                        "stores, hence every key) is fixed once it has"
                    )
                self._side_pools[name] = shape
                restart = self.connector is not None  # a dynamic side pool
                if restart:
                    log.info("kvconn HiCache storage: the %r pool joins the layout", name)
                    self.close()
            if restart:  # else the connector starts once SGLang has registered them all
                self._attach_registered()
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
        shard_heads = self._shard_heads(shape, units)
        config = self.settings.connector
        if shard_heads != config.shard_heads:
            config = dataclasses.replace(config, shard_heads=shard_heads)
        tp = self.storage_config.tp_size
        side_units = {pool.name: self._side_units(pool) for pool in side_pools}
        self._check_draft_writers(side_pools)
        layout = describe_host_pool(shape, tp, units, side_pools, side_units)
        if self.storage_config.should_split_heads:
            try:  # what the connector will plan, refused here naming tp_lcm_size
                plan_pages(layout, config.checksum, shard_heads)
            except (ConfigError, LayoutError) as exc:
                label = f"{self._split_label(units)} (kvconn shard_heads={shard_heads})"
                raise type(exc)(f"{label}: {exc}") from exc
        if self.group is not None:  # the rounds own the group: no collectives at saves
            config = dataclasses.replace(config, verify_replicas_every=0)
        self.close()
        with connecting_on(config.transfer_cpus):  # a CPU list: the client's threads too
            self.connector = Connector(
                config,
                layout,
                rank=self.storage_config.tp_rank,
                pools=[buffer for pool in (shape, *side_pools) for buffer in pool.buffers],
                backend=backend,
                group=self.group,
            )
        self.transfers = TransferService(self.connector)
        if self.group is not None:
            self.rounds = LoadRounds(self.connector)
        self.page_size = shape.page_size
        #: Tokens per host slot of each group's pool (a Mamba pool's slot is one state).
        self.slot_tokens = {0: shape.page_size} | {
            group: pool.page_size for group, pool in enumerate(side_pools, start=1)
        }
        self.pool_groups = {str(PoolName.KV): 0} | {
            pool.name: group for group, pool in enumerate(side_pools, start=1)
        }
        #: The groups a hit needs only where SGLang asks for them, and then only for
        #: the window it names (``trailing_pages``): the pools with slots of their own.
        self.trailing_groups = frozenset(
            self.pool_groups[pool.name] for pool in side_pools if pool.own_slots
        )
        log.info(
            "kvconn HiCache storage: rank %d/%d, %s%s %s pages of %d tokens%s, backend %r, "
            "K/V units %s%s, writers %s",
            self.storage_config.tp_rank,
            self.storage_config.tp_size,
            _stage_label(self.storage_config, shape),
            shape.kind,
            shape.layout,
            shape.page_size,
            "".join(f" + {pool.name} pool" for pool in side_pools),
            self.settings.connector.backend,
            units if shape.kind in KV_BY_HEADS else "replicated",
            f" cut at shard_heads={shard_heads}" if shard_heads is not None else "",
            "spread over replicas" if self.every_rank_saves else "this rank writes all",
        )
        if self.group is not None:
            log.info("kvconn HiCache storage: shared pages are read once per TP group")

    def _kv_units(self, shape: HostPoolShape) -> int:
        tp = self.storage_config.tp_size
        if shape.kind not in KV_BY_HEADS:
            return 1
        if self.settings.kv_heads is not None:  # stated by the operator: must fit
            return kv_units(shape.head_num, tp, self.settings.kv_heads)
        config = self._model_config
        served = None if config is None else int(config.get_total_num_kv_heads())
        if self.storage_config.should_split_heads:
            # Pages shared across TP sizes need the same global head count at every TP
            # size: no fallback to keying this TP size's K/V on its own.
            if served is None and shape.head_num == 1:
                raise ConfigError(
                    f"{self._split_label(None)}: the model's KV head count is unknown and "
                    "this rank holds one head (SGLang duplicates a head over ranks when "
                    'there are fewer heads than ranks); set "kv_heads" in the extra config'
                )
            return kv_units(shape.head_num, tp, served)
        return _units_or_per_rank(shape, tp, served)

    @functools.cached_property
    def _model_config(self) -> Any:
        """SGLang's ``ModelConfig`` of the served model (``None``: unreadable), read
        once: the KV and the SWA pools' head counts both come from it, at every start."""
        return _served_model_config()

    @functools.cached_property
    def _draft_config(self) -> Any:
        """SGLang's ``ModelConfig`` of the speculative draft model (``None``: none, or
        unreadable), read once: each registration describes the layout again."""
        return _draft_model_config()

    def _side_units(self, pool: HostPoolShape) -> int:
        """A side pool's units by heads. A Mamba state is split by heads over the ranks,
        none duplicated: each rank's its own. A draft model's K/V heads are its own
        count, read from the draft model's config (``speculative_draft_model_path``), so
        a draft head SGLang duplicates on several ranks is stored once; unknown, or not
        fitting the pool, the draft's K/V is keyed per rank (assumed wrongly, a count
        would store two ranks' different heads as one page). Identical pools (latents,
        indexers) have one unit."""
        tp: int = self.storage_config.tp_size
        if pool.name == PoolName.SWA:
            return self._swa_units(pool)
        if pool.kind == "mamba":
            return tp
        if pool.kind == "mha" and pool.name == PoolName.DRAFT:
            config = self._draft_config
            served = None if config is None else int(config.get_total_num_kv_heads())
            return _units_or_per_rank(pool, tp, served)
        if pool.kind == "mha":
            return kv_units(pool.head_num, tp, None)
        return 1

    def _check_draft_writers(self, side_pools: Sequence[HostPoolShape]) -> None:
        """Refuse a draft pool split by heads that SGLang saves from rank 0 alone.

        With an MLA target, SGLang's controller backs up a dynamic backend's draft pools
        from rank 0 only (``HybridCacheController.should_backup``): an MHA draft's other
        ranks' heads would never be stored, and no block would ever be a hit.
        """
        tp = self.storage_config.tp_size
        split = [p.name for p in side_pools if p.name.startswith("draft") and p.kind == "mha"]
        if split and tp > 1 and not self.every_rank_saves:
            raise ConfigError(
                f"the kvconn HiCache backend cannot store the {', '.join(map(repr, split))} "
                f"pool(s) at TP={tp} with an MLA target: SGLang saves draft pools from rank "
                "0 alone then, and these are split by heads over the ranks, so no block "
                "would ever be whole in the store; run the draft without L3 storage or "
                "at TP=1"
            )

    def _swa_units(self, pool: HostPoolShape) -> int:
        """The SWA pool's K/V units: the model's SWA KV head count, checked against the
        pool's heads as the KV pool's is."""
        config = self._model_config
        served = None if config is None else swa_kv_heads(config)
        return _units_or_per_rank(pool, self.storage_config.tp_size, served)

    def _split_label(self, kv_heads: int | None) -> str:
        config = self.storage_config
        heads = f" with {kv_heads} KV heads" if kv_heads is not None else ""
        return f"tp_lcm_size={config.tp_lcm_size} at TP={config.tp_size}{heads}"

    def _shard_heads(self, shape: HostPoolShape, units: int) -> int | None:
        """kvconn's ``shard_heads`` for this instance: the configured one, or with SGLang's
        head split (``should_split_heads``) the granularity ``tp_lcm_size`` asks for."""
        explicit = self.settings.connector.shard_heads
        config = self.storage_config
        if not config.should_split_heads:
            return explicit
        if shape.kind != "mha":
            raise ConfigError(
                f"{self._split_label(None)}: SGLang asks to split K/V heads, but the host "
                f"pool is {shape.kind}, whose pages kvconn cannot cut by head"
            )
        shards = tp_lcm_shards(config.tp_lcm_size, config.tp_size, units)
        if explicit is not None and explicit != shards:
            raise ConfigError(
                f"the kvconn config sets shard_heads={explicit}, but "
                f"{self._split_label(units)} cuts K/V pages at {shards} head shards; "
                "remove shard_heads from the kvconn config (tp_lcm_size sets it) or make "
                "them agree"
            )
        return shards

    def _require(self) -> Connector:
        self._used = True  # the layout answers from now on: no pool may join it
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
        slots = page_slots(host_indices, self.slot_tokens[group], pages)
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

    def _load_agreed(
        self, rounds: LoadRounds, keys: list[str], host_indices: torch.Tensor, group: int
    ) -> list[bool]:
        """A load over the group: striped where every rank makes it (:mod:`kvconn.rounds`:
        SGLang's I/O threads may each skip batches), else read by this rank alone."""
        slots = self._slots(group, host_indices, len(keys))
        timeout_s = rounds.connector.config.load_timeout_s  # as the service's loads
        result = rounds.load(adopt_hashes(HASH_SCHEME, keys), slots, timeout_s=timeout_s)
        return [i < result.loaded for i in range(len(keys))]

    @staticmethod
    def _loaded(service: TransferService, transfer: Transfer) -> list[bool]:
        """Per page, whether it arrived; a load past its deadline is cancelled first, so
        nothing of it reaches the host pool afterwards."""
        if not transfer.wait(service.load_timeout_s):
            transfer.cancel()
            transfer.wait()
        service.finished()  # the service keeps finished transfers until asked: drop them
        return [o is Outcome.LOADED for o in transfer.outcomes]

    def _stored(self, service: TransferService, transfer: Transfer) -> list[bool]:
        """Per page, whether it is in the store (written now or already there).

        Waited for on SGLang's backup thread, so a dropped page is reported, not hidden;
        for ``load_timeout_s`` at most, as a load: a stalled store must not hold the
        backup thread (and the host pages it pins). Past that every page is reported
        not stored; the pages are captured, so the store thread may still write them.
        """
        if not transfer.wait(service.load_timeout_s):
            self.late_saves += 1
            if self._late_log.due():
                log.warning(
                    "kvconn: a save of %d pages is unfinished after load_timeout_s (%.1f s): "
                    "SGLang is told they are not stored (%d such saves so far)",
                    transfer.blocks,
                    service.load_timeout_s,
                    self.late_saves,
                )
            return [False] * transfer.blocks
        service.finished()
        return [o is not Outcome.DROPPED for o in transfer.outcomes]

    # ------------------------------------------------------------ v1 zero-copy
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages of the longest prefix whose every page, of every rank and every pool,
        is stored; a sliding-window pool only where ``batch_exists_v2`` names it (SGLang
        asks here when the request loads no window: a short span inside the tree)."""
        if not keys:
            return 0
        connector = self._require()
        windows = dict.fromkeys(self.trailing_groups, 0)
        return connector.lookup(adopt_hashes(HASH_SCHEME, keys), windows=windows).blocks

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load KV pages into their host slots; the first failure and all after it are False."""
        if not keys:
            return []
        if self.rounds is not None:
            return self._load_agreed(self.rounds, keys, host_indices, 0)
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
        """The hit of every pool SGLang needs, together, from one lookup (DESIGN rule 3).

        ``kv_hit_pages`` is the longest prefix whose every needed page is stored: every
        page of the KV pool and of a pool moved with it (the DSA indexer), whichever
        pools SGLang lists; of a sliding-window pool (``trailing_pages``), the last
        ``len(keys)`` pages of the prefix (SGLang's window, placeholder keys), and none
        when SGLang does not list it; of a pool on its own slots that SGLang lists with
        ``all_pages`` (an MTP draft's sliding layers on the KV pool's indices), every
        page. ``restorable_prefix_pages`` is every such prefix:
        with a window, 5 may be one where 4 is not. Each pool listed, and KV, is
        reported at the hit: no pool can serve a page there without the others. Pools
        whose hit is zero are left out, as SGLang's own backends do.
        """
        connector = self._require()
        transfers = list(pool_transfers or [])
        windows: dict[int, int | None] = dict.fromkeys(self.trailing_groups, 0)
        for transfer in transfers:
            group = self._group_of(transfer.name)
            policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
            if group in self.trailing_groups and policy == PoolHitPolicy.TRAILING_PAGES:
                windows[group] = max(1, len(transfer.keys or ()))
            elif group in self.trailing_groups and policy == PoolHitPolicy.ALL_PAGES:
                # a pool on slots of its own that SGLang moves with every page: an MTP
                # draft's sliding layers on the KV pool's indices (draft_swa_full)
                windows[group] = None
            elif policy != PoolHitPolicy.ALL_PAGES:
                served = (
                    "kvconn serves all_pages and trailing_pages"
                    if group in self.trailing_groups
                    else "kvconn stores it on the KV pool's slots, for hit policy all_pages"
                )
                raise ConfigError(
                    f"the {str(transfer.name)!r} pool asks for hit policy {policy}; {served}"
                )
        if not keys:
            return PoolTransferResult(0, {}, [])
        found = connector.lookup(adopt_hashes(HASH_SCHEME, keys), windows=windows)
        hit = found.blocks
        if hit == 0:
            return PoolTransferResult(0, {}, [])
        pools = {PoolName.KV: hit} | {transfer.name: hit for transfer in transfers}
        return PoolTransferResult(hit, pools, list(found.prefixes()))

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool; per pool, per page, whether it arrived
        (the first failure and all after it are False). The pools load concurrently,
        or one after another when reads are striped."""
        service = self._service()
        if self.rounds is not None:
            rounds = self.rounds
            return {t.name: [] for t in transfers} | {
                t.name: self._load_agreed(rounds, t.keys, t.host_indices, self._group_of(t.name))
                for t in transfers
                if t.keys
            }
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
        if self.rounds is not None:
            self.rounds.close()
            self.rounds = None
        if self.transfers is not None:
            clean = self.transfers.close()
            self.transfers = None
            if not clean:
                self.connector = None
                return
        if self.connector is not None:
            self.connector.close()
            self.connector = None


def _stage_label(config: HiCacheStorageConfig, shape: HostPoolShape) -> str:
    """``"PP stage 1/2 (layers 12-23), "`` under pipeline parallelism, else nothing."""
    if config.pp_size == 1:
        return ""
    last = shape.start_layer + shape.layer_num - 1
    return f"PP stage {config.pp_rank}/{config.pp_size} (layers {shape.start_layer}-{last}), "


def _copying_interface(name: str) -> ConfigError:
    return ConfigError(
        f"the kvconn HiCache backend has no {name}(): it moves pages in place through "
        'batch_get_v1/batch_set_v1; set "interface_v1": 1 in the extra config'
    )


def _check_supported(config: HiCacheStorageConfig) -> None:
    """Refuse parallel shapes whose pages the adapter would key wrongly."""
    unsupported = {
        "attention context parallelism (attn_cp_size > 1)": config.attn_cp_size > 1,
        "decode context parallelism (dcp_size > 1)": getattr(config, "dcp_size", 1) > 1,
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ConfigError(f"the kvconn HiCache backend does not support {', '.join(found)} yet")
    if config.should_split_heads:
        # SGLang sets it for MHA page_head pools when tp_lcm_size > tp_size: instances
        # of different TP sizes share one store, K/V split at tp_lcm_size head shards
        # (kvconn's shard_heads, chosen once the host pool's heads are known).
        lcm = config.tp_lcm_size
        if isinstance(lcm, bool) or not isinstance(lcm, int) or lcm < 1 or lcm % config.tp_size:
            raise ConfigError(
                f"tp_lcm_size={lcm!r} at TP={config.tp_size}: tp_lcm_size must be a "
                "positive multiple of the TP size of every instance sharing the store"
            )


def tp_lcm_shards(tp_lcm_size: int, tp_size: int, kv_heads: int) -> int:
    """The head shards K/V pages are cut at when SGLang splits heads over ``tp_lcm_size``.

    ``min(tp_lcm_size, kv_heads)``: every instance sharing ``tp_lcm_size`` (TP sizes that
    divide it) computes the same number, and with fewer KV heads than ``tp_lcm_size`` a
    page holds one head (SGLang's own backends cannot split those at all). It must
    divide the heads (a page holds whole heads) and be a multiple of this TP size's own
    shards, ``min(TP, kv_heads)`` (a page's heads lie on one rank); otherwise a
    :class:`ConfigError` naming all three numbers.
    """
    shards = min(tp_lcm_size, kv_heads)
    if kv_heads % shards or shards % min(tp_size, kv_heads):
        raise ConfigError(
            f"tp_lcm_size={tp_lcm_size} at TP={tp_size} with {kv_heads} KV heads: kvconn "
            f"cuts shared K/V pages at min(tp_lcm_size, KV heads) = {shards} head shards, "
            f"which must divide the {kv_heads} KV heads and be a multiple of this TP's "
            f"{min(tp_size, kv_heads)} shards; choose a tp_lcm_size that divides the KV "
            "head count, or one at least as large"
        )
    return shards


def _striping_group(config: HiCacheStorageConfig, stripe_reads: bool) -> Any:
    """kvconn's own gloo group over this rank's TP ranks, or None (no striping, TP=1).

    Its own, not SGLang's: kvconn's rounds run on a thread of their own, and collectives
    from two threads on one group could interleave differently on different ranks. The
    ranks are those of SGLang's attention TP group (with DP attention) or TP group,
    whichever has the storage config's TP size; without SGLang's parallel state (the
    controller driven by hand), a world of exactly the TP size is the TP group.
    """
    if not stripe_reads or config.tp_size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(
            "stripe_reads at TP>1 needs torch.distributed initialized (SGLang's TP group), "
            "and it is not; set stripe_reads = false"
        )
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_parallel

    ranks: list[int] | None = None
    for name in ("attn_tp_group", "tp_group"):
        try:
            coordinator = getattr(get_parallel(), name)
        except (AssertionError, AttributeError, RuntimeError, ValueError):  # not built
            continue
        if coordinator is not None and coordinator.world_size == config.tp_size:
            ranks = list(coordinator.ranks)
            break
    if ranks is None and dist.get_world_size() == config.tp_size:
        ranks = list(range(config.tp_size))
    if ranks is None:
        raise ConfigError(
            f"stripe_reads: found no group of SGLang's TP size {config.tp_size} (neither "
            "its attention TP group nor its TP group); set stripe_reads = false"
        )
    return parallel_state.create_custom_parallel_group(group_ranks=ranks, backend="gloo")


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
    elif type(pool) is MiniMaxM3Nvfp4MainKVPoolHost:
        return _host_shape(
            pool, "kv_rows", pool.kv_buffer, head_num=_nvfp4_heads(pool), encoding=NVFP4_ROWS
        )
    else:
        raise LayoutError(
            f"the kvconn HiCache backend supports MHATokenToKVPoolHost, "
            f"MLATokenToKVPoolHost and MiniMaxM3Nvfp4MainKVPoolHost host pools, not "
            f"{type(pool).__name__}"
        )
    buffer = pool.kv_buffer
    if not isinstance(buffer, torch.Tensor):
        raise LayoutError(f"{type(pool).__name__} has no single kv_buffer tensor")
    return _host_shape(pool, kind, buffer, head_num=heads)


#: Why each side pool SGLang may register (``PoolName``) is not stored.
_SIDE_POOLS_REFUSED = {
    "mamba": "kvconn stores SGLang's Mamba state pool (MambaPoolHost), not this one",
    "swa": "kvconn stores a sliding-window pool of K/V heads (MHATokenToKVPoolHost), not this one",
    "auxiliary_swa": "an auxiliary sliding-window pool is not stored yet",
    "draft": "kvconn stores a draft model's MHATokenToKVPoolHost or MLATokenToKVPoolHost, "
    "not this one",
    "draft_indexer": "kvconn stores a draft model's DSAIndexerPoolHost, not this one",
    "draft_swa": "kvconn stores a draft model's sliding-window MHATokenToKVPoolHost, not this one",
}


def _side_pool_shape(pool: Any, name: str) -> HostPoolShape:
    """A side pool kvconn stores per page (DeepSeek-V3.2's DSA indexer, MiniMax-M3's
    index keys, a hybrid model's sliding-window K/V or Mamba state, a draft model's
    pools), or a :class:`ConfigError` naming the pool and why it is not stored.

    The DSA index keys are computed from a projection every rank holds whole, so every
    rank's indexer pool holds the same bytes: stored once for the group, like the MLA
    latent, and saved from the rank SGLang saves the latent from.
    """
    kind = type(pool).__name__
    if name == PoolName.DRAFT and type(pool) in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        # a draft model's K/V, moved with the KV pool's host indices
        return dataclasses.replace(_shape_of(pool), name=name)
    if name in (PoolName.INDEXER, PoolName.DRAFT_INDEXER) and type(pool) is DSAIndexerPoolHost:
        buffer = pool.index_k_with_scale_buffer
        if not isinstance(buffer, torch.Tensor):
            raise LayoutError(f"the {name!r} pool ({kind}) has no buffer on this rank")
        return _host_shape(pool, "indexer", buffer, name=name)
    if name in (PoolName.SWA, PoolName.DRAFT_SWA) and type(pool) is MHATokenToKVPoolHost:
        # K/V heads of the sliding-window layers, on SGLang's own SWA host slots
        return dataclasses.replace(_shape_of(pool), name=name, own_slots=True, model_layers=False)
    if name == PoolName.MAMBA and type(pool) is MambaPoolHost:
        return _mamba_shape(pool, name)
    if name == PoolName.INDEXER and type(pool) is MiniMaxM3Nvfp4IndexKPoolHost:
        # MiniMax-M3.1's NVFP4 index keys: one row per page and layer, like DSA's
        return _host_shape(
            pool, "indexer", pool.kv_buffer, name=name, encoding=NVFP4_ROWS, model_layers=False
        )
    if name == PoolName.INDEXER and type(pool) is MHATokenToKOnlyPoolHost:
        # MiniMax-M3's sparse index keys: the pool numbers the sparse layers from 0
        return _host_shape(
            pool, "index_k", pool.k_buffer, name=name, head_num=pool.head_num, model_layers=False
        )
    if name == PoolName.INDEXER:
        reason = (
            "kvconn stores DeepSeek-V3.2's DSA indexer (DSAIndexerPoolHost) and MiniMax-M3's "
            "index keys (MHATokenToKOnlyPoolHost, MiniMaxM3Nvfp4IndexKPoolHost), not this one"
        )
    elif name.startswith("deepseek_v4_"):
        reason = "DeepSeek-V4's compressed and state pools are not stored"
    else:
        reason = _SIDE_POOLS_REFUSED.get(name, "kvconn does not know this pool")
    raise ConfigError(
        f"the kvconn HiCache backend cannot store the {name!r} pool ({kind}): {reason}; "
        "run this model without L3 storage or with another HiCache storage backend"
    )


#: What MiniMax-M3.1's NVFP4 page rows are (SGLang's MSA-v1 row: each component 128-byte
#: aligned), in place of their buffers' uint8 in the roles' dtypes.
NVFP4_ROWS = "nvfp4-msa-v1"


def _nvfp4_heads(pool: Any) -> int:
    """The K/V heads of this rank in an NVFP4 main row, by SGLang's own row width
    (``msa_v1_page_row_bytes``: head_dim 128, as SGLang's MSA-v1 cache requires)."""
    width = pool.row_bytes
    for heads in range(1, width + 1):
        main, _ = msa_v1_page_row_bytes(heads, 128, 128, pool.page_size)
        if main == width:
            return heads
        if main > width:
            break
    raise LayoutError(
        f"{type(pool).__name__}: a {width}-byte row is no MSA-v1 main row of "
        f"{pool.page_size}-token pages for any head count"
    )


def _host_shape(pool: Any, kind: str, buffer: torch.Tensor, **more: Any) -> HostPoolShape:
    """What the layout needs of a host pool whose pages live in one buffer."""
    return HostPoolShape(
        kind=kind,
        layout=pool.layout,
        page_size=pool.page_size,
        layer_num=pool.layer_num,
        size=pool.size,
        kv_buffer=buffer,
        start_layer=pool.start_layer,
        **more,
    )


def _mamba_shape(pool: Any, name: str) -> HostPoolShape:
    """A hybrid linear-attention model's Mamba host pool: one recurrent state per slot,
    in the buffers SGLang's flat page concatenates (``MambaPoolHost._iter_page_tensors``:
    the temporal state, each conv state, then any registered side states)."""
    components = (
        ("temporal", pool.temporal_buffer),
        *((f"conv{i}", buffer) for i, buffer in enumerate(pool.conv_buffer)),
        *((f"state{i}", buffer) for i, buffer in enumerate(pool.slot_state_buffers)),
    )
    for part, buffer in components:
        if not isinstance(buffer, torch.Tensor):
            raise LayoutError(f"the {name!r} pool's {part} buffer is not a tensor")
    return HostPoolShape(
        kind="mamba",
        layout=pool.layout,
        page_size=pool.page_size,
        layer_num=pool.num_mamba_layers,
        size=pool.size,
        kv_buffer=next((b for _, b in components if b.numel()), components[0][1]),
        name=name,
        own_slots=True,
        components=components,
        model_layers=False,
    )


def _published_server_args() -> Any:
    """SGLang's ``ServerArgs`` of this server, or ``None`` when none were published."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception as exc:  # a storage built outside a server (tests, tools)
        log.info("kvconn HiCache storage: no published server arguments (%s)", exc)
        return None


def _served_model_config() -> Any:
    """SGLang's ``ModelConfig`` of the served model, or ``None`` when it cannot be read."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        server_args = _published_server_args()
        if server_args is None:
            return None
        return ModelConfig.from_server_args(server_args)
    except Exception as exc:  # a config SGLang cannot read
        log.info("kvconn HiCache storage: the model's KV head count is unknown (%s)", exc)
        return None


def _draft_checkpoint() -> tuple[Any, str, str | None] | None:
    """SGLang's published server arguments, with the speculative draft model's path and
    revision, or ``None`` (no separate draft checkpoint, or no published arguments)."""
    server_args = _published_server_args()
    path = getattr(server_args, "speculative_draft_model_path", None)
    if not path:
        return None
    return server_args, path, getattr(server_args, "speculative_draft_model_revision", None)


def _draft_model_config() -> Any:
    """SGLang's ``ModelConfig`` of the speculative draft model, or ``None`` (no draft
    model, no published server arguments, or a config SGLang cannot read)."""
    checkpoint = _draft_checkpoint()
    if checkpoint is None:
        return None
    server_args, path, _ = checkpoint
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return ModelConfig.from_server_args(server_args, model_path=path, is_draft_model=True)
    except Exception as exc:  # a config SGLang cannot read
        log.info("kvconn HiCache storage: the draft model's KV head count is unknown (%s)", exc)
        return None


def _draft_weights() -> str | None:
    """The draft model's weights (``--speculative-draft-model-path`` and its revision,
    :attr:`EngineModel.tag`), or ``None``: no separate draft checkpoint (an MTP head of
    the served model's own), or no published server arguments."""
    checkpoint = _draft_checkpoint()
    return None if checkpoint is None else EngineModel.of(*checkpoint[1:]).tag


def _units_or_per_rank(pool: HostPoolShape, tp: int, served: int | None) -> int:
    """A pool's K/V units from the model's head count; one that is unknown or does not
    fit the pool's heads keys every rank's K/V separately (with a warning): assumed
    wrongly, it would store two ranks' different heads as one page."""
    try:
        return kv_units(pool.head_num, tp, served)
    except LayoutError as exc:
        log.warning(
            "kvconn HiCache storage: the %r pool: %s; keying every rank's K/V separately",
            pool.name,
            exc,
        )
        return kv_units(pool.head_num, tp, None)


def swa_kv_heads(config: Any) -> int:
    """The global KV head count of a model's sliding-window layers, by SGLang's own rule
    (``ModelConfig.get_swa_num_kv_heads``, which gives it per rank): the config's
    ``swa_num_key_value_heads``, Step-3.5's ``num_attention_groups``, else the full
    layers' count (``SWAKVPool`` then gives both pools one head count)."""
    text = config.hf_text_config
    if hasattr(text, "swa_num_key_value_heads"):
        return int(text.swa_num_key_value_heads)
    other = getattr(text, "attention_other_setting", None)
    if other is not None:
        return int(other.get("num_attention_groups"))
    return int(config.get_total_num_kv_heads())
