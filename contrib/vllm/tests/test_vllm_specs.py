"""kvconn layouts from vLLM's own KV-cache spec objects, grouping and allocation.

No engine: the specs are vLLM's classes (the DeepSeek-V3.2 indexer's from its own
layer), ``get_kv_cache_configs`` groups them as the engine core does, and
``allocate_kv_cache`` makes the tensors a worker would hand the connector.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvconn.errors import ConfigError
from kvconn.layout import Chunked, KvLayout
from kvconn.lograte import LogInterval
from kvconn.plan import plan_pages
from kvconn_vllm.connector import KvconnConnector, eagle_hit
from kvconn_vllm.layout import kv_layout
from kvconn_vllm.specs import cache_groups, window_blocks


def engine_config(model: Path) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=256
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvconnConnector",
            kv_connector_module_path="kvconn_vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"model": "m", "backend": "lmdb"},
        ),
    )


def allocate(
    config: VllmConfig, specs: dict[str, KVCacheSpec], backend: str
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's grouping and allocation of these layers, as the engine and a worker do it."""
    config.cache_config.block_size = next(iter(specs.values())).block_size
    layouts = get_supported_kv_cache_layouts([AttentionBackendEnum[backend].get_class()])
    resolve_kv_cache_layout(config, [[x.name for x in layouts]], list(specs.values()))
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [4 << 20])
    layout = config.cache_config.get_resolved_kv_cache_layout()
    return kv_cache_config, allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


def derive(
    config: VllmConfig, kv_cache_config: KVCacheConfig, caches: dict[str, torch.Tensor], tp: int
) -> KvLayout:
    layout, _ = kv_layout(
        caches,
        cache_groups(config, kv_cache_config),
        num_blocks=kv_cache_config.num_blocks,
        block_size=config.cache_config.block_size,
        tp_size=tp,
        dtype_tags={name: f"{t.dtype}" for name, t in caches.items()},
    )
    return layout


def mla_fields(block_size: int) -> dict[str, Any]:
    """What vLLM's MLA attention layer declares of its latent, windowed or not
    (``MLAAttention.get_kv_cache_spec``)."""
    return {
        "block_size": block_size,
        "num_kv_heads": 1,
        "max_tp_shards": 1,
        "head_size": 576,
        "dtype": torch.float32,
        "cache_dtype_str": "auto",
    }


def mla_latent(block_size: int = 16) -> MLAAttentionSpec:
    """The spec vLLM's MLA attention layer declares (``MLAAttention.get_kv_cache_spec``)."""
    return MLAAttentionSpec(**mla_fields(block_size))


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_deepseek_v2s_mla_latent_is_one_replicated_page_per_block_at_any_tp(
    tp: int, tiny_model: Callable[[str], Path]
) -> None:
    config = engine_config(tiny_model("deepseek-v2"))
    assert config.model_config.use_mla
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": mla_latent() for i in (0, 1)
    }
    kv_cache_config, caches = allocate(config, specs, "CPU_MLA")
    layout = derive(config, kv_cache_config, caches, tp)
    assert [(r.name, r.units) for r in layout.roles] == [("latent", 1)]
    (plan,) = plan_pages(layout)
    assert plan.shard_class.replicated and plan.page_size == 2 * 16 * 576 * 4
    assert layout.tokens_per_block == 16


