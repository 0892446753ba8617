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
  A compressed one (``tokens_per_state`` > 1, a whole number of states per block:
  Qwen4Exp's QSA keys, GLM-5.3's indexer, DeepSeek-V4.1's compressed KV) is a role of
  its own per ratio (``latent_per4``, :func:`mla_bytes`).
* ``SlidingWindowMLASpec`` (dots.llm3's sliding layers): an MLA latent with a window,
  as below. With DeepSeek-V4.1's bounded replay vLLM does not prefix-cache the group,
  and kvconn leaves it alone.
* ``FullAttentionSpec``: K/V by head, ``units`` the model's total KV head count.
* ``SlidingWindowSpec``: the same bytes, plus a window: the tokens a later token still
  attends to. vLLM frees blocks that fall out of it (``SlidingWindowManager``), and a
  hit of ``N`` blocks needs only the group's last ``cdiv(sliding_window - 1 +
  extra_retained_tokens, block_size)`` of them, exactly the blocks vLLM keeps real (the
  rest are its null block) when it allocates such a hit.
* ``ChunkedLocalAttentionSpec`` (Llama 4's local layers): the same bytes, attending only
  within chunks of ``attention_chunk_size`` tokens. A hit of ``N`` blocks needs the
  group's blocks of the chunk it ends in, ``[N - N % (chunk / block_size), N)``, none where
  ``N`` ends a chunk: what vLLM's ``ChunkedLocalAttentionManager`` keeps real (the rest
  are its null block). The chunk must be a whole number of blocks.
* ``MambaSpec`` (Mamba, Gated DeltaNet and other linear-attention layers) in vLLM's
  ``mamba_cache_mode="align"``: a block's page holds the recurrent state after that
  block's last token (vLLM hands the connector each state as its raw bytes,
  ``[blocks, 1, 1, state bytes]``). A hit of ``N`` blocks needs the state of block
  ``N - 1`` only: window 1. The state is split over TP ranks (``units`` the TP size)
  unless vLLM declares it ``tp_replicated`` (``units`` 1). Which block holds a
  state is not positional in that mode: vLLM names each committed state's block in
  ``boundary_state_offloads`` (the connector saves exactly those). Other cache modes
  keep no per-block state to store, and are refused.
* A speculative-decoding draft model's layers (an EAGLE or MTP head, or a draft model
  of its own, :func:`draft_layers`): the same specs, their roles ``draft_<role>`` and
  their units counted in the draft model's heads.
* Any other spec (sink or R-SWA attention, cross attention, hidden-state caches…) is
  refused, as are groups of another block size than the others (DeepSeek-V4, Inkling):
  their blocks are not plain per-token KV with the rules above.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from kvconn.errors import ConfigError
from kvconn.layout import Chunked, Window
from kvconn_vllm.layout import CacheGroup, LayerBytes, layer_index

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "cache_groups",
    "chunk_window",
    "dtype_tag",
    "group_window",
    "mamba_bytes",
    "mla_bytes",
    "window_blocks",
]


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
    tp = parallel.tensor_parallel_size
    # Every group's state, prefix-cacheable or not: a state kvconn did not store would
    # make a hit of the attention pages alone restore a request without it.
    cacheable = set(kv_cache_config.prefix_cacheable_group_ids)
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            spec = _layer_spec(group.kv_cache_spec, name)
            if isinstance(spec, MambaSpec):
                mamba_bytes(spec, name, model, tp)
                if vllm_config.speculative_config is not None:
                    # also where vLLM keeps no speculative state blocks (its replayed
                    # SSM, use_replayssm): which block then holds a hit's state with
                    # the EAGLE block drop is not what kvconn's rules say
                    raise ConfigError(_speculative_state(model, name, "its states replayed"))
                if not vllm_config.cache_config.enable_prefix_caching or index not in cacheable:
                    raise ConfigError(
                        f"kvconn's vLLM adapter stores {model}'s Mamba/linear-attention "
                        f"state ({name}) only with vLLM's prefix caching on: vLLM names "
                        "the blocks holding a state to a connector only then"
                    )
    hash_block_size = kv_cache_config.hash_block_size or block_size
    total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    drafts, draft_heads, draft_weights = draft_layers(vllm_config, kv_cache_config)
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
        specs = [_layer_spec(group.kv_cache_spec, name) for name in group.layer_names]

        def described(name: str, spec: KVCacheSpec) -> LayerBytes:
            """A layer's bytes, a draft layer's in the draft model's heads."""
            if name not in drafts:
                return layer_bytes(spec, name, total_kv_heads, model, tp)
            what = layer_bytes(spec, name, draft_heads, model, tp)
            return dataclasses.replace(what, draft=True, weights=draft_weights)

        layers = tuple(
            (name, described(name, spec)) for name, spec in zip(group.layer_names, specs)
        )
        states = [isinstance(spec, MambaSpec) for spec in specs]
        if any(states):
            if not all(states):  # a window of 1 would be wrong for the attention layers
                raise ConfigError(
                    f"kvconn's vLLM adapter cannot store {model}'s KV cache group {index}: "
                    "it mixes Mamba state and attention layers in one block table"
                )
            groups.append(CacheGroup(index, layers, window=1, kind="mamba"))
            continue
        groups.append(CacheGroup(index, layers, group_window(specs, block_size, model, index)))
    if not groups:
        raise ConfigError(f"kvconn's vLLM adapter found no KV cache it can store in {model}")
    return tuple(groups)


