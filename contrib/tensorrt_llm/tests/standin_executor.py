"""A TP group of real processes driving the connector as TensorRT-LLM 1.2's executor does.

NOT TensorRT-LLM: this reproduces the order in which 1.2's PyTorch executor calls the
connector (``py_executor.py``, ``resource_manager.py``, ``kvCacheManager.cpp``; see
docs/engines/tensorrt-llm.md), with the stand-in package in ``standin/``:

1. start-up: every rank builds its worker and asks ``register_forward_pass_callable``;
   rank 0 also builds the scheduler; then ``register_kv_caches(primary pool)``;
2. each step, ``prepare_resources``: a request's first context chunk is added to the
   KV cache manager, which asks ``get_num_new_matched_tokens(request, tokens reused on
   device)`` (rank 0 answers, every rank gets the answer), moves the request's context
   position past the matched tokens, and calls ``update_state_after_alloc`` with all
   its block ids; then ``build_scheduler_output``;
3. outside the forward's error handling: pending asynchronous loads leave the batch,
   rank 0's ``build_connector_meta`` is broadcast and bound, ``start_load_kv`` runs.
   An exception here stops this rank's executor (the engine's event loop ends);
4. the forward: per layer ``wait_for_layer_load`` then ``save_kv_layer``, the forward
   pass callable, ``wait_for_save``. An exception here fails the active requests (the
   engine answers them with the error) and the executor goes on;
5. sampling; a finished request gets ``request_finished`` (rank 0 answers, broadcast):
   False frees its blocks now, True keeps them; then ``get_finished`` on every worker,
   and blocks of saves every rank reported done are freed.

Nothing is shared between ranks except through the stand-in's collectives, which carry
pickled objects as MPI does. A "forward" writes known bytes into each block as the step
completes it, so a block saved early, or loaded wrongly, shows in a later request.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconn.testing.processes import rank_context
from kvconn.testing.ranks import run_ranks

STANDIN = str(Path(__file__).parent / "standin")


#: A multimodal item of a prompt: its content hash (8 int32 words, as TensorRT-LLM's
#: ``multimodal_hashes``), its first placeholder token and its number of tokens.
Image = tuple[tuple[int, ...], int, int]


@dataclass(frozen=True)
class Scenario:
    """A model shape, a TP width and the prompts to serve one after the other."""

    prompts: tuple[tuple[int, ...], ...]
    #: the LoRA task of each prompt (None: the base model)
    loras: tuple[int | None, ...] = ()
    #: the cache salt id of each prompt (None: no salt)
    salts: tuple[int | None, ...] = ()
    #: the multimodal items of each prompt: (8-word content hash, position, length)
    images: tuple[tuple[Image, ...], ...] = ()
    #: requests carry multimodal items that TensorRT-LLM could not hash (an embedding
    #: passed without hashes)
    unhashed_images: bool = False
    tp: int = 2
    layers: int = 2
    kv_factor: int = 2  # 1: MLA
    tokens_per_block: int = 4
    heads: int = 2  # per rank
    head_dim: int = 8
    kv_heads: int | None = None  # global; fewer than tp: consecutive ranks hold equal K/V
    blocks: int = 32
    dtype: str = "bfloat16"
    #: tokens each request generates (1: it finishes with its last context step)
    max_tokens: int = 1
    #: context chunk size (chunked prefill); None: a whole prompt in one step
    chunk: int | None = None
    #: (prompt index, block, shard segment): rank 0 deletes that page after the lookup
    evict: tuple[int, int, str] | None = None
    #: seconds every put of the store takes (a slow store; saves are still in flight
    #: when their request finishes)
    slow_put_s: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    def shard_of(self, rank: int) -> int:
        if self.kv_factor == 1:
            return 0
        units = self.kv_heads if self.kv_heads is not None else self.heads * self.tp
        return rank // (self.tp // min(self.tp, units))


class _Request:
    """What the connector and its manager read of TensorRT-LLM's LlmRequest."""

    is_generation_only_request = False

    def __init__(
        self,
        request_id: int,
        prompt: list[int],
        lora: int | None = None,
        salt: int | None = None,
        images: tuple[Image, ...] = (),
    ) -> None:
        from tensorrt_llm.bindings import LlmRequestState

        self.request_id = self.py_request_id = request_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.lora_task_id = lora
        self.cache_salt_id = salt
        # TensorRT-LLM gives None, not empty lists, to a request without such inputs
        self.multimodal_hashes = [list(h) for h, _, _ in images] or None
        self.multimodal_positions = [p for _, p, _ in images] or None
        self.multimodal_lengths = [n for _, _, n in images] or None
        self.multimodal_embedding = None
        self.prompt_embedding_table = None
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.context_chunk_size = 0
        self.added = False

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)

    def set_prepopulated(self, tokens: int, tokens_per_block: int) -> None:
        """As the C++ request does: start past ``tokens``; a chunk that does not reach the
        prompt's end is cut back to end on a block boundary."""
        assert tokens < self.prompt_len, "the engine computes at least one prompt token"
        if tokens > 0:
            end = tokens + self.context_chunk_size
            if end < self.prompt_len:
                self.context_chunk_size = end // tokens_per_block * tokens_per_block - tokens
            else:
                self.context_chunk_size = self.prompt_len - tokens
            self.context_current_position = tokens


