"""kvconn as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Scheduler side (no KV tensors): ``get_num_new_matched_tokens`` answers from one kvconn
``lookup`` of the request's block hashes past vLLM's own hit; the layout it needs for
keys arrives from the workers at start-up as a dict (vLLM's handshake metadata), so the
scheduler never touches a tensor. Each step's metadata tells every worker which blocks
to load (a hit just allocated) and which to save (blocks that this step fills).

Worker side: ``register_kv_caches`` describes the rank's per-layer tensors as a kvconn
layout; ``start_load_kv`` loads before the forward pass and ``wait_for_save`` saves
after it, synchronously, both through kvconn's ``Connector``. Blocks that did not load
are reported by ``get_block_ids_with_load_errors``, so vLLM recomputes them (with
``kv_load_failure_policy="recompute"``).

Hybrid models (``SupportsHMA``): vLLM keeps its hybrid KV-cache manager on, and each of
its KV-cache groups (full attention, sliding window) is a kvconn layer group; a sliding
group's null blocks outside its window are kvconn's ``NO_SLOT``. vLLM 0.32 cannot take
block-level load failures from a model with several groups (the scheduler raises), only
failed *requests* of an asynchronous load (``failed_recving``). So with several groups
a hit is announced as an asynchronous load: the worker still loads it synchronously in
``start_load_kv`` of the next step and reports the request finished, or failed, in the
same step; vLLM then recomputes a failed request from its first token.

Block hashes are vLLM's own (``request.block_hashes``), adopted under the scheme
``vllm:<prefix_caching_hash_algo>``; they reach workers inside the metadata because
only the scheduler has them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import ConfigError
from kvconn.hashing import adopt_hashes
from kvconn.layout import NO_SLOT, KvLayout
from kvconn_vllm.blocks import BlockTable
from kvconn_vllm.layout import kv_layout
from kvconn_vllm.specs import cache_groups, dtype_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvconn.vllm")

__all__ = ["KvconnConnector", "KvconnMetadata", "LayoutHandshake", "Transfer"]


@dataclass
class Transfer:
    """Blocks of one request to load or save: kvconn digests and, per KV-cache group,
    vLLM block ids (``NO_SLOT`` for a null block: nothing of that group moves).

    ``deferred``: a load vLLM waits for as an asynchronous one, whose failure is
    reported per request (models with several KV-cache groups).
    """

    req_id: str
    hashes: list[bytes]
    slots: dict[int, list[int]]
    deferred: bool = False


@dataclass
class KvconnMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class LayoutHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """A worker's layout, as ``KvLayout.to_dict()``: how the scheduler learns the keys."""

    layout: dict[str, Any]


@dataclass
class _Tracked:
    """A running request, as the scheduler side follows it."""

    request: Request
    blocks: BlockTable
    saved: int  # leading blocks known to be stored (hit, or saved by an earlier step)


def connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    """kvconn's configuration as every adapter reads it (:mod:`kvconn.engine_settings`):
    ``kv_connector_extra_config``, overlaid by ``$KVCONN_CONFIG`` and ``KVCONN_*``
    variables, ``model`` defaulting to the weights vLLM loads (model, revision and
    weight quantization, which changes the KV values)."""
    from kvconn.engine_settings import EngineModel, adapter_config

    model = vllm_config.model_config
    return adapter_config(
        vllm_config.kv_transfer_config.kv_connector_extra_config,
        engine_model=EngineModel.of(model.model, model.revision, model.quantization),
        where="kv_connector_extra_config",
    )


def hash_scheme(vllm_config: VllmConfig) -> str:
    return f"vllm:{vllm_config.cache_config.prefix_caching_hash_algo}"


class KvconnConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Select with ``KVTransferConfig(kv_connector="KvconnConnector",
    kv_connector_module_path="kvconn_vllm", kv_connector_extra_config={kvconn config})``.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("kvconn's vLLM adapter does not support pipeline parallelism yet")
        # What kvconn stores, from vLLM's spec objects; refuses what it cannot (Mamba…)
        self._groups = cache_groups(vllm_config, kv_cache_config)
        self._group_ids = [g.index for g in self._groups]
        # vLLM takes load failures of a model with several groups only per request,
        # from an asynchronous load (module docstring)
        self._defer_loads = len(self._groups) > 1
        self._config = connector_config(vllm_config)
        self._scheme = hash_scheme(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = parallel.tensor_parallel_size
        transfer = vllm_config.kv_transfer_config
        self._loads_hits = bool(transfer.is_kv_consumer)  # kv_consumer / kv_both
        self._saves_blocks = bool(transfer.is_kv_producer)  # kv_producer / kv_both
        self._conn: Connector | None = None
        # scheduler side
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (blocks vLLM had, kvconn hit)
        self._adopted: dict[str, list[bytes]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, Transfer] = {}
        self._warned_no_layout = False
        # worker side
        self._failed: set[int] = set()  # block ids of synchronous loads that failed
        self._recved: set[str] = set()  # deferred loads done this step
        self._failed_reqs: set[str] = set()  # deferred loads that failed this step
        self._layout: KvLayout | None = None

    # ============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        vllm_config = self._vllm_config
        layout, pools = kv_layout(
            kv_caches,
            self._groups,
            num_blocks=self._kv_cache_config.num_blocks,
            block_size=self._block_size,
            tp_size=self._tp_size,
            dtype_tags={name: dtype_tag(vllm_config, name, t) for name, t in kv_caches.items()},
        )
        self._layout = layout
        self._conn = Connector(
            self._config, layout, rank=get_tensor_model_parallel_rank(), pools=pools
        )

    def get_handshake_metadata(self) -> LayoutHandshake | None:
        return None if self._layout is None else LayoutHandshake(self._layout.to_dict())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvconnMetadata) and self._conn is not None
        for load in meta.loads:
            result = self._conn.load(load.hashes, load.slots)
            if load.deferred:
                self._recved.add(load.req_id)
            if not result.failed:
                continue
            log.warning(
                "kvconn: %d of %d blocks of request %s did not load; vLLM recomputes %s",
                len(result.failed),
                len(load.hashes),
                load.req_id,
                "the request" if load.deferred else "them",
            )
            if load.deferred:
                self._failed_reqs.add(load.req_id)
            else:
                self._failed.update(
                    slots[i]
                    for slots in load.slots.values()
                    for i in result.failed
                    if slots[i] != NO_SLOT
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``: before the forward pass for a synchronous
        load; for a deferred one in a step that does not compute its request."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Pages hold every layer of a block, so saving waits for the whole step."""

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvconnMetadata) and self._conn is not None
        for save in meta.saves:
            self._conn.save(save.hashes, save.slots)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Deferred loads finish in the step that ran them; a failed one is recomputed."""
        recved, self._recved = self._recved, set()
        failed, self._failed_reqs = self._failed_reqs, set()
        return KVConnectorTransferResults(finished_recving=recved, failed_recving=failed)

    def shutdown(self) -> None:
        if self._conn is not None:
            log.info("kvconn: %s", self._conn.stats.snapshot()["total"])
            self._conn.close()
            self._conn = None

    # ============================================================ scheduler side
    def set_xfer_handshake_metadata(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        layouts = {
            rank: KvLayout.from_dict(m.layout)
            for rank, m in metadata.items()
            if isinstance(m, LayoutHandshake)
        }
        if not layouts:
            return
        first = next(iter(layouts.values()))
        if any(layout != first for layout in layouts.values()):
            raise ConfigError("vLLM workers described different KV layouts to kvconn")
        if self._conn is not None:
            self._conn.close()
        self._conn = Connector(self._config, first)  # lookup only: no pools

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        hashes = self._hashes(request)
        done = num_computed_tokens // self._block_size
        # vLLM must compute at least one token of the prompt itself.
        usable = min(len(hashes), (request.num_tokens - 1) // self._block_size)
        hit = 0
        if usable > done and self._loads_hits:
            if self._conn is not None:
                hit = min(self._conn.lookup(hashes[done:usable]).blocks, usable - done)
            elif not self._warned_no_layout:
                log.warning("kvconn: no layout from the workers yet; serving without it")
                self._warned_no_layout = True
        self._hits[request.request_id] = (done, hit)
        return hit * self._block_size, self._defer_loads and hit > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if req_id not in self._hits and req_id in self._tracked:
            return  # vLLM's second call, once a deferred load is done: nothing new
        done, hit = self._hits.pop(req_id, (0, 0))
        if num_external_tokens > 0:
            count = num_external_tokens // self._block_size
            table = self._block_table()
            table.replace(blocks.get_block_ids())
            self._loads[req_id] = Transfer(
                req_id,
                self._hashes(request)[done : done + count],
                table.slots(done, done + count),
                deferred=self._defer_loads,
            )
        # What vLLM or kvconn already had is not saved again; a later step's new
        # blocks arrive through build_connector_meta.
        self._tracked[req_id] = _Tracked(request, self._block_table(), done + hit)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvconnMetadata:
        meta = KvconnMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.blocks.replace(new.block_ids)
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.blocks.replace(new_ids)
            else:
                tracked.blocks.extend(new_ids)
            computed[req_id] = cached.num_computed_tokens[i]
        if not self._saves_blocks:
            return meta
        for req_id, before in computed.items():
            tracked = self._tracked[req_id]
            after = before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            hashes = self._hashes(tracked.request)
            full = min(after // self._block_size, len(hashes), len(tracked.blocks))
            if full > tracked.saved:
                meta.saves.append(
                    Transfer(
                        req_id,
                        hashes[tracked.saved : full],
                        tracked.blocks.slots(tracked.saved, full),
                    )
                )
                tracked.saved = full
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them once they are."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return  # (vLLM reports them only for a model with one KV-cache group)
        for tracked in self._tracked.values():
            first = tracked.blocks.first_in(self._group_ids[0], invalid, tracked.saved)
            if first is not None:
                tracked.saved = first

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of ``request_finished`` on an ``SupportsHMA`` connector."""
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        for table in (self._hits, self._adopted, self._tracked, self._loads):
            table.pop(req_id, None)

    def _block_table(self) -> BlockTable:
        return BlockTable(self._group_ids, NULL_BLOCK_ID)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, not a loss

    def _hashes(self, request: Request) -> list[bytes]:
        """The request's block hashes as kvconn digests, adopted once each."""
        adopted = self._adopted.setdefault(request.request_id, [])
        engine: Sequence[bytes] = request.block_hashes
        if len(engine) > len(adopted):
            adopted.extend(adopt_hashes(self._scheme, engine[len(adopted) :]))
        return adopted
