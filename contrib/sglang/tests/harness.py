"""SGLang's real HiCache L3 path, on CPU, with a TP group of real processes.

Each rank is an OS process that publishes real ``ServerArgs``, joins a gloo group, builds
SGLang's CPU device pool, its host pool (the layout under test) and a real
``HiCacheController`` with the storage backend under test. The controller runs its own
background threads (prefetch, prefetch I/O, prefetch sync, backup), hashes pages with
SGLang's C++ hash extension and all-reduces hits and load completions with MIN over gloo,
as in a server.

What a server's scheduler would do around it, the harness does by hand: there is no GPU,
so instead of a device-to-host copy it writes known bytes into the host pool; then it
calls ``write_storage`` and ``prefetch`` and moves operations between the controller's
queues as the radix cache does (hit query → host allocation → ``prefetch_buffer`` →
acks). Only the GPU↔host copies are absent.

A ``dsa`` case is DeepSeek-V3.2's cache: SGLang's ``DSATokenToKVPool`` on the device, an
MLA host pool and the DSA indexer host pool (``DSAIndexerPoolHost``) in a
``HostPoolGroup``, under SGLang's ``HybridCacheController``, which moves the indexer
through the v2 calls with the ``PoolTransfer`` the radix cache builds for it. SGLang's
own builder for that group (``build_host_pool_group``) cannot run on this CPU machine: it
pins the host buffers with ``cudaHostRegister`` ("AssertionError: Torch not compiled
with CUDA enabled"), so the harness builds the same two host pool classes itself, with
``pin_memory=False``, from the device pool's own declaration of the indexer pool.

An ``swa`` case is a hybrid sliding-window model's cache (gpt-oss, Gemma): SGLang's
``SWAKVPool`` on the device (full-attention layers and sliding-window layers in pools of
their own), an MHA host pool for each in a ``HostPoolGroup`` (the SWA one smaller, with
host slots of its own), under the ``HybridCacheController``. The harness hands it the
transfers SGLang's SWA component builds (``SWAComponent.build_hicache_transfers``): on
backup the SWA pages at the end of each node, with their page keys; on prefetch a
window of placeholder keys, which the controller replaces by the hit's last pages.

A ``mamba`` case is a hybrid linear-attention model's cache (Qwen3-Next, Nemotron-H):
an MHA pool of the full-attention layers and SGLang's ``MambaPoolHost`` of the recurrent
state (one slot per checkpoint; the temporal state and two conv states of the Mamba
layers, in buffers of their own), moved as the SWA pool is, with a window of one page
(``MambaComponent``: the state at the end of the hit).

A ``minimax`` case is MiniMax-M3's sparse attention cache: SGLang's
``MiniMaxSparseKVPool`` on the device (GQA K/V of every layer; the sparse layers' index
keys, one head, in a K-only pool), an MHA host pool and the index keys' host pool
(``MHATokenToKOnlyPoolHost``) in a ``HostPoolGroup``, as SGLang's MiniMax stack builds
them (``build_minimax_sparse_hicache_stack``), under the ``HybridCacheController``,
which moves the index keys with the KV pool's host indices (a sidecar ``indexer``
transfer). Layer 0 is dense, the others sparse; the index keys are the same bytes on
every rank. A ``minimax-nvfp4`` case is MiniMax-M3.1's NVFP4 cache
(``MiniMaxM3Nvfp4KVPool``: every layer sparse, 128-token pages, head_dim 128), whose
host pools pack each page and layer into one row: ``MiniMaxM3Nvfp4MainKVPoolHost`` (the
rank's K, K scales, V, V scales) and ``MiniMaxM3Nvfp4IndexKPoolHost``.

A ``draft`` case adds a speculative draft model's KV pool (EAGLE's MHA, DeepSeek MTP's
MLA: one layer, the target's layout) as SGLang's ``maybe_register_hicache_draft`` does:
registered with the controller after the storage has started
(``register_host_pool_entry``), moved with the KV pool's host indices and keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvconn.testing.ranks import run_ranks

WORLD = 2
#: Seconds any single wait on a controller queue may take before the case fails.
STEP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    """One deployment shape to run through SGLang's store path.

    ``kv_heads`` is the model's global KV head count (MHA); with fewer heads than ranks,
    consecutive ranks hold identical K/V, as SGLang's GQA head duplication does, and the
    harness writes identical bytes on them.
    """

    name: str
    #: "mha", "mla", "dsa" (MLA + DeepSeek-V3.2's indexer pool), "minimax" (MHA of
    #: ``layers`` layers + MiniMax-M3's index keys of all but the first),
    #: "minimax-nvfp4" (MiniMax-M3.1's NVFP4 rows of K/V and index keys), "swa" (MHA
    #: full layers + MHA sliding-window layers, ``layers`` of each) or "mamba" (MHA full
    #: layers + Mamba layers' recurrent state, ``layers`` of each)
    model: str = "mha"
    layout: str = "layer_first"
    page_size: int = 4
    layers: int = 2
    heads: int = 2  # KV heads on each rank (MHA)
    head_dim: int = 8
    kv_heads: int | None = None  # global KV heads; default heads * WORLD
    kv_lora_rank: int = 16  # MLA
    rope_dim: int = 8  # MLA
    dtype: str = "bfloat16"
    pages: int = 6
    backend: str = "dynamic"
    extra_config: dict[str, Any] = field(default_factory=dict)
    #: Called on every rank after the hit query and before the pages are read, with
    #: (rank, storage backend, page hashes); the ranks meet at a barrier after it.
    between_hit_and_get: Callable[[int, Any, list[str]], None] | None = None
    #: A rank whose scheduler terminates the prefetch before its I/O thread reads a page:
    #: that rank's I/O thread skips every batch, the other's reads them.
    terminated_on: int | None = None
    #: The ``WORLD`` processes are pipeline stages at TP=1, not TP ranks: stage ``r``
    #: holds the model's layers ``r * layers`` to ``(r + 1) * layers - 1``.
    pipeline: bool = False
    #: A speculative draft model's KV pool, registered after the storage started.
    draft: bool = False
    #: The draft model's global KV heads (MHA), published as its config
    #: (``speculative_draft_model_path``); None: no draft config is published.
    draft_kv_heads: int | None = None
    #: ``swa``: SGLang's window in pages (``SWAComponent.full_window_pages``; a Mamba
    #: pool's is 1), and the pages whose SWA K/V or Mamba state the backups store
    #: (default: the last window), as the backups of several radix nodes would, each
    #: storing its own last pages.
    swa_window: int = 2
    window_stored: tuple[int, ...] | None = None

    @property
    def trailing_pool(self) -> str | None:
        """The side pool SGLang loads only at the end of a hit, on slots of its own."""
        return self.model if self.model in ("swa", "mamba") else None

    @property
    def indexer(self) -> bool:
        """An ``indexer`` side pool moved with the KV pool's host indices."""
        return self.model in ("dsa", "minimax", "minimax-nvfp4")

    @property
    def hybrid(self) -> bool:
        """Whether SGLang runs the case under its ``HybridCacheController``."""
        return self.indexer or self.trailing_pool is not None or self.draft

    @property
    def window(self) -> int:
        return 1 if self.model == "mamba" else self.swa_window

    @property
    def stored_window(self) -> tuple[int, ...]:
        if self.window_stored is not None:
            return self.window_stored
        return tuple(range(self.pages - self.window, self.pages))

    @property
    def tp_size(self) -> int:
        return 1 if self.pipeline else WORLD

    @property
    def pp_size(self) -> int:
        return WORLD // self.tp_size

    @property
    def global_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads * self.tp_size

    def start_layer(self, rank: int) -> int:
        """The model's index of ``rank``'s first layer (0 but for a pipeline stage)."""
        return rank * self.layers if self.pipeline else 0

    def shard_of(self, rank: int, pool: str = "kv") -> int:
        """Which distinct copy of ``pool``'s bytes ``rank`` holds (equal → identical
        bytes): an indexer's keys are whole on every rank."""
        if self.pipeline:  # each stage its own layers
            return rank
        if self.model in ("mla", "dsa") or pool == "indexer":
            return 0
        heads = self.global_kv_heads
        if pool == "draft" and self.draft_kv_heads is not None:
            heads = self.draft_kv_heads
        num_shards = min(WORLD, heads)
        return rank // (WORLD // num_shards)


