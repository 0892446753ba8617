"""kvconn as a TensorRT-LLM 1.2 KV-cache connector (``kv_connector_config``).

Written from the connector API's documented signatures and tested only against a
stand-in of that interface (contrib/tensorrt_llm/tests/standin): see
docs/engines/tensorrt-llm.md before relying on it.

Scheduler (rank 0, no KV tensors): ``get_num_new_matched_tokens`` hashes the request's
full blocks with kvconn's own chain (scoped by its LoRA task; requests with multimodal
inputs are left alone) and answers from one ``lookup``; the hit becomes a
load in the next step's metadata, which TensorRT-LLM broadcasts to every rank. Blocks
that a step completes become saves. Loads and saves are synchronous: loads happen in
``start_load_kv`` before the forward pass, saves in ``wait_for_save`` after it.

Worker (every rank): ``register_kv_caches`` describes the rank's primary pool as a
kvconn layout; the rank-0 worker also hands that layout (as a dict) to the scheduler
next to it, which is how the scheduler learns the keys without holding a tensor.

The 1.2 interface has no way to tell the engine that a promised block did not arrive
(a page evicted between lookup and load). Rather than let the forward pass read stale
KV, ``start_load_kv`` then raises :class:`KvconnLoadError` after loading what it could,
so the engine fails those requests; the failed blocks' slots are left untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)

from kvconn.connector import Connector
from kvconn.errors import ConfigError, KvconnError
from kvconn.hashing import ReuseScope, block_hashes
from kvconn.layout import KvLayout
from kvconn_trtllm.layout import describe_pool
from kvconn_trtllm.settings import TrtllmSettings

log = logging.getLogger("kvconn.trtllm")

__all__ = ["KvconnLoadError", "KvconnMetadata", "KvconnScheduler", "KvconnWorker", "Transfer"]

#: The rank-0 worker's layout (``KvLayout.to_dict()``), for the scheduler in its process.
_published_layout: dict[str, Any] | None = None


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


# ------------------------------------------------------------------------ worker
class KvconnWorker(KvCacheConnectorWorker):
    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.rank, self.tp_size = _tp(llm_args)
        self.settings = TrtllmSettings.load(llm_args)
        self.connector: Connector | None = None

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        global _published_layout
        layout = describe_pool(
            kv_cache_tensor,
            tp_size=self.tp_size,
            tokens_per_block=_tokens_per_block(self._llm_args),
            kv_heads=self.settings.kv_heads,
        )
        self.connector = Connector(
            self.settings.connector, layout, rank=self.rank, pools=[kv_cache_tensor]
        )
        if self.rank == 0:
            _published_layout = layout.to_dict()

    def _require(self) -> Connector:
        if self.connector is None:
            raise ConfigError("register_kv_caches has not been called on this worker")
        return self.connector

    def start_load_kv(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if meta is None or not meta.loads:
            return
        conn = self._require()
        failed = []
        for t in meta.loads:
            result = conn.load(t.hashes, t.block_ids)
            if not result.ok:
                failed.append(f"request {t.request_id}: blocks {result.loaded}..")
        if failed:
            raise KvconnLoadError(
                "kvconn: KV blocks the scheduler found did not load (evicted or unreadable): "
                + "; ".join(failed)
            )

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Nothing to wait for: start_load_kv loaded every layer before the forward."""

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: wait_for_save stores whole blocks after the forward."""

    def wait_for_save(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if meta is None or not meta.saves:
            return
        if stream is not None and torch.cuda.is_available():
            stream.synchronize()  # the forward's KV writes must be in the pool
        conn = self._require()
        for t in meta.saves:
            conn.save(t.hashes, t.block_ids)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        return [], []  # loads and saves complete within the step


# ------------------------------------------------------------------------ scheduler
@dataclass
class _Request:
    hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # full blocks already sent for saving (or loaded)
    pending_load: Transfer | None = None


class KvconnScheduler(KvCacheConnectorScheduler):
    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        _, self.tp_size = _tp(llm_args)
        self.tokens_per_block = _tokens_per_block(llm_args)
        self.settings = TrtllmSettings.load(llm_args)
        self._lookup: Connector | None = None
        self._requests: dict[int, _Request] = {}

    def _connector(self) -> Connector:
        """A lookup-only connector over the layout the rank-0 worker registered."""
        if self._lookup is None:
            if _published_layout is None:
                raise ConfigError(
                    "no kvconn worker registered KV caches in this process: the scheduler "
                    "must run on rank 0, next to rank 0's worker"
                )
            layout = KvLayout.from_dict(_published_layout)
            self._lookup = Connector(self.settings.connector, layout, rank=0)
        return self._lookup

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if getattr(request, "multimodal_hashes", None):
            # placeholder tokens look alike across images: never look up nor save these
            return 0, False
        tokens = list(request.get_tokens(0))
        lora = getattr(request, "lora_task_id", None)
        scope = ReuseScope(lora_id=None if lora is None else str(lora))
        hashes = block_hashes(tokens, self.tokens_per_block, scope)
        state = _Request(hashes)
        self._requests[request.request_id] = state
        # at least one prompt token must be computed for the request to produce logits
        usable = min(len(hashes), (len(tokens) - 1) // self.tokens_per_block)
        hit = self._connector().lookup(hashes[:usable]).blocks if usable else 0
        first = num_computed_tokens // self.tokens_per_block
        if hit <= first:
            return 0, False
        state.pending_load = Transfer(request.request_id, hashes[first:hit], [])
        state.saved_blocks = hit  # loaded blocks are already in the store
        return hit * self.tokens_per_block - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """``block_ids``: all of the request's blocks, in token order."""
        state = self._requests.get(request.request_id)
        if state is not None:
            state.block_ids = list(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvconnMetadata:
        meta = KvconnMetadata()
        for data in [*scheduler_output.new_requests, *scheduler_output.cached_requests]:
            state = self._requests.get(data.request_id)
            if state is None:
                continue
            known = set(state.block_ids)
            state.block_ids.extend(b for b in data.new_block_ids if b not in known)
            load, state.pending_load = state.pending_load, None
            if load is not None:
                first = state.saved_blocks - len(load.hashes)
                load.block_ids = state.block_ids[first : state.saved_blocks]
                if len(load.block_ids) == len(load.hashes):
                    meta.loads.append(load)
                else:  # the engine allocated fewer blocks than the hit: recompute them
                    state.saved_blocks = first
            done = (data.computed_position + data.num_scheduled_tokens) // self.tokens_per_block
            done = min(done, len(state.hashes), len(state.block_ids))
            if done > state.saved_blocks:
                meta.saves.append(
                    Transfer(
                        data.request_id,
                        state.hashes[state.saved_blocks : done],
                        state.block_ids[state.saved_blocks : done],
                    )
                )
                state.saved_blocks = done
        return meta

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        self._requests.pop(request.request_id, None)
        return False  # nothing in flight: the engine may free the blocks now
