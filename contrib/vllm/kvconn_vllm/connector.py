"""kvconn as a vLLM v1 KV connector (``KVConnectorBase_V1``), off the critical path.

Scheduler side (no KV tensors, no torch for keys): ``get_num_new_matched_tokens``
answers from a torch-free kvconn ``Lookup`` of the request's block hashes past vLLM's
own hit, within ``lookup_wait_s``: a store slower than that gets "ask again later"
(``None``), and an answer still missing after ``lookup_timeout_s`` is a miss, so the
scheduler never waits on a store. The layout it needs for keys arrives from the workers
at start-up as a dict (vLLM's handshake metadata). A hit is an asynchronous load
(``load_kv_async=True``): vLLM allocates the blocks and parks the request until the
workers report it through ``get_finished``. Each step's metadata tells every worker which
blocks to load and which to save (blocks that this step fills).

Worker side: ``register_kv_caches`` describes the rank's per-layer tensors as a kvconn
layout and starts kvconn's transfer service (:mod:`kvconn.transfer`), the one every
engine adapter uses. ``start_load_kv`` submits the step's loads and returns;
``wait_for_save`` hands the step's filled blocks over: their pages are captured into
staging then (on a GPU, queued on a side stream after the forward, and
``handle_preemptions`` orders the next step after it), and the service stores them in
the background with one ``exists`` and one ``put`` for the step. ``get_finished`` reports
loads done, and finished requests whose saves no longer need their blocks (captured):
``request_finished`` keeps a finished request's blocks until then. Blocks that did not
load are reported by ``get_block_ids_with_load_errors`` (one KV-cache group) or the
request as a failed receive (several groups, which vLLM 0.32 takes only per request), so
vLLM recomputes them (``kv_load_failure_policy="recompute"``).

Hybrid models (``SupportsHMA``): vLLM keeps its hybrid KV-cache manager on, and each of
its KV-cache groups (full attention, sliding window, chunked local attention, Mamba
state) is a kvconn layer group; a sliding or chunked group's null blocks outside its
window are kvconn's ``NO_SLOT``. A
Mamba group (``mamba_cache_mode="align"``) has window 1: a hit needs the state after its
last block. Its states are saved from the blocks vLLM names in the step's
``boundary_state_offloads``, captured in that step's ``wait_for_save``, before vLLM may
free them; a load puts the state in the block vLLM allocated at the hit's last position.

Pipeline parallelism: each stage's workers describe their own layers (numbered as in
the model, from vLLM's layer names), so each stage saves and loads its own pages, and
the scheduler, which hears from every stage's workers at start-up
(``set_xfer_handshake_metadata_pp_aware``), looks up every stage's pages in one
``exists``: a block is a hit only where every stage holds it.

Block hashes are vLLM's own (``request.block_hashes``), adopted under the scheme
``vllm:<prefix_caching_hash_algo>``; they reach workers inside the metadata because
only the scheduler has them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
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
from kvconn.cpus import AUTO, connecting_on
from kvconn.errors import ConfigError
from kvconn.hashing import adopt_hashes
from kvconn.layout import NO_SLOT, KvLayout
from kvconn.lograte import LogInterval
from kvconn.lookup import DeadlineLookup, Lookup
from kvconn.results import LoadResult
from kvconn.transfer import LoadRequest, SaveRequest, TransferService
from kvconn.transfer import Transfer as Handle
from kvconn_vllm.blocks import BlockTable
from kvconn_vllm.cpus import vllm_transfer_cpus
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
    vLLM block ids (``NO_SLOT`` for a null block: nothing of that group moves)."""

    req_id: str
    hashes: list[bytes]
    slots: dict[int, list[int]]


@dataclass
class KvconnMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: the step schedules no token: vLLM polls its connectors, waiting on their loads
    idle: bool = False


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
    computed: int = 0  # leading blocks vLLM had itself when kvconn was first asked
    hit_end: int = 0  # blocks vLLM had or kvconn loaded: their states are not saved again
    saves_sent: bool = False  # some of its blocks were handed over for saving


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