@dataclass(frozen=True)
class EvictPage:
    """A ``between_hit_and_get`` hook: ``rank`` deletes one page of one block from the store.

    ``component`` is the page's shard segment (``w2r1``, ``replicated``), so a test can
    take away a page that only one rank loads; ``group`` its layer group (``1``: the
    indexer pool of a ``dsa`` case, the SWA or Mamba pool); ``rank`` the rank
    whose pages it names (a pipeline stage names its own layers' pages only).
    """

    block: int
    component: str
    group: int = 0
    rank: int = 0

    def __call__(self, rank: int, storage: Any, page_hashes: list[str]) -> None:
        if rank != self.rank:
            return
        from kvconn.hashing import adopt_hashes
        from kvconn.plan import lookup_keys
        from kvconn_sglang.storage import HASH_SCHEME

        conn = storage.connector
        digest = adopt_hashes(HASH_SCHEME, [page_hashes[self.block]])
        where = f"/{self.component}/lg{self.group}/"
        keys = [k for k in lookup_keys(conn.prefix, conn.plans, digest)[0] if where in k]
        assert len(keys) == 1, keys
        assert conn.backend.delete(keys) == [True], f"could not delete {keys[0]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cases(cases: Sequence[Case], timeout_s: float = 600.0) -> list[list[dict[str, Any]]]:
    """Run ``cases`` in one TP group of ``WORLD`` processes; results[case][rank].

    One group runs every case in turn (each with its own pools and controller), because
    starting SGLang costs far more than a case. A case that raises on a rank is reported
    in that rank's result under ``error``; the harness stops by itself after
    ``timeout_s`` and kills its processes.
    """
    model_root = tempfile.mkdtemp(prefix="kvconn-sglang-models-")
    try:
        model_dirs = []
        for i, case in enumerate(cases):
            model_dirs.append(os.path.join(model_root, str(i)))
            _write_model_config(model_dirs[-1], case)
            if case.draft_kv_heads is not None:
                _write_model_config(f"{model_dirs[-1]}-draft", case, case.draft_kv_heads)
        args = (free_port(), model_dirs, list(cases))
        out = run_ranks(_rank_main, WORLD, args, timeout_s=timeout_s)
    finally:
        shutil.rmtree(model_root, ignore_errors=True)
    for rank, payload in enumerate(out):
        if isinstance(payload, str):
            raise RuntimeError(f"rank {rank} failed to start:\n{payload}")
    return [[out[r][i] for r in range(WORLD)] for i in range(len(cases))]