def group_window(specs: list[KVCacheSpec], block_size: int, model: str, index: int) -> Window:
    """The window of a group's layers, read off each layer's own spec (a group whose
    layers differ in page size is a ``UniformTypeKVCacheSpecs`` wrapping theirs, which
    says no window itself); every layer must need the same one."""
    windows: set[Window] = set()
    for spec in specs:
        if isinstance(spec, SlidingWindowSpec):  # SlidingWindowMLASpec too
            windows.add(window_blocks(spec, block_size))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            windows.add(chunk_window(spec, block_size, model))
        else:
            windows.add(None)
    if len(windows) != 1:
        raise ConfigError(
            f"kvconn's vLLM adapter cannot store {model}'s KV cache group {index}: its "
            f"layers need different windows ({sorted(map(str, windows))}) in one block table"
        )
    return windows.pop()


def draft_layers(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[frozenset[str], int, str | None]:
    """The layers of a speculative-decoding draft model, its total KV heads and its
    weights (``<name>@<revision>`` with its quantization, as :attr:`EngineModel.tag`).

    vLLM gives a draft model its own attention layers beside the target's, in the same
    KV-cache groups when their specs match: EAGLE and MTP heads continue the target's
    numbering (``model.layers.<target layers + i>``), a separate draft model
    (``method="draft_model"``) keeps its own under ``draft_model.``. Their bytes are a
    function of the prefix like the target's (an EAGLE head's of the target's hidden
    states), so kvconn stores them beside the target's pages; their head count and
    geometry are the draft's, hence roles of their own.
    """
    from kvconn.engine_settings import EngineModel

    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    if draft is None:
        return frozenset(), 0, None
    target_layers = vllm_config.model_config.get_total_num_hidden_layers()
    names = [name for group in kv_cache_config.kv_cache_groups for name in group.layer_names]
    found = frozenset(
        name
        for name in names
        if name.startswith("draft_model.") or layer_index(name, -1) >= target_layers
    )
    weights = EngineModel.of(draft.model, draft.revision, draft.quantization).tag
    return found, draft.get_total_num_kv_heads(), weights


def layer_bytes(
    spec: KVCacheSpec, layer: str, total_kv_heads: int, model: str, tp_size: int
) -> LayerBytes:
    """The role and TP units of one layer's cache, from its vLLM spec."""
    kind = type(spec)
    if isinstance(spec, MambaSpec):
        return mamba_bytes(spec, layer, model, tp_size)
    if kind in (MLAAttentionSpec, SlidingWindowMLASpec):
        assert isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))
        return mla_bytes(spec, layer, model, tp_size)
    if kind in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec):
        assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))
        if spec.tokens_per_state != 1:
            raise ConfigError(
                f"kvconn's vLLM adapter does not support {model}'s {layer}: "
                f"{spec.tokens_per_state} tokens per stored state"
            )
        return LayerBytes("kv", total_kv_heads)
    raise ConfigError(
        f"kvconn's vLLM adapter does not support {kind.__name__} layers ({model}: {layer}); "
        "it stores full, sliding-window and chunked local attention, MLA caches (also "
        "sliding-window and compressed ones) and Mamba states"
    )


