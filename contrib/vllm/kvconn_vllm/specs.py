"""What kvconn needs of vLLM's KV-cache spec objects, read once at start-up.

vLLM describes every layer's cache with a spec (``vllm/v1/kv_cache_interface.py``) and
groups layers that share a block table into KV-cache groups. This module turns the
groups kvconn can store into plain :class:`~kvconn_vllm.layout.CacheGroup` data, and
refuses, with the model's name and the reason, what it cannot store. It is the only
module of the adapter that looks at vLLM's types; the layout derivation itself
(``kvconn_vllm.layout``) needs only torch.

* ``MLAAttentionSpec``: the MLA latent, and DeepSeek-V3.2's indexer keys (the same class
  with ``cache_role`` ``INDEXER``). vLLM itself declares them ``max_tp_shards=1``: every
  rank holds the whole cache, so kvconn stores it once (role units 1, ``replicated``).
* ``FullAttentionSpec``: K/V by head, ``units`` the model's total KV head count.
* ``SlidingWindowSpec``: the same bytes, plus a window: the tokens a later token still
  attends to. vLLM frees blocks that fall out of it (``SlidingWindowManager``), and a
  hit of ``N`` blocks needs only the group's last ``cdiv(sliding_window - 1 +
  extra_retained_tokens, block_size)`` of them, exactly the blocks vLLM keeps real (the
  rest are its null block) when it allocates such a hit.
* Mamba and linear-attention state (``MambaSpec``) is refused: it is one recurrent
  state per request at a checkpoint, not KV per block, and vLLM 0.32 hands it to
  connectors only as boundary-state offloads (``mamba_cache_mode="align"``,
  ``take_pending_boundary_state_offloads``), which kvconn does not implement.
* Any other spec (chunked local attention, sink or R-SWA attention, cross attention,
  DeepSeek-V4's compressed caches…) is refused: its blocks are not plain per-token KV
  with the rules above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from kvconn.errors import ConfigError
from kvconn_vllm.layout import CacheGroup, LayerBytes

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["cache_groups", "dtype_tag", "window_blocks"]


def cache_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> tuple[CacheGroup, ...]:
    """The KV-cache groups kvconn stores, as plain data; :class:`ConfigError` for a
    model or configuration it cannot store.

    Only vLLM's prefix-cacheable groups are described: those are what a hash-addressed
    store holds and what vLLM expects a connector's load to restore
    (``KVConnectorBase_V1.get_loaded_kv_cache_group_ids``).
    """
    model = vllm_config.model_config.model
    block_size = vllm_config.cache_config.block_size
    parallel = vllm_config.parallel_config
    for what in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, what, 1)
        if size != 1:
            raise ConfigError(
                f"kvconn's vLLM adapter does not support {what}={size} ({model}): context "
                "parallelism splits each block's tokens across ranks"
            )
    mamba = [
        name
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
        if isinstance(_layer_spec(group.kv_cache_spec, name), MambaSpec)
    ]
    if mamba:
        raise ConfigError(
            f"kvconn's vLLM adapter cannot store {model}: its Mamba/linear-attention layers "
            f"({', '.join(mamba[:3])}{', …' if len(mamba) > 3 else ''}) keep a recurrent "
            "state per request, not KV per block, and vLLM 0.32 hands that state to "
            "connectors only as boundary-state offloads, which kvconn does not implement; "
            "serve this model without the kvconn connector"
        )
    hash_block_size = kv_cache_config.hash_block_size or block_size
    total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    groups = []
    for index in kv_cache_config.prefix_cacheable_group_ids:
        group = kv_cache_config.kv_cache_groups[index]
        group_block_size = group.kv_cache_spec.block_size
        if group_block_size != block_size or hash_block_size != block_size:
            raise ConfigError(
                f"kvconn's vLLM adapter needs one block size ({model}): KV cache group "
                f"{index} has {group_block_size}-token blocks, block_size is {block_size}, "
                f"vLLM hashes every {hash_block_size} tokens"
            )
        layers = tuple(
            (name, layer_bytes(_layer_spec(group.kv_cache_spec, name), name, total_kv_heads, model))
            for name in group.layer_names
        )
        spec = group.kv_cache_spec
        window = window_blocks(spec, block_size) if isinstance(spec, SlidingWindowSpec) else None
        groups.append(CacheGroup(index, layers, window))
    if not groups:
        raise ConfigError(f"kvconn's vLLM adapter found no KV cache it can store in {model}")
    return tuple(groups)


def layer_bytes(spec: KVCacheSpec, layer: str, total_kv_heads: int, model: str) -> LayerBytes:
    """The role and TP units of one layer's cache, from its vLLM spec."""
    kind = type(spec)
    if kind is MLAAttentionSpec:
        assert isinstance(spec, MLAAttentionSpec)
        if spec.max_tp_shards not in (None, 1) or spec.tokens_per_state != 1:
            raise ConfigError(
                f"kvconn's vLLM adapter does not support {model}'s MLA cache in {layer} "
                f"(max_tp_shards={spec.max_tp_shards}, tokens_per_state={spec.tokens_per_state})"
            )
        role = "index_k" if spec.cache_role is SparseCacheRole.INDEXER else "latent"
        return LayerBytes(role, 1)
    if kind in (FullAttentionSpec, SlidingWindowSpec):
        assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec))
        if spec.tokens_per_state != 1:
            raise ConfigError(
                f"kvconn's vLLM adapter does not support {model}'s {layer}: "
                f"{spec.tokens_per_state} tokens per stored state"
            )
        return LayerBytes("kv", total_kv_heads)
    raise ConfigError(
        f"kvconn's vLLM adapter does not support {kind.__name__} layers ({model}: {layer}); "
        "it stores full attention, sliding-window attention and MLA caches"
    )


def window_blocks(spec: SlidingWindowSpec, block_size: int) -> int:
    """Blocks of a sliding-window group that a hit needs before its end.

    The first token after an ``N``-block hit attends to the ``sliding_window - 1``
    tokens before it; vLLM also keeps ``extra_retained_tokens`` more. They lie in the
    last ``cdiv(sliding_window - 1 + extra_retained_tokens, block_size)`` blocks, which
    is also what vLLM's ``SlidingWindowManager.get_num_skipped_tokens`` leaves real.
    """
    tokens = int(spec.sliding_window) - 1 + int(spec.extra_retained_tokens)
    return max(1, -(-tokens // block_size))


def dtype_tag(vllm_config: VllmConfig, layer: str, tensor: torch.Tensor) -> str:
    """What an element is and who arranged the block: ``bfloat16+CPU_ATTN``."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    element = str(tensor.dtype).removeprefix("torch.")
    if cache_dtype != "auto":
        element = f"{element}:{cache_dtype}"
    context = vllm_config.compilation_config.static_forward_context
    backend = getattr(context.get(layer), "attn_backend", None)
    name = backend.get_name() if backend is not None else "unknown"
    return f"{element}+{name}"


def _layer_spec(spec: KVCacheSpec, layer: str) -> KVCacheSpec:
    """A layer's own spec: a group of layers with different specs keeps one per layer."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs.get(layer, spec)
    return spec
