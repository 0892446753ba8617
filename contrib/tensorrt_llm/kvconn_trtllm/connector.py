"""kvconn as a TensorRT-LLM 1.2 KV-cache connector (``kv_connector_config``).

Tested against a stand-in of the connector interface and of the engine-side manager
that drives it, checked against TensorRT-LLM's source (contrib/tensorrt_llm/tests/
standin, docs/engines/tensorrt-llm.md); never against the engine itself.

Scheduler (rank 0, no KV tensors, no torch for keys): ``get_num_new_matched_tokens``
hashes the request's full blocks with kvconn's own chain, over what TensorRT-LLM's
own block keys hold (its cache salt, LoRA task and multimodal items,
:mod:`kvconn_trtllm.hashes`), and answers from one torch-free
``Lookup`` within ``lookup_timeout_s`` (a slow store is a miss, never a blocked
executor; once one lookup is that late, later requests are misses at once until the
store answers it). A hit is an *asynchronous* load: TensorRT-LLM takes the request out of the
step, the load goes into this step's metadata (broadcast to every rank), and the request
comes back once every rank's ``get_finished`` reported its load done.

Worker (every rank): ``register_kv_caches`` describes the rank's primary pool as a
kvconn layout and starts kvconn's transfer service (:mod:`kvconn.transfer`), which the
other engine adapters use too. With ``stripe_reads`` the ranks first form a gloo group
(:mod:`kvconn_trtllm.group`) and loads read each page several ranks hold once per
group: the loads are the broadcast metadata's, so every rank submits the same ones in
the same order, which striped loads need. ``start_load_kv`` submits the step's loads,
``wait_for_save`` hands the step's completed blocks over (their pages are captured into
staging then, so the executor never waits on the store); ``get_finished`` reports loads
done, and the saves of finished requests once their pages are captured: a request whose
``request_finished`` said True keeps its blocks until then. The rank-0 worker also hands
its layout (as a dict) and its store client to the scheduler next to it: that is how
the scheduler learns the keys without holding a tensor, and asks the store without a
client of its own (whose start-up probe of a silent server would hold the executor).

A promised block that did not arrive (a page evicted between lookup and load) must
not be read by the forward pass, and 1.2 has no way to ask for its recomputation. An
exception from ``start_load_kv`` would end the engine's executor loop (nothing catches
it there), and one rank failing alone would leave the others waiting in the forward's
collectives. So the ranks agree on finished and failed loads in ``get_finished`` (one
allgather, only while loads are outstanding, which every rank knows alike); the rank-0
worker tells its scheduler which requests failed, and when such a request comes back
its step's metadata names it, so every rank raises :class:`KvconnLoadError` from the
first ``wait_for_layer_load``, inside the forward, where the engine fails the active
requests with the error and serves on. The failed blocks' slots are left untouched.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)

from kvconn.calls import BackendCalls
from kvconn.connector import Connector
from kvconn.cpus import connecting_on
from kvconn.errors import ConfigError, KvconnError
from kvconn.layout import KvLayout
from kvconn.lookup import DeadlineLookup, Lookup
from kvconn.transfer import LoadRequest, SaveRequest, TransferService
from kvconn.transfer import Transfer as Handle
from kvconn_trtllm.group import tp_group
from kvconn_trtllm.hashes import request_hashes
from kvconn_trtllm.layout import describe_pool
from kvconn_trtllm.settings import TrtllmSettings

log = logging.getLogger("kvconn.trtllm")

__all__ = ["KvconnLoadError", "KvconnMetadata", "KvconnScheduler", "KvconnWorker", "Transfer"]

#: The rank-0 worker's layout (``KvLayout.to_dict()``) and its connector's store calls,
#: for the scheduler in its process: it asks the store through that one client, so
#: it shares the worker's back-off and never connects (nor probes a silent server) on
#: the executor's thread.
_published: tuple[dict[str, Any], BackendCalls] | None = None
#: Requests whose asynchronous load failed on some rank, as the ranks agreed; the rank-0
#: worker adds them, the scheduler in its process names them in their next step.
_failed_loads: set[int] = set()


class KvconnLoadError(KvconnError, RuntimeError):
    """Blocks the scheduler promised did not load; the engine must not use their slots."""


@dataclass
class Transfer:
    """Blocks of one request to move: kvconn digests and the engine's block ids."""

    request_id: int
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class KvconnMetadata:
    """What rank 0's scheduler broadcasts each step (plain data: it is pickled)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: requests back from a load that failed on some rank: their forward must fail
    failed: list[int] = field(default_factory=list)


def _tp(llm_args: Any) -> tuple[int, int]:
    """(rank, tp_size) of this process; shapes the adapter would key wrongly are refused."""
    if getattr(llm_args, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("the kvconn connector does not support pipeline parallelism yet")
    if getattr(llm_args, "enable_attention_dp", False):
        raise ConfigError("the kvconn connector does not support attention DP yet")
    from tensorrt_llm._utils import mpi_rank

    tp = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    return int(mpi_rank()) % tp, tp


def _tokens_per_block(llm_args: Any) -> int:
    return int(llm_args.kv_cache_config.tokens_per_block)


def _require_block_reuse(llm_args: Any) -> None:
    """TensorRT-LLM consults a connector only when it adds a request with block reuse on;
    without it the engine warns and never calls the connector, so kvconn would neither
    load nor save: a configuration mistake, said at start-up."""
    if not getattr(llm_args.kv_cache_config, "enable_block_reuse", True):
        raise ConfigError(
            "the kvconn connector needs kv_cache_config.enable_block_reuse=True: "
            "without block reuse TensorRT-LLM never calls a KV-cache connector"
        )


def _refuse_pools_out_of_reach(llm_args: Any) -> None:
    """An NVFP4 KV cache keeps its block scales in pools of their own, beside the values'
    pool; TensorRT-LLM hands a connector only the first primary pool
    (``get_unique_primary_pool``), so a load would restore values under another block's
    scales: refused at start-up rather than served wrong."""
    dtype = str(getattr(llm_args.kv_cache_config, "dtype", "auto") or "auto").lower()
    algo = getattr(getattr(llm_args, "quant_config", None), "kv_cache_quant_algo", None)
    algo = str(getattr(algo, "value", algo) or "").upper()
    if dtype == "nvfp4" or algo.endswith("NVFP4"):
        raise ConfigError(
            "the kvconn connector cannot store an NVFP4 KV cache: its block scales live in "
            "pools TensorRT-LLM does not hand to a KV-cache connector (only the values' "
            "pool), so loaded blocks would be read under stale scales; use an FP8 or "
            "16-bit KV cache with the connector"
        )


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (TensorRT-LLM's MPI world is the TP group:
    pipeline parallelism and attention DP are refused)."""
    from tensorrt_llm._utils import mpi_allgather

    gathered = mpi_allgather(obj)
    # without multi-device support TensorRT-LLM returns the object itself, not a list
    return gathered if isinstance(gathered, list) else [gathered]