def test_deepseek_v32s_indexer_keys_join_the_latents_replicated_page(
    tiny_model: Callable[[str], Path],
) -> None:
    """The indexer's cache is vLLM's ``DeepseekV32IndexerCache``: an ``MLAAttentionSpec``
    with the ``INDEXER`` role, 128 fp8 values and a 4-byte scale per token."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    config = engine_config(tiny_model("deepseek-v2"))
    config.cache_config.block_size = 16  # what the indexer's spec takes its block size from
    specs: dict[str, KVCacheSpec] = {}
    with set_current_vllm_config(config):
        for i in (0, 1):
            specs[f"model.layers.{i}.self_attn.attn"] = mla_latent()
            name = f"model.layers.{i}.self_attn.indexer.k_cache"
            cache = DeepseekV32IndexerCache(132, torch.uint8, name, config.cache_config)
            specs[name] = cache.get_kv_cache_spec(config)
    kv_cache_config, caches = allocate(config, specs, "CPU_MLA")
    layout = derive(config, kv_cache_config, caches, tp=8)
    assert sorted((r.name, r.units) for r in layout.roles) == [("index_k", 1), ("latent", 1)]
    (plan,) = plan_pages(layout)  # both in the one replicated page of a block
    assert plan.shard_class.replicated
    assert dict(plan.role_bytes) == {"latent": 2 * 16 * 576 * 4, "index_k": 2 * 16 * 132}


@pytest.mark.parametrize("tp", [1, 2])
def test_minimax_m3s_index_keys_are_one_replicated_page_beside_each_ranks_kv(
    tp: int, tiny_model: Callable[[str], Path]
) -> None:
    """MiniMax-M3's sparse layers keep a 1-head index key per token next to their GQA
    K/V: vLLM's ``MiniMaxM3IndexerCache`` declares it an ``MLAAttentionSpec`` with the
    ``INDEXER`` role, whole on every rank. vLLM groups it with the K/V layers; kvconn
    stores it once per block, the K/V per rank."""
    from kvconn.testing.torchvision_stub import torchvision_stubbed

    with torchvision_stubbed():  # the model package imports its vision processor
        from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerCache

    config = engine_config(tiny_model("llama-2kv"))
    config.cache_config.block_size = 32
    heads = 2 // tp  # the model's 2 KV heads over the ranks
    kv = {"block_size": 32, "num_kv_heads": heads, "head_size": 64, "dtype": torch.float32}
    specs: dict[str, KVCacheSpec] = {}
    with set_current_vllm_config(config):
        for i in range(3):  # layer 0 dense, layers 1 and 2 sparse
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(**kv)
            if i:
                name = f"model.layers.{i}.self_attn.indexer.k_cache"
                cache = MiniMaxM3IndexerCache(128, name, config.cache_config)
                specs[name] = cache.get_kv_cache_spec(config)
    kv_cache_config, caches = allocate(config, specs, "CPU_ATTN")
    layout = derive(config, kv_cache_config, caches, tp)
    assert sorted((r.name, r.units) for r in layout.roles) == [("index_k", 1), ("kv", 2)]
    plans = {p.shard_class.replicated: p for p in plan_pages(layout)}
    assert dict(plans[True].role_bytes) == {"index_k": 2 * 32 * 128 * 2}  # bf16, 2 layers
    assert dict(plans[False].role_bytes) == {"kv": 3 * 2 * 32 * heads * 64 * 4}
    assert plans[False].shard_class.num_shards == tp


def sliding_mla_latent(window: int, block_size: int = 16) -> SlidingWindowMLASpec:
    """The spec vLLM's MLA attention layer declares with a sliding window (dots.llm3's
    sliding layers, ``MLAAttention.get_kv_cache_spec``)."""
    return SlidingWindowMLASpec(**mla_fields(block_size), sliding_window=window)


@pytest.mark.parametrize("tp", [1, 2])
def test_sliding_window_mla_layers_are_a_replicated_latent_group_with_their_window(
    tp: int, tiny_model: Callable[[str], Path]
) -> None:
    """dots.llm3's sliding MLA layers: vLLM's hybrid manager puts them in a group of their
    own (its ``SlidingWindowManager``); their latent is whole on every rank, so one page
    per block for the group, needed only in the window."""
    config = engine_config(tiny_model("deepseek-v2"))
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": sliding_mla_latent(64) if i % 2 else mla_latent()
        for i in range(4)
    }
    kv_cache_config, caches = allocate(config, specs, "CPU_MLA")
    layout = derive(config, kv_cache_config, caches, tp)
    windows = {tuple(r.layer for r in g.regions): g.window for g in layout.groups}
    assert windows == {(0, 2): None, (1, 3): 4}  # 63 earlier tokens: 4 blocks of 16
    assert [(r.name, r.units) for r in layout.roles] == [("latent", 1)]
    assert all(p.shard_class.replicated for p in plan_pages(layout))


def compressed_indexer(tokens_per_state: int, max_tp_shards: int | None) -> MLAAttentionSpec:
    """An indexer cache holding one state per ``tokens_per_state`` tokens (GLM-5.3's
    ``Glm5NextIndexerCache``; Qwen4Exp's QSA keys and DeepSeek-V4.1's compressed KV
    are the same class with another role)."""
    return MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        max_tp_shards=max_tp_shards,
        head_size=132,
        dtype=torch.uint8,
        cache_dtype_str="auto",
        cache_role=SparseCacheRole.INDEXER,
        tokens_per_state=tokens_per_state,
    )


@pytest.mark.parametrize(("shards", "units"), [(1, 1), (None, 2)])
def test_a_compressed_mla_cache_is_a_role_of_its_ratio_with_the_states_of_a_block(
    tiny_model: Callable[[str], Path], shards: int | None, units: int
) -> None:
    """Four tokens per state: a block of 16 holds 4 states, and its page is those. Marked
    whole on every rank, stored once; unmarked, per rank (vLLM: not replicated)."""
    config = engine_config(tiny_model("deepseek-v2"))
    config.cache_config.block_size = 16
    config.parallel_config.tensor_parallel_size = 2
    specs: dict[str, KVCacheSpec] = {}
    for i in (0, 1):
        specs[f"model.layers.{i}.self_attn.attn"] = mla_latent()
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = compressed_indexer(4, shards)
    groups = [KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(16, specs))]
    described = cache_groups(config, kv_cache_config(groups))
    kinds = {name: what for group in described for name, what in group.layers}
    assert kinds["model.layers.1.self_attn.indexer.k_cache"].role == "index_k_per4"
    assert kinds["model.layers.1.self_attn.indexer.k_cache"].units == units
    assert kinds["model.layers.1.self_attn.attn"].role == "latent"
    caches = {
        name: torch.zeros(8, 1, 16 // spec.tokens_per_state, spec.head_size)
        for name, spec in specs.items()
    }
    layout, _ = kv_layout(
        caches,
        described,
        num_blocks=8,
        block_size=16,
        tp_size=2,
        dtype_tags=dict.fromkeys(caches, "t"),
    )
    pages = {p.shard_class.replicated: dict(p.role_bytes) for p in plan_pages(layout)}
    index_page = 2 * 4 * 132 * 4  # 2 layers, 4 states of 132 (float32 zeros here)
    if units == 1:
        assert pages == {True: {"latent": 2 * 16 * 576 * 4, "index_k_per4": index_page}}
    else:
        assert pages == {True: {"latent": 2 * 16 * 576 * 4}, False: {"index_k_per4": index_page}}


@pytest.mark.parametrize("tokens_per_state", [3, Fraction(1, 2)])
def test_an_mla_cache_of_no_whole_number_of_states_per_block_is_refused(
    tiny_model: Callable[[str], Path], tokens_per_state: Any
) -> None:
    config = engine_config(tiny_model("deepseek-v2"))
    config.cache_config.block_size = 16
    spec = dataclasses.replace(compressed_indexer(4, 1), tokens_per_state=tokens_per_state)
    name = "model.layers.0.self_attn.indexer.k_cache"
    with pytest.raises(ConfigError, match="whole number of states per block"):
        connector(config, [KVCacheGroupSpec([name], spec)])


def test_a_sliding_group_wrapped_for_its_page_sizes_keeps_its_window(
    tiny_model: Callable[[str], Path],
) -> None:
    """Sliding layers of two head sizes share a block table in a
    ``UniformTypeKVCacheSpecs``, which says no window itself: each layer's spec does."""
    config = engine_config(tiny_model("llama-2kv"))
    config.cache_config.block_size = 32
    kv = {"block_size": 32, "num_kv_heads": 2, "dtype": torch.float32, "sliding_window": 64}
    layers = {
        "model.layers.0.self_attn.attn": SlidingWindowSpec(head_size=64, **kv),
        "model.layers.1.self_attn.attn": SlidingWindowSpec(head_size=128, **kv),
    }
    groups = [KVCacheGroupSpec(list(layers), UniformTypeKVCacheSpecs(32, layers))]
    (group,) = cache_groups(config, kv_cache_config(groups))
    assert group.window == 2
    mixed = dict(layers) | {
        "model.layers.2.self_attn.attn": FullAttentionSpec(
            **{k: v for k, v in kv.items() if k != "sliding_window"}, head_size=64
        )
    }
    groups = [KVCacheGroupSpec(list(mixed), UniformTypeKVCacheSpecs(32, mixed))]
    with pytest.raises(ConfigError, match="need different windows"):
        cache_groups(config, kv_cache_config(groups))