def eagle_hit(prefixes: Iterable[int]) -> int:
    """The longest hit ``N`` (in blocks) whose next block is a hit too: vLLM's EAGLE
    block drop, for a connector's hit as for its own prefix cache.

    An EAGLE or MTP head's cache entry at a position is computed from the token after
    it, so the last entry of a hit depends on a token outside the hit's hash: vLLM drops
    the last block of every hit when such a head drafts (``use_eagle_block_drop``),
    recomputing it. kvconn's hit obeys the same rule: ``N`` with ``N + 1`` restorable too
    (for a sliding window, its window and one more block), so the last loaded entry was
    computed from the token this request has there. ``prefixes``: every restorable hit.
    """
    found = set(prefixes)
    return max((n for n in found if n + 1 in found), default=0)


def wait_while_idle(handles: Sequence[Handle], wait_s: float, *, reported: bool = False) -> None:
    """An idle step's wait: until one of ``handles`` (this rank's loads, oldest first) is
    done, or ``wait_s`` has passed; the whole ``wait_s`` when the rank has none.

    At once if one is done already or ``wait_s`` is 0. Only the oldest is waited on: the
    load threads take loads in the order they were submitted, so it finishes first.
    At once too on a rank with no load left that ``reported`` loads in the step before:
    vLLM admits a request once every rank has reported its load, so a rank behind the
    others reports it in this step, and a wait here would only hold that step (at TP=2
    it held the step that admitted a fresh hit 3.3-5.1 ms; docs/performance.md).
    """
    if wait_s <= 0 or any(h.done() for h in handles) or (reported and not handles):
        return
    if handles:
        handles[0].wait(wait_s)
    else:
        time.sleep(wait_s)


def _transfer_cpus() -> frozenset[int] | None:
    """The cores vLLM keeps for KV transfers on this rank, if any (kvconn_vllm.cpus)."""
    from vllm.platforms import current_platform

    try:
        cpus = vllm_transfer_cpus(current_platform)
    except ValueError as exc:  # a bind list vLLM itself would have refused first
        log.warning("kvconn: transfer threads stay on the step's cores: %s", exc)
        return None
    if cpus is not None:
        log.info(
            "kvconn: transfer threads on CPUs %s, which vLLM keeps for KV transfers "
            "(the step runs on %s)",
            sorted(cpus),
            sorted(os.sched_getaffinity(0)),
        )
    return cpus


def pipeline_layouts(
    metadata: Mapping[tuple[int, int], KVConnectorHandshakeMetadata], pp_size: int
) -> list[KvLayout]:
    """Per pipeline stage, in stage order, the one layout its TP ranks described; none
    before the workers have described any.

    The TP ranks of a stage must agree (a page's key is the same on every rank that holds
    it), and every stage must be there: a lookup that missed a stage's pages would
    promise blocks that stage cannot load.
    """
    stages: dict[int, dict[int, KvLayout]] = {}
    for (pp_rank, tp_rank), meta in metadata.items():
        if isinstance(meta, LayoutHandshake):
            stages.setdefault(pp_rank, {})[tp_rank] = KvLayout.from_dict(meta.layout)
    if not stages:
        return []
    if sorted(stages) != list(range(pp_size)):
        raise ConfigError(
            f"kvconn got KV layouts from pipeline stages {sorted(stages)} of {pp_size}: "
            "a lookup must plan every stage's pages"
        )
    layouts = []
    for pp_rank in sorted(stages):
        first, *others = stages[pp_rank].values()
        if any(layout != first for layout in others):
            stage = f" of pipeline stage {pp_rank}" if pp_size > 1 else ""
            raise ConfigError(f"vLLM workers{stage} described different KV layouts to kvconn")
        layouts.append(first)
    return layouts