class _Blocks:
    """The KV cache manager's block table: ids from a free list, per request."""

    def __init__(self, count: int, tokens_per_block: int) -> None:
        self.free = list(range(count))
        self.tpb = tokens_per_block
        self.table: dict[int, list[int]] = {}

    def get_cache_indices(self, request: _Request) -> list[int]:
        return list(self.table[request.request_id])

    def reserve(self, request: _Request, tokens: int) -> None:
        ids = self.table.setdefault(request.request_id, [])
        while len(ids) * self.tpb < tokens:
            ids.append(self.free.pop(0))

    def release(self, request: _Request) -> None:
        self.free.extend(self.table.pop(request.request_id))


def run(scenarios: Sequence[Scenario], timeout_s: float = 300.0) -> list[list[dict[str, Any]]]:
    """Serve each scenario's prompts in turn in one TP group; results[scenario][rank].

    One group serves every scenario (each with its own pool, worker and scheduler),
    because starting the processes costs more than a scenario.
    """
    tp = scenarios[0].tp
    if any(sc.tp != tp for sc in scenarios):
        raise ValueError("every scenario of one run has the same TP width")
    inboxes = [rank_context().Queue() for _ in range(tp)]
    by_rank = run_ranks(_rank_main, tp, (list(scenarios), inboxes), timeout_s=timeout_s)
    return [[by_rank[r][i] for r in range(tp)] for i in range(len(scenarios))]