def test_each_hybrid_kv_cache_group_is_a_layer_group_and_the_sliding_one_has_its_window(
    tiny_model: Callable[[str], Path],
) -> None:
    config = engine_config(tiny_model("gemma3"))
    kv = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(sliding_window=64, **kv) if i % 2 == 0 else FullAttentionSpec(**kv)
        )
        for i in range(4)
    }
    kv_cache_config, caches = allocate(config, specs, "CPU_ATTN")
    assert len(kv_cache_config.kv_cache_groups) == 2  # the hybrid manager's groups
    layout = derive(config, kv_cache_config, caches, tp=2)
    assert [(g.index, g.window, [r.layer for r in g.regions]) for g in layout.groups] == [
        (0, 2, [0, 2]),
        (1, None, [1, 3]),
    ]
    plans = plan_pages(layout)
    assert [(p.group, p.shard_class.label, p.window) for p in plans] == [
        (0, "w2", 2),
        (1, "w2", None),
    ]


@pytest.mark.parametrize(
    ("window", "block_size", "extra"),
    [(64, 32, 0), (65, 32, 0), (4096, 16, 0), (100, 32, 7), (1, 32, 0)],
)
def test_a_sliding_window_needs_exactly_the_blocks_vllm_keeps_real_after_a_hit(
    window: int, block_size: int, extra: int
) -> None:
    """For an N-block hit vLLM pads the first ``get_num_skipped_tokens(N * block_size)
    // block_size`` blocks of a sliding group with its null block: the others are
    loaded, and they are the window kvconn needs pages for."""
    spec = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.float32,
        sliding_window=window,
        extra_retained_tokens=extra,
    )
    manager: Any = SimpleNamespace(sliding_window=window, extra_retained_tokens=extra)
    for n in range(1, 300):
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, n * block_size)
        real = n - skipped // block_size
        assert real == min(n, window_blocks(spec, block_size)) or (window == 1 and real == 0)