# ------------------------------------------------------------------------ worker
class KvconnWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.rank, self.tp_size = _tp(llm_args)
        _require_block_reuse(llm_args)
        _refuse_pools_out_of_reach(llm_args)
        self.settings = TrtllmSettings.load(llm_args)
        self.connector: Connector | None = None
        self.transfers: TransferService | None = None
        #: this step's failed loads, agreed by every rank; raised inside the forward
        self._load_error: KvconnLoadError | None = None
        self._loads: dict[int, Handle] = {}  # submitted, by request
        self._started: set[int] = set()  # passed in started_loading_req_ids, not done
        self._saves: dict[int, list[Handle]] = {}  # submitted, by request
        self._finishing: set[int] = set()  # passed in finished_gen_req_ids, not reported

    def register_forward_pass_callable(self) -> None:
        """Nothing to call at the end of the forward: saves are handed over in
        ``wait_for_save``, which TensorRT-LLM calls after every forward pass."""
        return None

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        global _published
        layout = describe_pool(
            kv_cache_tensor,
            tp_size=self.tp_size,
            tokens_per_block=_tokens_per_block(self._llm_args),
            kv_heads=self.settings.kv_heads,
        )
        group = None
        if self.settings.stripe_reads and self.tp_size > 1:
            group = tp_group(self.rank, self.tp_size, _gather)
        config = self.settings.connector
        with connecting_on(config.transfer_cpus):  # a CPU list: the client's threads too
            self.connector = Connector(
                config, layout, rank=self.rank, pools=[kv_cache_tensor], group=group
            )
        self.transfers = TransferService(self.connector)
        if self.rank == 0:
            _published = (layout.to_dict(), self.connector.calls)

    def _service(self) -> TransferService:
        if self.transfers is None:
            raise ConfigError("register_kv_caches has not been called on this worker")
        return self.transfers

    def start_load_kv(self, stream: Any) -> None:
        """Submit this step's loads; arm the error of requests whose load failed."""
        self._load_error = None
        meta = self.get_connector_meta()
        if meta is None:
            return
        service = self._service()
        service.order_reuse(stream)  # blocks freed earlier may be overwritten from now on
        if meta.failed:  # the same on every rank: the metadata is broadcast
            self._load_error = KvconnLoadError(
                "kvconn: KV blocks the scheduler found did not load (evicted or unreadable) "
                f"for request(s) {sorted(meta.failed)}"
            )
        requests = [LoadRequest(t.hashes, t.block_ids, t.request_id) for t in meta.loads]
        for t, handle in zip(meta.loads, service.load_many(requests)):  # threads woken once
            self._loads[t.request_id] = handle

    def _raise_failed_load(self) -> None:
        error, self._load_error = self._load_error, None
        if error is not None:
            raise error

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Loads finish before their request is scheduled; a failed one fails it here."""
        self._raise_failed_load()

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: wait_for_save hands whole blocks over after the forward."""

    def wait_for_save(self, stream: Any) -> None:
        # a forward that ran without layer hooks read the failed slots: save none of it
        self._raise_failed_load()
        meta = self.get_connector_meta()
        if meta is None or not meta.saves:
            return
        service = self._service()
        requests = [SaveRequest(t.hashes, t.block_ids, tag=t.request_id) for t in meta.saves]
        on_stream = (
            torch.cuda.stream(stream)
            if stream is not None and torch.cuda.is_available()
            else contextlib.nullcontext()
        )
        with on_stream:  # captures queue after the forward's KV writes
            handles = service.save_many(requests)
        for t, handle in zip(meta.saves, handles):
            self._saves.setdefault(t.request_id, []).append(handle)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """(requests whose saves no longer need their blocks, requests loaded).

        Saves: a finished request is reported once every save handed over for it has its
        pages in staging. Loads: once every rank's load of the request has finished; the
        ranks agree here, and on which of them failed (see the module docstring).
        """
        service = self._service()
        service.finished()  # lets the service fail loads past load_timeout_s
        self._finishing.update(finished_gen_req_ids)
        saved = sorted(
            r for r in self._finishing if all(h.captured() for h in self._saves.get(r, ()))
        )
        for r in saved:
            self._finishing.discard(r)
            self._saves.pop(r, None)
        self._started.update(started_loading_req_ids)
        if not self._started:  # alike on every rank: no collective needed
            return saved, []
        done = {r for r in self._started if r in self._loads and self._loads[r].done()}
        failed = {r for r in done if not self._loads[r].result.ok}
        everyone = _gather((sorted(done), sorted(failed)))
        agreed = set.intersection(*(set(d) for d, _ in everyone))
        failed_anywhere = set().union(*(set(f) for _, f in everyone)) & agreed
        if self.rank == 0:
            _failed_loads.update(failed_anywhere)
        for r in agreed:
            self._started.discard(r)
            self._loads.pop(r, None)
        return saved, sorted(agreed)

    def close(self) -> None:
        """Finish or cancel transfers (the engine has no hook; tests and tools call it)."""
        if self.transfers is not None:
            clean = self.transfers.close()
            self.transfers = None
            if not clean:
                return  # a thread is inside a stalled backend call: leave the backend
        if self.connector is not None:
            self.connector.close()


