"""A TP group of real processes driving the connector as TensorRT-LLM's executor would.

NOT TensorRT-LLM: this follows the 1.2 connector API's documented call order, with the
stand-in package in ``standin/`` in place of the engine. Rank 0 builds the scheduler
and every rank a worker from ``kv_connector_config`` (module and class names, imported
as the engine does); each step rank 0 asks for matched tokens, allocates blocks, builds
the metadata and broadcasts it (pickled) with the block ids; every rank then loads,
runs a "forward" that writes known bytes into the blocks it computed, and saves.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconn.testing.processes import rank_context
from kvconn.testing.ranks import run_ranks

STANDIN = str(Path(__file__).parent / "standin")
STEP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Scenario:
    """A model shape, a TP width and the prompts to serve one after the other."""

    prompts: tuple[tuple[int, ...], ...]
    #: the LoRA task of each prompt (None: the base model)
    loras: tuple[int | None, ...] = ()
    tp: int = 2
    layers: int = 2
    kv_factor: int = 2  # 1: MLA
    tokens_per_block: int = 4
    heads: int = 2  # per rank
    head_dim: int = 8
    kv_heads: int | None = None  # global; fewer than tp: consecutive ranks hold equal K/V
    blocks: int = 32
    dtype: str = "bfloat16"
    #: (prompt index, block, shard segment): rank 0 deletes that page after the lookup
    evict: tuple[int, int, str] | None = None
    env: dict[str, str] = field(default_factory=dict)

    def shard_of(self, rank: int) -> int:
        if self.kv_factor == 1:
            return 0
        units = self.kv_heads if self.kv_heads is not None else self.heads * self.tp
        return rank // (self.tp // min(self.tp, units))


@dataclass
class _Request:
    """What the connector reads of TensorRT-LLM's LlmRequest."""

    request_id: int
    tokens: list[int]
    lora_task_id: int | None = None

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


def run(scenarios: Sequence[Scenario], timeout_s: float = 300.0) -> list[list[dict[str, Any]]]:
    """Serve each scenario's prompts in turn in one TP group; results[scenario][rank].

    One group serves every scenario (each with its own pool, worker and scheduler),
    because starting the processes costs more than a scenario.
    """
    tp = scenarios[0].tp
    if any(sc.tp != tp for sc in scenarios):
        raise ValueError("every scenario of one run has the same TP width")
    channels = [rank_context().Queue() for _ in range(tp)]
    by_rank = run_ranks(_rank_main, tp, (list(scenarios), channels), timeout_s=timeout_s)
    return [[by_rank[r][i] for r in range(tp)] for i in range(len(scenarios))]


def block_bytes(scenario: Scenario, block_hash: bytes, shard: int, numel: int) -> Any:
    import torch

    seed = int.from_bytes(hashlib.blake2b(block_hash + bytes([shard]), digest_size=8).digest())
    gen = torch.Generator().manual_seed(seed & (2**63 - 1))
    size = numel * torch.empty((), dtype=getattr(torch, scenario.dtype)).element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def _rank_main(rank: int, scenarios: list[Scenario], channels: list[Any], results: Any) -> None:
    os.environ["TRTLLM_STANDIN_RANK"] = str(rank)
    sys.path.insert(0, STANDIN)
    base_env = dict(os.environ)
    out = []
    for scenario in scenarios:
        os.environ.clear()
        os.environ.update(base_env | scenario.env)
        try:
            out.append(_serve(rank, scenario, channels))
        except BaseException:
            out.append({"rank": rank, "error": traceback.format_exc()})
    results.put((rank, out))


def _serve(rank: int, sc: Scenario, channels: list[Any]) -> dict[str, Any]:
    import torch
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import RequestData, SchedulerOutput
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

    from kvconn.hashing import ReuseScope, block_hashes

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
    tpb = sc.tokens_per_block
    width = tpb * sc.heads * sc.head_dim if sc.kv_factor == 2 else tpb * sc.head_dim
    pool = torch.zeros(sc.blocks, sc.layers, sc.kv_factor, width, dtype=getattr(torch, sc.dtype))
    worker.register_kv_caches(pool)
    block_numel = sc.layers * sc.kv_factor * width
    shard = sc.shard_of(rank)
    report: dict[str, Any] = {"rank": rank, "requests": []}
    for i, prompt in enumerate(sc.prompts):
        lora = sc.loras[i] if i < len(sc.loras) else None
        request = _Request(i, list(prompt), lora)
        scope = ReuseScope(lora_id=None if lora is None else str(lora))
        hashes = block_hashes(list(prompt), tpb, scope)
        n_blocks = -(-len(prompt) // tpb)
        if scheduler is not None:
            matched, is_async = scheduler.get_num_new_matched_tokens(request, 0)
            block_ids = list(range(n_blocks))  # a fresh pool each request: the same ids
            scheduler.update_state_after_alloc(request, block_ids)
            meta = scheduler.build_connector_meta(
                SchedulerOutput(
                    new_requests=[
                        RequestData(i, list(prompt), block_ids, matched, len(prompt) - matched)
                    ]
                )
            )
            if sc.evict is not None and sc.evict[0] == i:
                _evict(worker, hashes[sc.evict[1]], sc.evict[2])
            step = (meta, block_ids, matched, is_async)
            for ch in channels[1:]:
                ch.put(step)
        else:
            step = channels[rank].get(timeout=STEP_TIMEOUT_S)
        meta, block_ids, matched, is_async = step
        entry: dict[str, Any] = {"matched_tokens": matched, "is_async": is_async}
        worker.bind_connector_meta(meta)
        try:
            worker.start_load_kv(None)
        except Exception as exc:
            entry["load_error"] = f"{type(exc).__name__}: {exc}"
        hit_blocks = matched // tpb
        entry["loaded_equal"] = [
            bool(
                torch.equal(
                    pool[block_ids[b]].view(-1).view(torch.uint8),
                    block_bytes(sc, hashes[b], shard, block_numel),
                )
            )
            for b in range(hit_blocks)
        ]
        entry["untouched"] = [bool((pool[block_ids[b]] == 0).all()) for b in range(hit_blocks)]
        if "load_error" not in entry:
            for b in range(hit_blocks, n_blocks):  # the forward pass computes the rest
                content = block_bytes(
                    sc, hashes[b] if b < len(hashes) else b"tail", shard, block_numel
                )
                pool[block_ids[b]].view(-1).view(torch.uint8).copy_(content)
            for layer in range(sc.layers):
                worker.wait_for_layer_load(layer, None)
                worker.save_kv_layer(layer, None)
            worker.wait_for_save(None)
        entry["finished"] = worker.get_finished([i], [])
        worker._clear_connector_meta()
        if scheduler is not None:
            scheduler.request_finished(request, block_ids)
        _barrier(rank, channels, i)
        pool.zero_()  # nothing survives in the pool: the next request reads the store
        report["requests"].append(entry)
    report["kvconn"] = worker.connector.stats.snapshot()
    worker.connector.close()
    if scheduler is not None and scheduler._lookup is not None:
        scheduler._lookup.close()
    return report


def _barrier(rank: int, channels: list[Any], step: int) -> None:
    """Every rank has saved before rank 0 looks up the next prompt."""
    if rank == 0:
        for _ in channels[1:]:
            assert channels[0].get(timeout=STEP_TIMEOUT_S) == ("saved", step)
    else:
        channels[0].put(("saved", step))


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