def kv_cache_config(groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def connector(config: VllmConfig, groups: list[KVCacheGroupSpec]) -> KvconnConnector:
    return KvconnConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(groups))


def qwen3_next_groups(**mamba: Any) -> list[KVCacheGroupSpec]:
    """Qwen3-Next's Gated DeltaNet and attention layers, as vLLM describes them here."""
    state = MambaSpec(
        block_size=256,
        shapes=((3, 512), (4, 64, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=131072,
        **({"mamba_cache_mode": "align"} | mamba),
    )
    full = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return [
        KVCacheGroupSpec(["model.layers.0.linear_attn"], state),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
    ]


def mamba_config(model: Path, tp: int = 1, prefix_caching: bool = True) -> VllmConfig:
    config = engine_config(model)
    config.cache_config.block_size = 256
    config.cache_config.enable_prefix_caching = prefix_caching
    config.parallel_config.tensor_parallel_size = tp
    return config


def test_a_mamba_state_in_align_mode_is_a_window_1_group_keyed_by_what_its_bytes_are(
    tiny_model: Callable[[str], Path],
) -> None:
    """A hit needs the state after its last block only; each TP rank's state slice is
    its own page, and the role names the states' dtypes, shapes and kernel family (the
    tensor vLLM hands over is raw bytes)."""
    groups = cache_groups(
        mamba_config(tiny_model("qwen3-next"), tp=2), kv_cache_config(qwen3_next_groups())
    )
    state, attention = groups
    assert (state.index, state.window, state.kind) == (0, 1, "mamba")
    ((name, what),) = state.layers
    assert name == "model.layers.0.linear_attn" and (what.role, what.units) == ("mamba", 2)
    assert what.tag == "bfloat16[3x512]+float32[4x64x64]+MAMBA2"
    assert (attention.window, attention.kind) == (None, "attention")


def test_a_mamba_state_page_is_the_states_bytes_of_vllms_own_allocation(
    tiny_model: Callable[[str], Path],
) -> None:
    """vLLM hands a Mamba layer's cache as raw bytes, each block's row padded to the
    attention page: the page is the state's 68,608 bytes, not the padding."""
    config = mamba_config(tiny_model("qwen3-next"))
    specs = {g.layer_names[0]: g.kv_cache_spec for g in qwen3_next_groups()}
    kv_cache_config, caches = allocate(config, specs, "CPU_ATTN")
    layout = derive(config, kv_cache_config, caches, 1)
    state, attention = layout.groups
    ((region,),) = [state.regions]
    assert (state.window, state.name, region.role, region.layer) == (1, "mamba", "mamba", 0)
    assert (region.size, region.stride) == (3 * 512 * 2 + 4 * 64 * 64 * 4, 131072)
    assert layout.role("mamba").dtype == "bfloat16[3x512]+float32[4x64x64]+MAMBA2+1x1x68608"
    assert attention.window is None and attention.regions[0].role == "kv"


def test_a_state_every_tp_rank_holds_whole_is_stored_once(
    tiny_model: Callable[[str], Path],
) -> None:
    config = mamba_config(tiny_model("qwen3-next"), tp=2)
    state, _ = cache_groups(config, kv_cache_config(qwen3_next_groups(tp_replicated=True)))
    assert state.layers[0][1].units == 1


@pytest.mark.parametrize(
    ("mamba", "prefix_caching", "reason"),
    [
        ({"mamba_cache_mode": "none"}, True, "only with mamba_cache_mode='align'"),
        ({}, False, "only with vLLM's prefix caching on"),
        (
            {"num_speculative_blocks": 2},
            True,
            "without speculative decoding (a draft model, MTP or n-gram",
        ),
    ],
)
def test_a_mamba_state_kvconn_cannot_key_per_block_is_refused_naming_the_layer(
    tiny_model: Callable[[str], Path], mamba: dict[str, Any], prefix_caching: bool, reason: str
) -> None:
    """Refused rather than stored without its state: an attention-only hit would resume
    a request from a state that is not its prompt's."""
    config = mamba_config(tiny_model("qwen3-next"), prefix_caching=prefix_caching)
    with pytest.raises(ConfigError) as error:
        connector(config, qwen3_next_groups(**mamba))
    message = str(error.value)
    assert str(tiny_model("qwen3-next")) in message and "model.layers.0.linear_attn" in message
    assert reason in message


def test_a_mamba_state_under_speculative_decoding_is_refused_even_without_speculative_blocks(
    tiny_model: Callable[[str], Path],
) -> None:
    """With vLLM's replayed SSM (``use_replayssm``) MTP keeps no speculative state blocks;
    which block holds a hit's state under the EAGLE block drop is then not kvconn's rule."""
    config = mamba_config(tiny_model("qwen3-next"))
    config.speculative_config = SimpleNamespace(draft_model_config=None)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="its states replayed"):
        connector(config, qwen3_next_groups())


def test_a_group_mixing_state_and_attention_layers_is_refused(
    tiny_model: Callable[[str], Path],
) -> None:
    """One block table for both: a window of 1 would drop the attention layers' pages."""
    state, attention = (g.kv_cache_spec for g in qwen3_next_groups())
    names = ["model.layers.0.linear_attn", "model.layers.1.self_attn.attn"]
    mixed = UniformTypeKVCacheSpecs(
        block_size=256, kv_cache_specs=dict(zip(names, (state, attention)))
    )
    with pytest.raises(ConfigError, match="mixes Mamba state and attention layers"):
        cache_groups(
            mamba_config(tiny_model("qwen3-next")),
            kv_cache_config([KVCacheGroupSpec(names, mixed)]),
        )


def test_a_mamba_group_vllm_does_not_prefix_cache_is_refused(
    tiny_model: Callable[[str], Path],
) -> None:
    config = mamba_config(tiny_model("qwen3-next"))
    cfg = kv_cache_config(qwen3_next_groups())
    cfg.__dict__["prefix_cacheable_group_ids"] = (1,)  # vLLM's cached_property
    with pytest.raises(ConfigError, match="only with vLLM's prefix caching on"):
        cache_groups(config, cfg)


def test_layers_of_an_unsupported_kind_are_refused(tiny_model: Callable[[str], Path]) -> None:
    config = engine_config(tiny_model("llama-2kv"))
    config.cache_config.block_size = 32
    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with pytest.raises(ConfigError, match="does not support CrossAttentionSpec layers"):
        connector(config, [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], cross)])