def mla_bytes(
    spec: MLAAttentionSpec | SlidingWindowMLASpec, layer: str, model: str, tp_size: int
) -> LayerBytes:
    """An MLA-format cache: a latent (or DeepSeek-V3.2's indexer keys) per token, or per
    ``tokens_per_state`` tokens where the cache holds compressed states (Qwen4Exp's
    QSA keys, GLM-5.3's indexer, DeepSeek-V4.1's compressed KV).

    A compressed cache's block holds ``block_size / tokens_per_state`` states, each a
    function of the prefix up to its last token like any KV entry; vLLM aligns hits to
    ``tokens_per_state`` (the tokens of a group not yet compressed live in a ring buffer
    it does not prefix-cache, empty at such a boundary), so a whole block is a page as
    for any other cache. Its role names the ratio (``latent_per4``): the same bytes
    compressed otherwise are other bytes. ``max_tp_shards=1`` is a cache every rank
    holds whole, stored once; an uncompressed MLA cache vLLM leaves unmarked
    (``None``) is too, as before (MiniMax-M3's index keys, checked); a compressed one
    left unmarked is keyed per rank, vLLM's own reading of ``None``.
    """
    role = "index_k" if getattr(spec, "cache_role", None) is SparseCacheRole.INDEXER else "latent"
    tps = spec.tokens_per_state
    if not isinstance(tps, int) or tps < 1 or spec.block_size % tps:
        raise ConfigError(
            f"kvconn's vLLM adapter does not support {model}'s MLA cache in {layer}: "
            f"{tps} tokens per stored state in {spec.block_size}-token blocks (it needs a "
            "whole number of states per block)"
        )
    if spec.max_tp_shards not in (None, 1):
        raise ConfigError(
            f"kvconn's vLLM adapter does not support {model}'s MLA cache in {layer} "
            f"(max_tp_shards={spec.max_tp_shards})"
        )
    if tps == 1:
        return LayerBytes(role, 1)
    return LayerBytes(f"{role}_per{tps}", 1 if spec.max_tp_shards == 1 else tp_size)


def mamba_bytes(spec: MambaSpec, layer: str, model: str, tp_size: int) -> LayerBytes:
    """A Mamba layer's state page: role ``mamba``, named by what the bytes are.

    vLLM hands the state as raw bytes, so the role's dtype cannot come from the tensor:
    it names each state's element type and shape (the conv state's shape also says its
    layout, ``(kernel - 1, dim)`` or ``(dim, kernel - 1)``) and the kernel family that
    wrote it.
    """
    if spec.mamba_cache_mode != "align":
        raise ConfigError(
            f"kvconn's vLLM adapter stores {model}'s Mamba/linear-attention state "
            f"({layer}) only with mamba_cache_mode='align', where vLLM keeps a state "
            f"per block and names the blocks that hold one; it is "
            f"{spec.mamba_cache_mode!r}: start vLLM with mamba_cache_mode='align' "
            "(--mamba-cache-mode align) and prefix caching on"
        )
    if spec.num_speculative_blocks:
        why = f"{spec.num_speculative_blocks} speculative state blocks, relocated in place"
        raise ConfigError(_speculative_state(model, layer, why))
    states = "+".join(
        f"{str(dtype).removeprefix('torch.')}[{'x'.join(map(str, shape))}]"
        for shape, dtype in zip(spec.shapes, spec.dtypes)
    )
    units = 1 if spec.tp_replicated else tp_size
    return LayerBytes("mamba", units, tag=f"{states}+{spec.mamba_type.name}")


def _speculative_state(model: str, layer: str, why: str) -> str:
    return (
        f"kvconn's vLLM adapter does not store {model}'s Mamba state ({layer}) with "
        f"speculative decoding ({why}): serve it without speculative decoding (a draft "
        "model, MTP or n-gram proposals)"
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


def chunk_window(spec: ChunkedLocalAttentionSpec, block_size: int, model: str) -> Chunked:
    """The blocks of one attention chunk, which a hit needs from the start of the chunk
    it ends in (``ChunkedLocalAttentionManager.find_longest_cache_hit``)."""
    chunk = int(spec.attention_chunk_size)
    if chunk % block_size:
        raise ConfigError(
            f"kvconn's vLLM adapter needs {model}'s attention chunk ({chunk} tokens) to be "
            f"a whole number of {block_size}-token blocks: choose a block_size that "
            "divides it"
        )
    return Chunked(chunk // block_size)


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