def _write_model_config(path: str, case: Case, kv_heads: int | None = None) -> None:
    """A tiny Llama's config.json with the case's global KV heads (or ``kv_heads``: a
    draft model's).

    ServerArgs resolves the served model's config at publish, and the adapter reads the
    model's KV head count from it. No weights: HiCache never runs the model.
    """
    heads = case.global_kv_heads if kv_heads is None else kv_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": case.layers * case.pp_size * (2 if case.trailing_pool else 1),
        "num_attention_heads": 4 * heads,
        "num_key_value_heads": heads,
        "head_dim": case.head_dim,
        "max_position_embeddings": 4096,
        "torch_dtype": case.dtype,
    }
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)


# --------------------------------------------------------------------- in each rank
def _rank_main(
    rank: int, port: int, model_dirs: list[str], cases: list[Case], results: Any
) -> None:
    try:
        os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is fetched: the model dir is local
        from kvconn.testing.torchvision_stub import install_torchvision_stub

        install_torchvision_stub()
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    except BaseException:
        results.put((rank, traceback.format_exc()))
        return
    out = []
    for case, model_dir in zip(cases, model_dirs):
        try:
            out.append(_run_case(rank, model_dir, case))
        except BaseException:
            out.append({"rank": rank, "error": traceback.format_exc()})
    results.put((rank, out))
    dist.destroy_process_group()


def _publish(case: Case, rank: int, model_dir: str) -> None:
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # each case is a new engine: the last case's ranks (TP or PP) must not carry over
    reset_context()

    args = ServerArgs(
        model_path=model_dir,
        skip_tokenizer_init=True,
        device="cpu",
        tp_size=case.tp_size,
        pp_size=case.pp_size,
        page_size=case.page_size,
        enable_hierarchical_cache=True,
        hicache_io_backend="direct",
        # The host pool is built by hand in the case's layout (_pools); this only has to
        # be one that direct I/O accepts when the arguments are resolved.
        hicache_mem_layout="layer_first",
        **(
            {
                "speculative_algorithm": "EAGLE",
                "speculative_draft_model_path": f"{model_dir}-draft",
                "speculative_num_steps": 1,
                "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": 2,
            }
            if case.draft_kv_heads is not None
            else {}
        ),
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))


@dataclass
class Pools:
    """What a case's controller runs over: SGLang's allocator, the KV host pool, the DSA
    indexer host pool (``dsa``) or the SWA or Mamba host pool (``trailing``), and the
    host pool object the controller gets (the ``HostPoolGroup`` of both but for MHA and
    MLA)."""

    allocator: Any
    host: Any
    indexer: Any = None
    controller_pool: Any = None
    trailing: Any = None  # the SWA or Mamba host pool, on slots of its own
    draft: Any = None  # a draft model's host pool
    draft_entry: Any = None  # its HostPoolGroup entry, registered after start-up