# ------------------------------------------------------------------------ scheduler
@dataclass
class _Request:
    hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # full blocks already sent for saving (or loaded)
    pending_load: Transfer | None = None
    saves_sent: bool = False  # some of its blocks were handed over for saving


class KvconnScheduler(KvCacheConnectorScheduler):
    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        _, self.tp_size = _tp(llm_args)
        _require_block_reuse(llm_args)
        _refuse_pools_out_of_reach(llm_args)
        self.tokens_per_block = _tokens_per_block(llm_args)
        self.settings = TrtllmSettings.load(llm_args)
        self._lookup: DeadlineLookup | None = None
        self._requests: dict[int, _Request] = {}

    def _asker(self) -> DeadlineLookup:
        """Lookups over the layout the rank-0 worker registered, answered in time."""
        if self._lookup is None:
            if _published is None:
                raise ConfigError(
                    "no kvconn worker registered KV caches in this process: the scheduler "
                    "must run on rank 0, next to rank 0's worker"
                )
            layout, calls = _published
            lookup = Lookup(self.settings.connector, KvLayout.from_dict(layout), calls=calls)
            # 1.2 cannot be asked again later: wait up to the deadline, then a miss
            timeout = lookup.config.lookup_timeout_s
            self._lookup = DeadlineLookup(lookup, wait_s=timeout, timeout_s=timeout)
        return self._lookup

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        tokens = list(request.get_tokens(0))
        hashes = request_hashes(request, tokens, self.tokens_per_block)
        if hashes is None:  # blocks kvconn cannot key safely: neither looked up nor saved
            return 0, False
        state = _Request(hashes)
        self._requests[request.request_id] = state
        # at least one prompt token must be computed for the request to produce logits
        usable = min(len(hashes), (len(tokens) - 1) // self.tokens_per_block)
        hit = 0
        if usable:
            answer = self._asker().ask(request.request_id, hashes[:usable])
            hit = answer.blocks if answer is not None else 0
        first = num_computed_tokens // self.tokens_per_block
        if hit <= first:
            return 0, False
        state.pending_load = Transfer(request.request_id, hashes[first:hit], [])
        state.saved_blocks = hit  # loaded blocks are already in the store
        return hit * self.tokens_per_block - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """``block_ids``: all of the request's blocks, in token order."""
        state = self._requests.get(request.request_id)
        if state is not None:
            state.block_ids = list(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvconnMetadata:
        """This step's loads, the saves of the prompt blocks it completes, and the
        requests back from a failed load.

        A load starts in the step that matched it: TensorRT-LLM took the request out of
        the step, so it is not in the output; its blocks came through
        ``update_state_after_alloc``. When it comes back, its first report's
        ``computed_position`` includes the loaded tokens, so a step ends at
        ``computed_position + num_scheduled_tokens`` for every report.
        """
        meta = KvconnMetadata()
        for loading in self._requests.values():
            load, loading.pending_load = loading.pending_load, None
            if load is None:
                continue
            first = loading.saved_blocks - len(load.hashes)
            load.block_ids = loading.block_ids[first : loading.saved_blocks]
            if len(load.block_ids) != len(load.hashes):
                # fewer blocks than the hit: the engine already counts the tokens as
                # loaded, so the request must fail; an empty load still reports done
                load.hashes, load.block_ids = [], []
                _failed_loads.add(load.request_id)
            meta.loads.append(load)
        reports = [*scheduler_output.new_requests, *scheduler_output.cached_requests]
        for data in reports:
            if data.request_id in _failed_loads:
                _failed_loads.discard(data.request_id)
                meta.failed.append(data.request_id)
            state = self._requests.get(data.request_id)
            if state is None:
                continue
            known = set(state.block_ids)
            state.block_ids.extend(b for b in data.new_block_ids if b not in known)
            done = (data.computed_position + data.num_scheduled_tokens) // self.tokens_per_block
            done = min(done, len(state.hashes), len(state.block_ids))
            if done > state.saved_blocks and data.request_id not in meta.failed:
                meta.saves.append(
                    Transfer(
                        data.request_id,
                        state.hashes[state.saved_blocks : done],
                        state.block_ids[state.saved_blocks : done],
                    )
                )
                state.saved_blocks = done
                state.saves_sent = True
        return meta

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True (keep the blocks) while saves handed over for it may still read them;
        the workers' ``get_finished`` releases it once its pages are captured."""
        state = self._requests.pop(request.request_id, None)
        if self._lookup is not None:
            self._lookup.forget(request.request_id)
        return state is not None and state.saves_sent

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
            self._lookup.lookup.close()
            self._lookup = None