def block_identity(prompt: Sequence[int], lora: int | None, images: tuple[Image, ...], tpb: int):
    """What each full block's KV bytes are a function of: the LoRA task, every token up to
    the block's end and every multimodal item that starts before it (not the cache salt,
    which only says who may share them). Independent of kvconn's hashes, so a block
    loaded from the wrong request shows as wrong bytes."""
    out = []
    for b in range(len(prompt) // tpb):
        end = (b + 1) * tpb
        seen = [(h, p, n) for h, p, n in images if p < end]
        out.append(repr((lora, list(prompt[:end]), seen)).encode())
    return out


def block_bytes(scenario: Scenario, block_hash: bytes, shard: int, numel: int) -> Any:
    import torch

    seed = int.from_bytes(hashlib.blake2b(block_hash + bytes([shard]), digest_size=8).digest())
    gen = torch.Generator().manual_seed(seed & (2**63 - 1))
    size = numel * torch.empty((), dtype=getattr(torch, scenario.dtype)).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def _rank_main(rank: int, scenarios: list[Scenario], inboxes: list[Any], results: Any) -> None:
    os.environ["TRTLLM_STANDIN_RANK"] = str(rank)
    sys.path.insert(0, STANDIN)
    from tensorrt_llm import _utils

    _utils.install_group(rank, inboxes)
    base_env = dict(os.environ)
    out = []
    for scenario in scenarios:
        os.environ.clear()
        os.environ.update(base_env | scenario.env)
        try:
            out.append(_serve(rank, scenario))
        except BaseException:
            out.append({"rank": rank, "error": traceback.format_exc()})
    results.put((rank, out))


def _serve(rank: int, sc: Scenario) -> dict[str, Any]:
    import torch
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import KvCacheConnectorManager
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm._utils import abandon_group, mpi_allgather
    from tensorrt_llm.bindings import LlmRequestState as State
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

    from kvconn_trtllm.hashes import request_hashes

    args = TorchLlmArgs(
        model="org/stand-in-model",
        tensor_parallel_size=sc.tp,
        kv_cache_config=KvCacheConfig(tokens_per_block=sc.tokens_per_block),
        kv_connector_config=KvCacheConnectorConfig(
            connector_module="kvconn_trtllm",
            connector_scheduler_class="KvconnScheduler",
            connector_worker_class="KvconnWorker",
        ),
    )
    cfg = args.kv_connector_config
    module = importlib.import_module(cfg.connector_module)
    worker = getattr(module, cfg.connector_worker_class)(args)
    scheduler = getattr(module, cfg.connector_scheduler_class)(args) if rank == 0 else None
    forward_pass_callable = worker.register_forward_pass_callable()
    manager = KvCacheConnectorManager(worker, scheduler)
    tpb = sc.tokens_per_block
    width = tpb * sc.heads * sc.head_dim if sc.kv_factor == 2 else tpb * sc.head_dim
    pool = torch.zeros(sc.blocks, sc.layers, sc.kv_factor, width, dtype=getattr(torch, sc.dtype))
    worker.register_kv_caches(pool)
    if sc.slow_put_s:
        _slow_puts(worker.connector.backend, sc.slow_put_s)
    blocks = _Blocks(sc.blocks, tpb)
    block_numel = sc.layers * sc.kv_factor * width
    shard = sc.shard_of(rank)
    report: dict[str, Any] = {
        "rank": rank,
        "requests": [],
        "forward_pass_callable": forward_pass_callable is not None,
    }

    def content(identity: list[bytes], b: int) -> Any:
        return block_bytes(
            sc, identity[b] if b < len(identity) else b"generated", shard, block_numel
        )

    for i, prompt in enumerate(sc.prompts):
        lora = sc.loras[i] if i < len(sc.loras) else None
        salt = sc.salts[i] if i < len(sc.salts) else None
        images = sc.images[i] if i < len(sc.images) else ()
        req = _Request(i, list(prompt), lora, salt, images)
        if sc.unhashed_images:
            req.multimodal_hashes = None
            req.multimodal_embedding = "an image's embedding"
        identity = block_identity(prompt, lora, images, tpb)
        hashes = request_hashes(req, list(prompt), tpb) or []  # the keys, for evictions
        entry: dict[str, Any] = {"steps": 0, "saving_async": [], "handed_over_by_step": []}
        report["requests"].append(entry)
        finished = False
        while not finished:
            entry["steps"] += 1
            batch = ScheduledRequests()
            if req.state == State.CONTEXT_INIT:
                req.context_chunk_size = min(
                    sc.chunk or req.prompt_len, req.context_remaining_length
                )
                batch.context_requests.append(req)
            elif req.state == State.GENERATION_IN_PROGRESS:
                batch.generation_requests.append(req)
            # else: loading asynchronously, out of the batch until get_finished says so
            # prepare_resources
            for r in batch.context_requests:
                if not r.added and manager.should_add_sequence(r):
                    r.added = True
                    blocks.reserve(r, r.prompt_len)
                    matched = manager.get_num_new_matched_tokens(r, 0)
                    r.set_prepopulated(matched, tpb)
                    manager.update_state_after_alloc(r, blocks.get_cache_indices(r))
                    entry["matched_tokens"] = matched
                    if sc.evict is not None and sc.evict[0] == i:
                        if rank == 0:
                            _evict(worker, hashes[sc.evict[1]], sc.evict[2])
                        mpi_allgather("evicted")  # before any rank loads
            for r in batch.generation_requests:
                blocks.reserve(r, len(r.tokens))
            manager.build_scheduler_output(batch, blocks)
            start = req.context_current_position if batch.context_requests else len(req.tokens) - 1
            try:  # _kv_connector_start_batch: no error handling around it in the engine
                manager.take_scheduled_requests_pending_load(batch)
                manager.handle_metadata()
                worker.start_load_kv(None)
            except Exception as exc:
                entry["fatal"] = f"{type(exc).__name__}: {exc}"
                abandon_group(entry["fatal"])
                report["stopped"] = True
                return _close(report, worker, scheduler)
            if batch.batch_size == 0:  # waiting for an asynchronous load
                for done in manager.get_finished():
                    blocks.release(done)
                continue
            if "loaded_equal" not in entry:  # the request's first step in a forward
                ids = blocks.get_cache_indices(req)
                hit = entry.get("matched_tokens", 0) // tpb
                entry["loaded_equal"] = [
                    bool(torch.equal(pool[ids[b]].view(-1).view(torch.uint8), content(identity, b)))
                    for b in range(hit)
                ]
                entry["untouched"] = [bool((pool[ids[b]] == 0).all()) for b in range(hit)]
            meta = worker.get_connector_meta()
            handing_over = sum(len(t.hashes) for t in meta.saves if t.request_id == i)
            try:  # _forward_step: an error fails the requests, the executor goes on
                end = start + (req.context_chunk_size if batch.context_requests else 1)
                ids = blocks.get_cache_indices(req)
                for layer in range(sc.layers):
                    manager.layer_pre_hook(layer)
                    manager.layer_post_hook(layer)
                for b in range(start // tpb, end // tpb):  # blocks this step completes
                    pool[ids[b]].view(-1).view(torch.uint8).copy_(content(identity, b))
                if forward_pass_callable is not None:
                    forward_pass_callable()
                worker.wait_for_save(None)
                entry["handed_over_by_step"].append(handing_over)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
                req.state = State.GENERATION_COMPLETE
                finished = True
            else:
                if batch.context_requests:
                    req.context_current_position = end
                if req.context_remaining_length == 0:
                    req.tokens.append(9_000_000 + len(req.tokens))  # the sampled token
                    req.state = State.GENERATION_IN_PROGRESS
                    finished = len(req.tokens) - req.prompt_len >= sc.max_tokens
            if finished:  # _terminate_request
                saving = manager.request_finished(req, blocks.get_cache_indices(req))
                entry["saving_async"].append(saving)
                if not saving:
                    blocks.release(req)
                    pool.view(torch.uint8).fill_(0xEE)  # reused at once by another request
            for done in manager.get_finished():  # _kv_connector_terminate_requests
                blocks.release(done)
                pool.view(torch.uint8).fill_(0xEE)  # reused at once by another request
        # idle steps until this rank's saves are stored and its held blocks released, so
        # the next prompt's lookup sees them (an engine just serves a miss meanwhile)
        while True:  # get_finished is collective: every rank steps until all are idle
            for done in manager.get_finished():
                blocks.release(done)
                pool.view(torch.uint8).fill_(0xEE)  # reused at once by another request
            idle = not worker.transfers.in_flight and req.request_id not in blocks.table
            if all(mpi_allgather(idle)):
                break
            time.sleep(0.001)
        mpi_allgather(("served", i))  # every rank saved before rank 0 looks up the next
        pool.zero_()  # nothing survives in the pool: the next request reads the store
        entry["finished_log"] = list(manager.finished_log)
        manager.finished_log.clear()
    return _close(report, worker, scheduler)


def _slow_puts(backend: Any, seconds: float) -> None:
    """Make every put of ``backend`` take ``seconds`` longer (this process only)."""
    put = backend._put

    def slow(keys: Any, values: Any) -> Any:
        time.sleep(seconds)
        return put(keys, values)

    backend._put = slow


def _written(worker: Any) -> int:
    """Pages this rank's connector has written so far."""
    total = worker.connector.stats.snapshot()["total"]
    return int(total.get("written", {}).get("pages", 0))


def _close(report: dict[str, Any], worker: Any, scheduler: Any) -> dict[str, Any]:
    report["kvconn"] = worker.connector.stats.snapshot()
    worker.close()
    if scheduler is not None:
        scheduler.close()
    return report


def _evict(worker: Any, block_hash: bytes, component: str) -> None:
    from kvconn.plan import lookup_keys

    conn = worker.connector
    keys = [
        k for k in lookup_keys(conn.prefix, conn.plans, [block_hash])[0] if f"/{component}/" in k
    ]
    assert len(keys) == 1, keys
    assert conn.backend.delete(keys) == [True]


def stored_components(store: str) -> dict[str, int]:
    """Pages in an LMDB store by shard segment (layout manifests left out)."""
    from collections import Counter

    from kvconn.registry import load_backend

    backend = load_backend("lmdb", {"path": store})
    try:
        parts = [key.split("/")[2] for key, _ in backend.list_keys("")]
    finally:
        backend.close()
    return dict(Counter(p for p in parts if p != "_layout"))


__all__: Sequence[str] = ["Scenario", "run", "stored_components"]