def _pools(case: Case, rank: int) -> Pools:
    """SGLang's CPU device pool, its allocator and host pools in ``case.layout``, over
    ``rank``'s layers."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (
        DSATokenToKVPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
    )
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = getattr(torch, case.dtype)
    tokens = 64 * case.page_size
    first = case.start_layer(rank)
    layers = {"start_layer": first, "end_layer": first + case.layers}
    common = {"host_to_device_ratio": 2.0, "host_size": 0, "page_size": case.page_size}
    if case.model == "swa":
        return _swa_pools(case, tokens, dtype, common)
    if case.model == "mamba":
        return _mamba_pools(case, tokens, dtype, common)
    if case.model in ("minimax", "minimax-nvfp4"):
        return _minimax_pools(case, tokens, dtype)
    if case.model == "mha":
        device = MHATokenToKVPool(
            tokens,
            case.page_size,
            dtype,
            case.heads,
            case.head_dim,
            case.layers,
            "cpu",
            False,
            **layers,
        )
        host = _mha_host(case, device, common)
    else:
        if case.model == "dsa":
            # DeepSeek-V3.2: the MLA latent plus the indexer's fp8 keys and scales (head
            # dim 128, SGLang's only one), on SGLang's 64-token DSA pages
            device = DSATokenToKVPool(
                tokens,
                case.page_size,
                case.kv_lora_rank,
                dtype,
                case.rope_dim,
                case.layers,
                "cpu",
                128,
                False,
                case.kv_lora_rank + case.rope_dim,
                **layers,
            )
        else:
            device = MLATokenToKVPool(
                tokens,
                case.page_size,
                dtype,
                case.kv_lora_rank,
                case.rope_dim,
                case.layers,
                "cpu",
                False,
                **layers,
            )
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            layout=case.layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            **layers,
            target_layer_num=case.layers,
            override_kv_cache_dim=device.kv_cache_dim,
            **common,
        )
    allocator = PagedTokenToKVPoolAllocator(tokens, case.page_size, dtype, "cpu", device, False)
    if case.draft:
        return _draft_pools(case, allocator, device, host, tokens, dtype, common)
    if case.model != "dsa":
        return Pools(allocator, host, controller_pool=host)
    return _dsa_pools(case, allocator, device, host)


def _swa_pools(case: Case, tokens: int, dtype: Any, common: dict[str, Any]) -> Pools:
    """SGLang's ``SWAKVPool`` (sliding-window layers at even model indices, full ones at
    odd) and an MHA host pool for each in a ``HostPoolGroup``, as SGLang's SWA stack
    (``_SwaStrategy``: ``build_hybrid_swa_group`` with separate host pools) makes them;
    only pinning is left out. The SWA pools hold half the KV pool's tokens."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _swa_layer_mappings,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    device = SWAKVPool(
        size=tokens,
        size_swa=tokens // 2,
        page_size=case.page_size,
        dtype=dtype,
        head_num=case.heads,
        head_dim=case.head_dim,
        swa_attention_layer_ids=list(range(0, 2 * case.layers, 2)),
        full_attention_layer_ids=list(range(1, 2 * case.layers, 2)),
        device="cpu",
    )
    hosts = [_mha_host(case, pool, common) for pool in (device.full_kv_pool, device.swa_kv_pool)]
    full_layers, swa_layers = _swa_layer_mappings(device)
    group = _host_group(
        2 * case.layers,
        (PoolName.KV, hosts[0], device.full_kv_pool, full_layers),
        (PoolName.SWA, hosts[1], device.swa_kv_pool, swa_layers),
    )
    allocator = PagedTokenToKVPoolAllocator(
        tokens, case.page_size, dtype, "cpu", device.full_kv_pool, False
    )
    return Pools(allocator, hosts[0], controller_pool=group, trailing=hosts[1])