def llama4_specs(chunk: int = 64) -> dict[str, KVCacheSpec]:
    """Llama 4's layers as vLLM declares them: chunked local attention in three of four
    (``ChunkedLocalAttention.get_kv_cache_spec``), full attention in the fourth."""
    kv = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    return {
        f"model.layers.{i}.self_attn.attn": (
            FullAttentionSpec(**kv)
            if i == 3
            else ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **kv)
        )
        for i in range(4)
    }


def test_a_chunked_local_attention_group_needs_the_blocks_of_the_chunk_a_hit_ends_in(
    tiny_model: Callable[[str], Path],
) -> None:
    config = engine_config(tiny_model("llama-2kv"))
    kv_cache_config, caches = allocate(config, llama4_specs(), "CPU_ATTN")
    groups = cache_groups(config, kv_cache_config)
    windows = {layer: group.window for group in groups for layer, _ in group.layers}
    assert windows == {
        **{f"model.layers.{i}.self_attn.attn": Chunked(2) for i in range(3)},
        "model.layers.3.self_attn.attn": None,
    }
    layout = derive(config, kv_cache_config, caches, tp=1)
    assert {g.name for g in layout.groups} == {"chunked2", "attention"}
    assert all(dict(p.role_bytes) == {"kv": 2 * 32 * 2 * 64 * 4} for p in plan_pages(layout))