def _tp_group(config: ConnectorConfig) -> Any:
    """A gloo group of this worker's TP ranks, or ``None`` when kvconn has no use for one.

    Over it kvconn compares the bytes of pages several ranks hold, at the first save and
    then 1 save in ``verify_replicas_every`` (:mod:`kvconn.replica_check`), and with
    ``stripe_reads`` reads each such page once per group (:mod:`kvconn.striped_load`).
    kvconn's own group, not vLLM's: its collectives run on a transfer thread and must
    not interleave with vLLM's. gloo on every device: it moves verified host staging
    rows (the tested path). Collective: every rank of the world creates every TP group's,
    in the same order.
    """
    if not config.stripe_reads and config.verify_replicas_every == 0:
        return None
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp.world_size == 1:
        return None
    mine = None
    for ranks in tp.group_ranks:
        group = dist.new_group(ranks, backend="gloo")
        if tp.rank in ranks:
            mine = group
    return mine


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
        self._pp_size = parallel.pipeline_parallel_size
        # What kvconn stores, from vLLM's spec objects; refuses what it cannot (Mamba…)
        self._groups = cache_groups(vllm_config, kv_cache_config)
        self._group_ids = [g.index for g in self._groups]
        self._state_groups = frozenset(g.index for g in self._groups if g.kind == "mamba")
        # vLLM takes load failures of a model with several groups only per request
        # (failed_recving), of one group per block (invalid_block_ids)
        self._per_request_failures = len(self._groups) > 1
        self._config = connector_config(vllm_config)
        self._scheme = hash_scheme(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        speculative = vllm_config.speculative_config
        self._eagle = speculative is not None and speculative.use_eagle_block_drop()
        self._tp_size = parallel.tensor_parallel_size
        transfer = vllm_config.kv_transfer_config
        self._loads_hits = bool(transfer.is_kv_consumer)  # kv_consumer / kv_both
        self._saves_blocks = bool(transfer.is_kv_producer)  # kv_producer / kv_both
        # scheduler side
        self._asker: DeadlineLookup | None = None
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (blocks vLLM had, kvconn hit)
        self._adopted: dict[str, list[bytes]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, Transfer] = {}
        # Blocks an admitted load brings, and by whom. Only with vLLM's prefix cache: it
        # caches a finished load's blocks, so a request that needs the same ones next
        # waits a step for them instead of loading its own copy.
        self._shares_loads = bool(vllm_config.cache_config.enable_prefix_caching)
        self._incoming: dict[bytes, str] = {}
        self._brings: dict[str, list[bytes]] = {}
        self._no_layout_misses = 0  # lookups answered as misses before the layout came
        #: Requests a load failed for: vLLM recomputes them, and they are not promised a
        #: hit again (a worker whose store is in back-off fails every retry at once).
        self._load_failed: set[str] = set()
        self._no_layout_log = LogInterval()
        # worker side
        self._conn: Connector | None = None
        self._service: TransferService | None = None
        self._loading: dict[str, tuple[Handle, Transfer]] = {}  # submitted, by request
        self._saving: dict[str, list[Handle]] = {}  # handed over, by request
        self._finishing: set[str] = set()  # finished requests waiting on their captures
        self._failed: set[int] = set()  # block ids whose load failed, to report
        self._reported_loads = False  # the last get_transfer_results reported a load
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
            shard_heads=self._config.shard_heads,
        )
        self._layout = layout
        auto = self._config.transfer_cpus == AUTO  # else the setting decides, not vLLM
        cpus = _transfer_cpus() if auto else None
        # The backend client's own threads (Mooncake's) go with a CPU list the user names,
        # not to the one core vLLM keeps: sharing it with kvconn's transfer threads, they
        # made Mooncake's loads 1.2-3x slower (docs/performance.md, 2026-12-06)
        with connecting_on(self._config.transfer_cpus):
            self._conn = Connector(
                self._config,
                layout,
                rank=get_tensor_model_parallel_rank(),
                pools=pools,
                group=_tp_group(self._config),
            )
        self._service = TransferService(self._conn, cpus=cpus)

    def get_handshake_metadata(self) -> LayoutHandshake | None:
        return None if self._layout is None else LayoutHandshake(self._layout.to_dict())

    def _transfers(self) -> TransferService:
        assert self._service is not None, "register_kv_caches has not run"
        return self._service

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a step that may overwrite freed blocks: order it after the captures.

        Saves are captured when handed over, so a preempted request's blocks hold nothing
        the store still needs; on a GPU the capture runs on a side stream, which the
        step's stream now waits for (on the device, not the host). Runs every step.
        """
        self._transfers().order_reuse()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submit this step's loads; they finish in the background (``get_finished``).

        In a step that computes nothing, they run on the step's own cores, idle until
        they are done (``load_many``'s ``idle``).
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvconnMetadata)
        requests = [LoadRequest(load.hashes, load.slots, load.req_id) for load in meta.loads]
        # the load threads woken once
        handles = self._transfers().load_many(requests, idle=meta.idle)
        for handle, load in zip(handles, meta.loads):
            self._loading[load.req_id] = (handle, load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request runs only once its load is reported done."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Pages hold every layer of a block, so they are handed over after the step."""

    def wait_for_save(self) -> None:
        """Hand the step's filled blocks over: captured now, stored in the background."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvconnMetadata)
        if not meta.saves:
            return
        requests = [SaveRequest(s.hashes, s.slots, tag=s.req_id) for s in meta.saves]
        for save, handle in zip(meta.saves, self._transfers().save_many(requests)):
            self._saving.setdefault(save.req_id, []).append(handle)

    def _wait_when_idle(self) -> None:
        """In a step that computes nothing, wait up to ``idle_wait_s``: for this rank's
        oldest load if it has loads in flight, else the whole time.

        While a hit loads and nothing else runs, vLLM's engine loop steps without pause
        (schedule, an empty step, poll the connector): on a CPU it takes the core and,
        in this process, the GIL from the load it waits for (a 47 MiB load took 2.5
        memcpys in vLLM against 1.6 outside it; docs/performance.md). Waiting here for
        the oldest load, which the load threads finish first, returns as soon as one
        is done. A rank with no load of its own waits too: the step then waits on
        another rank's load, a lookup or a save, and its empty steps took the CPU that
        work needs (at TP=2 the rank done first spun at 93% of its core while the other
        waited on a redis-server that got none; docs/performance.md). Not in the step
        right after it reported its loads: the ranks behind it report theirs in that
        step, which would wait for this rank's sleep.
        """
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvconnMetadata) and meta.idle:
            wait_while_idle(
                [h for h, _ in self._loading.values()],
                self._config.idle_wait_s,
                reported=self._reported_loads,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads done (a failed one also reported, with its blocks or as a failed
        receive), and finished requests whose saves have all been captured."""
        service = self._transfers()
        self._wait_when_idle()
        service.finished()  # lets the service fail loads past load_timeout_s
        recving: set[str] = set()
        failed_reqs: set[str] = set()
        for req_id, (handle, load) in list(self._loading.items()):
            if not handle.done():
                continue
            del self._loading[req_id]
            recving.add(req_id)
            result = handle.result
            if result.ok:
                continue
            failed = result.failed if isinstance(result, LoadResult) else ()
            log.warning(
                "kvconn: %d of %d blocks of request %s did not load; vLLM recomputes %s",
                len(failed),
                len(load.hashes),
                req_id,
                "the request" if self._per_request_failures else "them",
            )
            if self._per_request_failures:
                failed_reqs.add(req_id)
            else:
                self._failed.update(
                    slots[i] for slots in load.slots.values() for i in failed if slots[i] != NO_SLOT
                )
        self._reported_loads = bool(recving)
        self._finishing.update(r for r in finished_req_ids if r in self._saving)
        sending = {r for r in self._finishing if all(h.captured() for h in self._saving.get(r, ()))}
        for r in sending:
            self._finishing.discard(r)
            self._saving.pop(r, None)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed_reqs
        )

    def shutdown(self) -> None:
        if self._service is not None:
            clean = self._service.close()
            self._service = None
            if not clean:  # a thread is inside a stalled backend call: leave the backend
                self._conn = None
        if self._conn is not None:
            log.info("kvconn: %s", self._conn.stats.snapshot()["total"])
            self._conn.close()
            self._conn = None
        if self._asker is not None:
            self._asker.close()
            self._asker.lookup.close()
            self._asker = None

    # ============================================================ scheduler side
    def set_xfer_handshake_metadata(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' layouts by TP rank (one pipeline stage)."""
        self.set_xfer_handshake_metadata_pp_aware({(0, rank): m for rank, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' layouts by (PP rank, TP rank): how the scheduler learns the keys.

        Under pipeline parallelism each stage's workers hold other layers, hence other
        pages (a page's key names its layers), so the lookup plans every stage's pages
        and a block is a hit only where every stage holds its own.
        """
        layouts = pipeline_layouts(metadata, self._pp_size)
        if not layouts:
            return
        if self._asker is not None:
            self._asker.close()
            self._asker.lookup.close()
        self._asker = DeadlineLookup(  # torch-free
            Lookup(self._config, layouts[0], stages=layouts[1:])
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The hit past vLLM's own, loaded asynchronously; ``None``: ask again later.

        Also "later" while another request's load brings the next block this one needs:
        vLLM caches that load's blocks before it admits anyone else (requests holding
        blocks go first), so this one then finds them in vLLM's cache. Eight requests
        that share a stored prefix then load it once, not eight times.
        """
        hashes = self._hashes(request)
        done = num_computed_tokens // self._block_size
        # vLLM must compute at least one token of the prompt itself.
        usable = min(len(hashes), (request.num_tokens - 1) // self._block_size)
        if usable > done and self._incoming.get(hashes[done], request.request_id) != (
            request.request_id
        ):
            return None, False
        hit = 0
        if usable > done and self._loads_hits and request.request_id not in self._load_failed:
            if self._asker is not None:
                answer = self._asker.ask(request.request_id, hashes[done:usable])
                if answer is None:
                    return None, False  # the store has not answered within lookup_wait_s
                found = eagle_hit(answer.prefixes()) if self._eagle else answer.blocks
                hit = min(found, usable - done)
            else:
                self._no_layout_misses += 1
                if self._no_layout_log.due():
                    log.warning(
                        "kvconn: no layout from the workers yet; lookups are answered as "
                        "misses (%d so far)",
                        self._no_layout_misses,
                    )
        self._hits[request.request_id] = (done, hit)
        return hit * self._block_size, hit > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if req_id not in self._hits and req_id in self._tracked:
            return  # vLLM's second call, once a deferred load is done: nothing new
        done, hit = self._hits.pop(req_id, (0, 0))
        # The blocks vLLM allocated: a load goes into them, and a load that fails is
        # found by them (update_connector_output) before the request is scheduled.
        table = self._block_table()
        table.replace(blocks.get_block_ids())
        if num_external_tokens > 0:
            count = num_external_tokens // self._block_size
            hashes = self._hashes(request)[done : done + count]
            states = table.resume_states(done + count - 1)
            self._loads[req_id] = Transfer(req_id, hashes, table.slots(done, done + count, states))
            if self._shares_loads:
                brings = [h for h in hashes if self._incoming.setdefault(h, req_id) == req_id]
                # Added to, not replaced: a claim still held stays released by _arrived.
                self._brings.setdefault(req_id, []).extend(brings)
        # What vLLM or kvconn already had is not saved again; a later step's new
        # blocks arrive through build_connector_meta.
        before = self._tracked.get(req_id)  # a preempted request, resumed
        tracked = _Tracked(request, table, done + hit, done, hit_end=done + hit)
        # Saves handed over before the preemption still make request_finished hold its
        # blocks: the workers report it only then, and both sides must agree.
        tracked.saves_sent = before is not None and before.saves_sent
        self._tracked[req_id] = tracked

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvconnMetadata:
        meta = KvconnMetadata(
            loads=list(self._loads.values()),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
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
        offers = self._state_offers(scheduler_output)
        for req_id in [*computed, *(r for r in offers if r not in computed)]:
            tracked = self._tracked[req_id]
            hashes = self._hashes(tracked.request)
            states = offers.get(req_id, {})
            start, full = tracked.saved, tracked.saved
            if req_id in computed:
                after = computed[req_id] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                full = max(start, min(after // self._block_size, len(hashes), len(tracked.blocks)))
            # a state named for a block whose pages are not saved in this step (saved in
            # an earlier one): a save of its own
            apart = sorted(
                {i for named in states.values() for i in named} - set(range(start, full))
            )
            for i in apart:
                only = {g: {i: named[i]} for g, named in states.items() if i in named}
                slots = tracked.blocks.slots(i, i + 1, only)
                slots = {g: row if g in only else [NO_SLOT] for g, row in slots.items()}
                meta.saves.append(Transfer(req_id, hashes[i : i + 1], slots))
            if full > start:
                meta.saves.append(
                    Transfer(req_id, hashes[start:full], tracked.blocks.slots(start, full, states))
                )
                tracked.saved = full
            tracked.saves_sent |= bool(apart) or full > start
        return meta

    def _state_offers(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, dict[int, dict[int, int]]]:
        """The Mamba states vLLM committed this step, ``{request: {group: {position:
        block id}}}``: those of tracked requests that end on a block boundary, past what
        the request had from vLLM's cache or kvconn's hit, and within its hashes.

        vLLM also names states that end mid-block (a prompt's partial tail) and the
        states a finished load brought; kvconn keys whole blocks, and has those.
        """
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) if block_state else None
        out: dict[str, dict[int, dict[int, int]]] = {}
        for req_id, entries in (offloads or {}).items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            count = len(self._hashes(tracked.request))
            for group, block_id, tokens in entries:
                position, rest = divmod(tokens, self._block_size)
                position -= 1
                if group in self._state_groups and not rest and tracked.hit_end <= position < count:
                    out.setdefault(req_id, {}).setdefault(group, {})[position] = block_id
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them once they are.

        A finished load's blocks are no longer on their way: vLLM caches those that
        loaded before it admits a request that waited for them.
        """
        for req_id in connector_output.finished_recving or ():
            self._arrived(req_id)
        for req_id in connector_output.failed_recving or ():
            self._load_failed.add(req_id)
            tracked = self._tracked.get(req_id)
            if tracked is not None:  # vLLM recomputes the whole request
                tracked.saved = tracked.hit_end = min(tracked.saved, tracked.computed)
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for req_id, tracked in self._tracked.items():
            first = tracked.blocks.first_in(self._group_ids[0], invalid, tracked.saved)
            if first is not None:
                tracked.saved = first
                tracked.hit_end = min(tracked.hit_end, first)
                self._load_failed.add(req_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) while saves handed over for the request may still read
        them; the workers' ``get_finished`` releases it once its pages are captured."""
        return self._forget(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of ``request_finished`` on an ``SupportsHMA`` connector."""
        return self._forget(request.request_id), None

    def _forget(self, req_id: str) -> bool:
        """Drop a finished request; whether saves of it were handed over."""
        tracked = self._tracked.get(req_id)
        for table in (self._hits, self._adopted, self._tracked, self._loads):
            table.pop(req_id, None)
        self._load_failed.discard(req_id)
        self._arrived(req_id)
        if self._asker is not None:
            self._asker.forget(req_id)
        return tracked is not None and tracked.saves_sent

    def _arrived(self, req_id: str) -> None:
        """The blocks ``req_id``'s load brings are no longer awaited (loaded, failed or
        abandoned): a request waiting on them asks again, and finds or loads them."""
        for digest in self._brings.pop(req_id, ()):
            if self._incoming.get(digest) == req_id:
                del self._incoming[digest]

    def _block_table(self) -> BlockTable:
        return BlockTable(self._group_ids, NULL_BLOCK_ID, self._state_groups)

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