def _mamba_pools(case: Case, tokens: int, dtype: Any, common: dict[str, Any]) -> Pools:
    """An MHA pool of the full-attention layers and SGLang's ``MambaPoolHost`` in a
    ``HostPoolGroup``, as SGLang's Mamba stack (``_MambaStrategy``) makes them. The
    host pool is built from the device pool's declaration of its state buffers
    (``MambaStateBufferInfo``, here CPU tensors: a float32 temporal state and two
    bfloat16 conv states per layer and slot); only pinning is left out."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    kv = MHATokenToKVPool(
        tokens, case.page_size, dtype, case.heads, case.head_dim, case.layers, "cpu", False
    )
    host = _mha_host(case, kv, common)
    slots = tokens // case.page_size
    states = MambaStateBufferInfo(
        temporal=torch.zeros(case.layers, slots, case.heads, 4, 4),
        conv=tuple(
            torch.zeros(case.layers, slots, width, 3, dtype=torch.bfloat16) for width in (8, 4)
        ),
    )
    # SGLang's Mamba host pool is page-first whatever the KV pool's layout
    mamba = MambaPoolHost(
        states, 2.0, 0, device_capacity=slots, pin_memory=False, layout="page_first"
    )
    layers = {layer: layer for layer in range(case.layers)}
    group = _host_group(
        2 * case.layers, (PoolName.KV, host, kv, layers), (PoolName.MAMBA, mamba, None, layers)
    )
    allocator = PagedTokenToKVPoolAllocator(tokens, case.page_size, dtype, "cpu", kv, False)
    return Pools(allocator, host, controller_pool=group, trailing=mamba)


def minimax_host_pools(case: Case, tokens: int) -> tuple[Any, Any, Any]:
    """SGLang's MiniMax-M3 device pool and its two host pools (K/V, index keys), as
    SGLang's MiniMax stack (``build_minimax_sparse_hicache_stack``) makes them; only
    pinning is left out. ``minimax``: a ``MiniMaxSparseKVPool`` (layer 0 dense, the
    others sparse with K-only index keys of 16 elements), an MHA host pool of its main
    pool and ``MHATokenToKOnlyPoolHost``. ``minimax-nvfp4``: a ``MiniMaxM3Nvfp4KVPool``
    (every layer sparse, 128-element index keys) and its two page-row host pools."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool
    from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import MiniMaxM3Nvfp4KVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost
    from sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4 import (
        MiniMaxM3Nvfp4IndexKPoolHost,
        MiniMaxM3Nvfp4MainKVPoolHost,
    )

    nvfp4 = case.model == "minimax-nvfp4"
    sparse = list(range(0 if nvfp4 else 1, case.layers))
    device = (MiniMaxM3Nvfp4KVPool if nvfp4 else MiniMaxSparseKVPool)(
        size=tokens,
        page_size=case.page_size,
        dtype=getattr(torch, case.dtype),
        head_num=case.heads,
        head_dim=case.head_dim,
        idx_head_dim=128 if nvfp4 else 16,
        dense_layer_ids=[] if nvfp4 else [0],
        sparse_layer_ids=sparse,
        device="cpu",
        disable_value_sparse_layer_ids=sparse,  # SGLang stores K-only index layers
        start_layer=0,
        end_layer=case.layers,
    )
    main, index = device.main_pool, device.index_k_pool
    if not nvfp4:
        common = {"host_to_device_ratio": 2.0, "host_size": 0, "page_size": case.page_size}
        host = _mha_host(case, main, common)
        return device, host, MHATokenToKOnlyPoolHost(index, host, case.layout, pin_memory=False)
    layers = {"start_layer": 0, "end_layer": case.layers}
    info = main.get_device_pool_infos()[0].buffer_info
    host = MiniMaxM3Nvfp4MainKVPoolHost(
        info,
        2.0,
        0,
        case.page_size,
        case.layout,
        pin_memory=False,
        device_capacity_tokens=main.size,
        **layers,
    )
    info = index.get_device_pool_infos()[0].buffer_info
    index_host = MiniMaxM3Nvfp4IndexKPoolHost(info, host, case.layout, pin_memory=False, **layers)
    return device, host, index_host


def _minimax_pools(case: Case, tokens: int, dtype: Any) -> Pools:
    """:func:`minimax_host_pools` in a ``HostPoolGroup``, the index keys moved with the
    KV pool's host indices."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName

    device, host, index = minimax_host_pools(case, tokens)
    group = _host_group(
        case.layers,
        (PoolName.KV, host, device.main_pool, {layer: layer for layer in range(case.layers)}),
        (PoolName.INDEXER, index, device.index_k_pool, device.index_k_layer_id_mapping),
    )
    allocator = PagedTokenToKVPoolAllocator(
        tokens, case.page_size, dtype, "cpu", device.main_pool, False
    )
    return Pools(allocator, host, index, group)


def _draft_pools(
    case: Case,
    allocator: Any,
    device: Any,
    host: Any,
    tokens: int,
    dtype: Any,
    common: dict[str, Any],
) -> Pools:
    """The target's KV pool alone in a ``HostPoolGroup`` (what a hybrid controller
    needs to take a draft pool later), and a one-layer draft pool of the target's kind
    and layout with a host pool of the target's size, as SGLang's
    ``build_full_draft_pools`` makes it; its entry is registered after start-up."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_pool_entry,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    layers = {layer: layer for layer in range(case.layers)}
    group = _host_group(case.layers, (PoolName.KV, host, device, layers))
    if case.model == "mha":
        draft_device = MHATokenToKVPool(
            tokens, case.page_size, dtype, case.heads, case.head_dim, 1, "cpu", False
        )
        draft = _mha_host(case, draft_device, common)
    else:
        draft_device = MLATokenToKVPool(
            tokens, case.page_size, dtype, case.kv_lora_rank, case.rope_dim, 1, "cpu", False
        )
        draft = MLATokenToKVPoolHost(
            draft_device.get_device_pool_infos()[0].buffer_info,
            layout=case.layout,
            pin_memory=False,
            device_capacity_tokens=draft_device.size,
            start_layer=0,
            end_layer=1,
            target_layer_num=1,
            override_kv_cache_dim=draft_device.kv_cache_dim,
            **common,
        )
    entry = build_pool_entry(
        name=PoolName.DRAFT,
        host_pool=draft,
        device_pool=draft_device,
        layer_mapping={0: 0},
        transfer_layer_id_max=1,
    )
    return Pools(allocator, host, controller_pool=group, draft=draft, draft_entry=entry)