def test_an_attention_chunk_of_no_whole_number_of_blocks_is_refused(
    tiny_model: Callable[[str], Path],
) -> None:
    config = engine_config(tiny_model("llama-2kv"))
    kv_cache_config, _ = allocate(config, llama4_specs(chunk=48), "CPU_ATTN")
    with pytest.raises(ConfigError, match=r"attention chunk \(48 tokens\) to be a whole number"):
        cache_groups(config, kv_cache_config)


def test_kv_cache_groups_with_another_block_size_are_refused(
    tiny_model: Callable[[str], Path],
) -> None:
    config = engine_config(tiny_model("gemma3"))
    config.cache_config.block_size = 32
    kv = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    groups = [
        KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn"],
            SlidingWindowSpec(block_size=64, sliding_window=64, **kv),
        ),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(block_size=32, **kv)),
    ]
    with pytest.raises(ConfigError, match="group 0 has 64-token blocks, block_size is 32"):
        connector(config, groups)


def test_the_connector_declares_support_for_vllms_hybrid_kv_cache_manager() -> None:
    assert supports_hma(KvconnConnector)


def test_lookups_before_the_workers_layout_are_misses_and_the_warning_counts_them(
    tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Until a worker describes the KV layout, the scheduler cannot plan a lookup: it
    answers misses, and says so once an interval with the running count, not once ever."""
    config = engine_config(tiny_model("llama-2kv"))
    config.cache_config.block_size = 32
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    conn = connector(config, [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)])
    requests = [
        SimpleNamespace(
            request_id=f"r{i}", num_tokens=130, block_hashes=[bytes([i, b]) * 16 for b in range(4)]
        )
        for i in range(4)
    ]
    with caplog.at_level(logging.WARNING, logger="kvconn.vllm"):
        answers = [conn.get_num_new_matched_tokens(r, 0) for r in requests[:3]]
        conn._no_layout_log = LogInterval(0.0)  # the next interval has begun
        answers.append(conn.get_num_new_matched_tokens(requests[3], 0))
    assert answers == [(0, False)] * 4
    warnings = [r.getMessage() for r in caplog.records if "no layout" in r.getMessage()]
    assert [w.rsplit("(", 1)[1] for w in warnings] == ["1 so far)", "4 so far)"]


@pytest.mark.parametrize(
    ("restorable", "hit"),
    [
        ((1, 2, 3), 2),  # full attention: one block short of the longest
        ((), 0),
        ((1,), 0),  # the one block's next is not stored: nothing to load
        ((2, 3, 5), 2),  # a sliding window: 5 is a hit, 6 is not; 3 is, 4 is not
        ((2, 3, 5, 6), 5),
    ],
)
def test_an_eagle_hit_is_the_longest_whose_next_block_is_a_hit_too(
    restorable: tuple[int, ...], hit: int
) -> None:
    assert eagle_hit(restorable) == hit
