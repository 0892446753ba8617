"""The KV-cache connector interface of TensorRT-LLM 1.2, and the manager that drives it.

Stand-in, checked against ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` of
NVIDIA/TensorRT-LLM at commit 3277953654b9b2863dae4f1cb81856b172837db4 (the 1.2 line;
docs/engines/tensorrt-llm.md lists what was checked and what changed). Signatures,
abstract methods and defaults are the engine's; the bodies are this project's own.

``KvCacheConnectorManager`` is engine-internal (a connector never sees it) but decides
what a connector is told, so its behaviour is reproduced here:

* the scheduler runs on rank 0 only; what it answers (matched tokens, metadata,
  ``request_finished``) is broadcast to every rank;
* for a request's first report, ``build_scheduler_output`` gives ``computed_position``
  *without* the tokens the connector promised to load synchronously in that step;
  later reports give the position reached so far;
* a request loaded asynchronously is taken out of the step and comes back (as a new
  request) once every rank's ``get_finished`` has reported its load;
* a request whose ``request_finished`` said True keeps its blocks until every rank's
  ``get_finished`` has reported its save.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm._utils import mpi_allgather, mpi_broadcast, mpi_rank
from tensorrt_llm.bindings import LlmRequestState

from .scheduler import ScheduledRequests


@dataclass
class RequestData:
    """One scheduled request, as ``build_connector_meta`` sees it."""

    request_id: int
    #: tokens not reported before (the whole prompt on the first report)
    new_tokens: list[int]
    #: block ids not reported before (all allocated blocks on the first report)
    new_block_ids: list[int]
    #: tokens whose KV is valid before this step (first report: minus connector loads)
    computed_position: int
    #: tokens this step computes (a context chunk, or 1 while generating)
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    #: requests reported for the first time (each appears here exactly once)
    new_requests: list[RequestData] = field(default_factory=list)
    #: requests reported before
    cached_requests: list[RequestData] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> Any:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[..., Any] | None:
        """Asked once, after the worker is built; a callable returned is called with no
        arguments at the end of every forward pass, on the forward's stream (also after
        a CUDA graph replay, where the per-layer hooks do not run). None: nothing."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]: ...


class KvCacheConnectorScheduler(ABC):
    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...


@dataclass
class _Reported:
    """What the manager already told the connector about one request."""

    block_ids: int = 0
    tokens: int = 0