def _mha_host(case: Case, device: Any, common: dict[str, Any]) -> Any:
    """The MHA host pool SGLang builds over ``device`` (``_mha_host_inputs``), in the
    case's layout; pin_memory=False: pinning needs CUDA, and SGLang's builder pins."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs

    cls, info, kwargs = _mha_host_inputs(device)
    return cls(info, layout=case.layout, pin_memory=False, **common, **kwargs)


def _host_group(layer_max: int, *pools: tuple[Any, Any, Any, dict[int, int]]) -> Any:
    """SGLang's ``HostPoolGroup`` of ``(name, host pool, device pool, layer mapping)``
    entries, the first the anchor, as its stack builders make it."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.pool_host import HostPoolGroup

    return HostPoolGroup(
        [
            build_pool_entry(
                name=name,
                host_pool=host,
                device_pool=device,
                layer_mapping=layers,
                transfer_layer_id_max=layer_max,
                is_anchor=i == 0,
            )
            for i, (name, host, device, layers) in enumerate(pools)
        ]
    )


def _dsa_pools(case: Case, allocator: Any, device: Any, host: Any) -> Pools:
    """The KV and indexer host pools in a ``HostPoolGroup``, as SGLang's DSA stack
    (``_DsaStrategy``: ``prepare_host_pool_config`` + ``build_host_pool_group``) makes
    them, from the device pool's own pool declarations; only pinning is left out."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    decls = {decl.pool_name: decl for decl in device.host_pool_decls()}
    indexer = DSAIndexerPoolHost(decls[PoolName.INDEXER], host, pin_memory=False)
    layers = {layer: layer for layer in range(case.layers)}
    group = _host_group(
        case.layers,
        (PoolName.KV, host, device, layers),
        (PoolName.INDEXER, indexer, device, layers),
    )
    return Pools(allocator, host, indexer, group)


def expected_page(
    case: Case, shard: int, page: int, numel: int, dtype: Any, pool: str = "kv"
) -> Any:
    """The bytes shard ``shard`` holds for page ``page`` of ``pool``: seeded, so ranks agree."""
    import torch

    seed = int.from_bytes(
        hashlib.blake2b(f"{case.name}|{pool}|{shard}|{page}".encode(), digest_size=8).digest(),
        "little",
    )
    gen = torch.Generator().manual_seed(seed & (2**63 - 1))
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def expected_flat_kv_page(case: Case, rank: int, page: int) -> Any:
    """The bytes of ``rank``'s flat KV data page ``page``: what SGLang's
    ``get_data_page(flat=True)`` holds, and what its file backend would store."""
    import torch

    shape = (case.layers, case.page_size, case.kv_lora_rank + case.rope_dim)
    if case.model == "mha":
        shape = (2, case.layers, case.page_size, case.heads, case.head_dim)
    numel = int(torch.tensor(shape).prod())
    dtype = getattr(torch, case.dtype)
    return expected_page(case, case.shard_of(rank), page, numel, dtype)


def written(rank_result: dict[str, Any]) -> int:
    """Pages the rank's kvconn wrote to the store (its connector's counters)."""
    return int(rank_result["kvconn"]["total"].get("written", {}).get("pages", 0))


def case_tokens(case: Case) -> list[int]:
    base = int.from_bytes(hashlib.blake2b(case.name.encode(), digest_size=3).digest(), "little")
    return [base + t for t in range(case.pages * case.page_size)]


def _bytes(t: Any) -> Any:
    return t.contiguous().view(-1).view(__import__("torch").uint8)


def _wait(q: Any, what: str) -> Any:
    try:
        return q.get(timeout=STEP_TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError(f"no {what} within {STEP_TIMEOUT_S:.0f}s") from None


def _run_case(rank: int, model_dir: str, case: Case) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    started = time.monotonic()
    _publish(case, rank, model_dir)
    pools = _pools(case, rank)
    host = pools.host
    ps = case.page_size
    common = dict(
        io_backend="direct",
        storage_backend=case.backend,
        prefetch_threshold=ps,
        model_name="kvconn-test-model",
        storage_backend_extra_config=dict(case.extra_config),
    )
    if case.hybrid:
        controller = HybridCacheController(
            pools.allocator,
            pools.controller_pool,
            ps,
            dist.group.WORLD,
            threading.Event(),
            transfer_layer_id_max=case.layers * (2 if case.trailing_pool else 1),
            **common,
        )
    elif case.pipeline:
        # as a server's scheduler builds it: this stage's TP group (itself, at TP=1) and
        # the pipeline's group, over which SGLang agrees on hits and loads with MIN
        own = [dist.new_group([r]) for r in range(WORLD)][rank]
        controller = HiCacheController(
            pools.allocator,
            host,
            ps,
            own,
            threading.Event(),
            pp_group=dist.group.WORLD,
            **common,
        )
    else:
        controller = HiCacheController(
            pools.allocator, host, ps, dist.group.WORLD, threading.Event(), **common
        )
    if pools.draft_entry is not None:  # the draft worker comes up after the storage
        controller.register_host_pool_entry(pools.draft_entry)
    # What each pool holds, for writing known bytes and reading them back.
    side = {"kv": host} | ({"indexer": pools.indexer} if pools.indexer is not None else {})
    if pools.draft is not None:
        side["draft"] = pools.draft
    trailing = pools.trailing
    if case.trailing_pool:
        side[case.trailing_pool] = trailing
    result: dict[str, Any] = {"rank": rank, "case": asdict(case) | {"between_hit_and_get": None}}
    try:
        storage = controller.storage_backend
        result["storage_class"] = type(storage).__name__
        tokens = case_tokens(case)
        hashes = get_storage_hash_str(tokens, None, page_size=ps)

        # a flat page's element type: the indexer's is its own (bytes), not the model's
        dtypes = {name: pool.get_dummy_flat_data_page().dtype for name, pool in side.items()}

        def page(pool: str, i: int) -> Any:
            numel = side[pool].get_dummy_flat_data_page().numel()
            return expected_page(case, case.shard_of(rank, pool), i, numel, dtypes[pool], pool)

        # pass 1: a cold request misses, then its pages are written through
        result["cold_hit_tokens"] = _hit_query(controller, case, "cold", tokens)[1]
        written = host.alloc(len(tokens))
        for name, pool in side.items():
            if name == case.trailing_pool:
                continue
            for i in range(case.pages):
                pool.set_from_flat_data_page(int(written[i * ps]), page(name, i).view(dtypes[name]))
        sidecars = _sidecars(case, keys=hashes)
        if case.trailing_pool:  # the pages of the stored windows, on their own slots
            name, tps = case.trailing_pool, trailing.page_size
            window_written = trailing.alloc(len(case.stored_window) * tps)
            for j, i in enumerate(case.stored_window):
                trailing.set_from_flat_data_page(
                    int(window_written[j * tps]), page(name, i).view(dtypes[name])
                )
            sidecars = {"extra_pools": [_window_backup(case, hashes, window_written)]}
        clock = time.perf_counter()
        controller.write_storage(written, tokens, hash_value=hashes, **sidecars)
        backup = _wait(controller.ack_backup_queue, "backup ack")
        result["seconds_backup"] = time.perf_counter() - clock
        result["backup_completed_tokens"] = backup.completed_tokens
        dist.barrier()
        host.free(written)
        if case.trailing_pool:
            trailing.free(window_written)
        for pool in side.values():  # what is read back must come from the store
            for buffer in _buffers(pool):
                buffer.zero_()

        # pass 2: the same prompt hits and loads the pages into fresh host slots
        clock = time.perf_counter()
        op, hit = _hit_query(controller, case, "warm", tokens)
        result["seconds_hit_query"] = time.perf_counter() - clock
        result["hit_tokens"] = hit
        result["pool_hit_pages"] = {
            str(name): pages for name, pages in getattr(op, "query_pool_hit_pages", {}).items()
        }
        if case.between_hit_and_get is not None:
            case.between_hit_and_get(rank, storage, hashes)
        dist.barrier()
        target = host.alloc(hit)
        op.host_indices = target
        window_load = None
        if case.trailing_pool and hit:  # SGLang's staging: the planned window
            (window_load,) = op.pool_transfers
            window_load.host_indices = trailing.alloc(len(window_load.keys) * trailing.page_size)
        if case.terminated_on == rank:
            op.mark_terminate()
        clock = time.perf_counter()
        controller.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = _wait(controller.ack_prefetch_queue, "prefetch ack")
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if case.trailing_pool and getattr(ack, "pool_hits", None):
                # the window's pages loaded, MIN over the group: what the radix cache is told
                result[f"{case.trailing_pool}_loaded_pages"] = ack.pool_hits[case.trailing_pool]
            if ack.completed_req:
                break
        result["seconds_load"] = time.perf_counter() - clock
        result["loaded_tokens"] = completed
        if window_load is not None:  # the controller keyed the window at the loaded pages
            name = case.trailing_pool
            expected = lambda i: page(name, i)  # noqa: E731
            result.update(_window_loaded(name, window_load, trailing, hashes, expected))
        for name, pool in side.items():
            if name == case.trailing_pool:
                continue
            matches = []
            untouched = []
            for i in range(hit // ps):
                got = _bytes(pool.get_data_page(int(target[i * ps]), flat=True))
                if i < completed // ps:
                    matches.append(bool(torch.equal(got, page(name, i))))
                else:
                    untouched.append(bool((got == 0).all()))
            prefix = "" if name == "kv" else f"{name}_"
            result[f"{prefix}pages_equal"] = matches
            result[f"{prefix}failed_pages_untouched"] = untouched
        # the same prompt asked again, after the load (and any eviction)
        result["hit_tokens_after"] = _hit_query(controller, case, "again", tokens)[1]
        if pools.indexer is not None:
            # SGLang registers dynamic side pools after start-up; the layout is fixed by then
            result["late_registration"] = _late_registration(storage, pools.indexer)
        connector = getattr(storage, "connector", None)
        result["kvconn"] = connector.stats.snapshot() if connector is not None else None
        result["pool_groups"] = dict(getattr(storage, "pool_groups", {}))
        rounds = getattr(storage, "rounds", None)
        if rounds is not None:
            result["rounds"] = {"striped": rounds.striped, "handed_back": rounds.handed_back}
        if connector is not None:
            result["first_page_keys"] = _first_page_keys(connector, hashes[0])
    finally:
        controller.detach_storage_backend()
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def _late_registration(storage: Any, pool: Any) -> str:
    """What registering ``pool`` as the indexer again, after start-up, raises."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    try:
        storage.register_mem_host_pool_v2(pool, PoolName.INDEXER)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _buffers(pool: Any) -> list[Any]:
    """A host pool's tensors: the KV buffer, the DSA indexer's keys and scales,
    MiniMax-M3's index keys, or a Mamba pool's state buffers (a list of its own)."""
    buffer = getattr(pool, "index_k_with_scale_buffer", None)
    if buffer is None:
        buffer = pool.k_buffer if hasattr(pool, "k_buffer") else pool.kv_buffer
    return list(buffer) if isinstance(buffer, list) else [buffer]


def _sidecars(case: Case, keys: list[str] | None = None) -> dict[str, Any]:
    """The side-pool transfers SGLang's radix cache hands a hybrid controller with a
    backup or a prefetch (``UnifiedRadixCache._build_sidecar_transfers``): for DSA, the
    indexer pool, moved with the KV pool's host indices and keys; for SWA, a prefetch's
    window of placeholder keys (``SWAComponent``, phase ``PREFETCH``)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    if case.trailing_pool:  # SWA's window, or Mamba's one page
        window = PoolTransfer(
            name=PoolName(case.trailing_pool),
            keys=["__placeholder__"] * case.window,
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        return {"extra_pools": [window]}
    if not case.indexer and not case.draft:
        return {}
    side = PoolTransfer(
        name=PoolName.DRAFT if case.draft else PoolName.INDEXER,
        keys=keys,
        hit_policy=PoolHitPolicy.ALL_PAGES,
        indices_from_pool=PoolName.KV,
    )
    return {"extra_pools": [side]}


def _window_backup(case: Case, hashes: list[str], host_indices: Any) -> Any:
    """The transfer SGLang's SWA or Mamba component adds to a backup: the stored
    windows' pages (``stored_window``) on the pool's host slots, under their page keys
    (a Mamba state under its checkpoint page's)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(
        name=PoolName(case.trailing_pool),
        host_indices=host_indices,
        keys=[hashes[i] for i in case.stored_window],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def _window_loaded(
    name: str, transfer: Any, pool: Any, hashes: list[str], expected: Any
) -> dict[str, Any]:
    """Which pages the controller keyed the window's load at (the window ending at the
    loaded pages), whether each arrived with its bytes, and whether each is still zero
    (a page that did not arrive must be left untouched)."""
    import torch

    pages = [hashes.index(key) for key in transfer.keys]
    got = [
        _bytes(pool.get_data_page(int(transfer.host_indices[j * pool.page_size]), flat=True))
        for j in range(len(pages))
    ]
    return {
        f"{name}_window_pages": pages,
        f"{name}_pages_equal": [bool(torch.equal(g, expected(i))) for g, i in zip(got, pages)],
        f"{name}_pages_zero": [bool((g == 0).all()) for g in got],
    }


def _first_page_keys(connector: Any, page_hash: str) -> list[str]:
    """The store keys of this rank's pages of the first block, one per layer group."""
    from kvconn.hashing import adopt_hashes
    from kvconn.plan import share_key
    from kvconn_sglang.storage import HASH_SCHEME

    (digest,) = adopt_hashes(HASH_SCHEME, [page_hash])
    return [str(share_key(connector.prefix, share, digest)) for share in connector.shares]


def _hit_query(controller: Any, case: Case, rid: str, tokens: list[int]) -> tuple[Any, int]:
    """Ask the controller's prefetch thread for the group-wide hit, as the radix cache does."""
    if case.hybrid:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        op = controller.prefetch(CacheRequestHandle(rid, 0), tokens, **_sidecars(case))
    else:
        op = controller.prefetch(rid, tokens)
    done = _wait(controller.prefetch_hit_queue, "hit query")
    assert done is op
    return op, int(op.storage_hit_count)