class KvCacheConnectorManager:
    """The engine's side of the connector API (see the module docstring)."""

    def __init__(
        self, worker: KvCacheConnectorWorker, scheduler: KvCacheConnectorScheduler | None
    ) -> None:
        if (scheduler is not None) != (mpi_rank() == 0):
            raise AssertionError("the connector scheduler exists on rank 0 only")
        self.worker = worker
        self.scheduler = scheduler
        self._reported: dict[int, _Reported] = {}
        self._matched_this_step: dict[int, int] = {}
        #: async transfers announced this step, not yet passed to get_finished
        self._new_loads: dict[int, Any] = {}
        self._new_saves: dict[int, Any] = {}
        #: passed to get_finished, not yet reported done by this rank
        self._pending_loads: dict[int, Any] = {}
        self._pending_saves: dict[int, Any] = {}
        #: reported done by this rank, not yet by every rank
        self._done_loads: dict[int, Any] = {}
        self._done_saves: dict[int, Any] = {}
        #: loaded asynchronously: their blocks are allocated already
        self._loaded: set[int] = set()
        self._scheduler_output: SchedulerOutput | None = None
        #: stand-in only: every worker.get_finished call, (arguments, answer)
        self.finished_log: list[tuple[tuple[list[int], list[int]], tuple[Any, Any]]] = []

    def _on_leader(self, ask: Callable[[KvCacheConnectorScheduler], Any]) -> Any:
        return mpi_broadcast(ask(self.scheduler) if self.scheduler is not None else None)

    # called by the KV cache manager while it adds a request's first context chunk
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if request.is_generation_only_request:
            raise RuntimeError("the connector does not serve generation-only requests")
        tokens, load_async = self._on_leader(
            lambda s: s.get_num_new_matched_tokens(request, num_computed_tokens)
        )
        if tokens == 0 and load_async:
            raise RuntimeError("an asynchronous load of 0 tokens")
        if load_async:
            self._new_loads[request.request_id] = request
        self._matched_this_step[request.request_id] = tokens
        return int(tokens)

    def should_add_sequence(self, request: Any) -> bool:
        """False for a request back from an asynchronous load: it has its blocks."""
        return request.request_id not in self._loaded

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, block_ids)

    def build_scheduler_output(self, batch: ScheduledRequests, kv_cache_manager: Any) -> None:
        out = SchedulerOutput()
        for req in batch.context_requests:
            if req.request_id in self._new_loads:
                continue  # loading asynchronously: not part of this step
            data, is_new = self._report(req, kv_cache_manager)
            data.computed_position = req.context_current_position - self._matched_this_step.get(
                req.request_id, 0
            )
            data.num_scheduled_tokens = min(req.context_remaining_length, req.context_chunk_size)
            (out.new_requests if is_new else out.cached_requests).append(data)
        for req in batch.generation_requests:
            data, _ = self._report(req, kv_cache_manager)
            data.computed_position = len(req.get_tokens(0)) - 1
            data.num_scheduled_tokens = 1
            out.cached_requests.append(data)
        self._matched_this_step = {}
        self._scheduler_output = out

    def _report(self, req: Any, kv_cache_manager: Any) -> tuple[RequestData, bool]:
        is_new = req.request_id not in self._reported
        seen = self._reported.setdefault(req.request_id, _Reported())
        blocks = list(kv_cache_manager.get_cache_indices(req))
        tokens = list(req.get_tokens(0))
        data = RequestData(req.request_id, tokens[seen.tokens :], blocks[seen.block_ids :], 0, 0)
        seen.block_ids, seen.tokens = len(blocks), len(tokens)
        return data, is_new

    def take_scheduled_requests_pending_load(self, batch: ScheduledRequests) -> None:
        keep = []
        for req in batch.context_requests:
            if req.request_id in self._new_loads:
                req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
                self._new_loads[req.request_id] = req
            else:
                keep.append(req)
        batch.context_requests = keep

    def handle_metadata(self) -> None:
        output = self._scheduler_output
        self._scheduler_output = None
        self.worker.bind_connector_meta(self._on_leader(lambda s: s.build_connector_meta(output)))

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        self._loaded.discard(request.request_id)
        saving = bool(self._on_leader(lambda s: s.request_finished(request, cache_block_ids)))
        if saving:
            self._new_saves[request.request_id] = request
            request.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return saving

    def get_finished(self) -> list[Any]:
        """Requests whose save every rank reported done; loads done go back to context."""
        saves, loads = list(self._new_saves), list(self._new_loads)
        self._pending_saves.update(self._new_saves)
        self._pending_loads.update(self._new_loads)
        self._new_saves, self._new_loads = {}, {}
        answer = self.worker.get_finished(saves, loads)
        self.finished_log.append(((saves, loads), answer))
        saved, loaded = answer
        for rid in saved:
            self._done_saves[rid] = self._pending_saves.pop(rid)
        for rid in loaded:
            self._done_loads[rid] = self._pending_loads.pop(rid)
        everyone = mpi_allgather((sorted(self._done_saves), sorted(self._done_loads)))
        all_saved = set.intersection(*(set(s) for s, _ in everyone))
        all_loaded = set.intersection(*(set(loads) for _, loads in everyone))
        for rid in all_loaded:
            req = self._done_loads.pop(rid)
            req.state = LlmRequestState.CONTEXT_INIT
            self._loaded.add(rid)
        return [self._done_saves.pop(rid) for rid in sorted(all_saved)]

    def layer_pre_hook(self, layer_idx: int, stream: Any = None) -> None:
        self.worker.wait_for_layer_load(layer_idx, stream)

    def layer_post_hook(self, layer_idx: int, stream: Any = None) -> None:
        self.worker.save_kv_layer(layer_idx, stream)
