"""A kvconn layout from vLLM's per-layer KV cache tensors.

vLLM hands a connector ``{layer name: tensor}``. Two tensor forms occur:

* blocks first, ``[num_blocks, ...]`` (the CPU backend: ``[blocks, heads, block_size,
  2 * head_size]``, each head's K rows then its V rows): one region per layer, role
  ``kv``;
* K/V first, ``[2, num_blocks, ...]`` (FlashAttention-style backends): two regions per
  layer, roles ``k`` and ``v``.

Either way a block's bytes of one layer are contiguous, which is all a page needs. The
role's ``units`` is the model's total KV head count, so heads that vLLM duplicates
across TP ranks (fewer KV heads than ranks) are stored once, and with one KV head the
whole cache is replicated. The arrangement of bytes inside a block differs between
attention backends, so the role's dtype names the element type, the backend and the
block's shape: two backends that lay a block out differently never share pages.

Layers whose tensor is the same memory as an earlier layer's (vLLM's KV sharing) add
no region: their bytes are that layer's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kvconn.errors import LayoutError
from kvconn.layout import KvLayout, LayerGroup, Region, Role

_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(name: str, position: int) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` → 7).

    Names with no number, or several, fall back to the layer's position, which is
    stable for one model.
    """
    numbers = _NUMBER.findall(name)
    return int(numbers[0]) if len(numbers) == 1 else position


def storage_pool(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage ``tensor`` lives in.

    Regions are described relative to it, so a permuted or sliced view vLLM hands out
    still maps to plain byte offsets, and layers that share one allocation share a pool.
    """
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def kv_layout(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_blocks: int,
    block_size: int,
    tp_size: int,
    total_kv_heads: int,
    dtype_tag: str,
) -> tuple[KvLayout, list[torch.Tensor]]:
    """The layout of one rank's KV caches, and the pool tensors it refers to.

    ``dtype_tag`` says what an element is and who arranged the block (e.g.
    ``bfloat16+CPU_ATTN``); the block's shape is appended to it in each role's dtype.
    """
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    pools: list[torch.Tensor] = []
    pool_of: dict[int, int] = {}  # storage address -> pool index
    seen: set[tuple[int, tuple[int, ...]]] = set()
    regions: list[tuple[str, int, torch.Tensor, int]] = []  # role, layer, view, pool
    block_shape: tuple[int, ...] | None = None
    split_kv: bool | None = None
    for position, (name, tensor) in enumerate(kv_caches.items()):
        ident = (tensor.data_ptr(), tuple(tensor.shape))
        if ident in seen:
            continue  # KV sharing: this layer reads another layer's cache
        seen.add(ident)
        blocks_first, kv_first = _forms(tensor, num_blocks)
        if blocks_first == kv_first:
            raise LayoutError(
                f"vLLM layer {name!r}: KV tensor of shape {tuple(tensor.shape)} is "
                f"{'ambiguous' if blocks_first else 'neither'} [num_blocks={num_blocks}, ...] "
                f"{'and' if blocks_first else 'nor'} [2, num_blocks, ...]"
            )
        if split_kv is not None and split_kv != kv_first:
            raise LayoutError(f"vLLM layer {name!r}: KV tensor form differs from other layers")
        split_kv = kv_first
        views = [("k", tensor[0]), ("v", tensor[1])] if kv_first else [("kv", tensor)]
        shape = tuple(views[0][1].shape[1:])
        if block_shape is not None and shape != block_shape:
            raise LayoutError(
                f"vLLM layer {name!r}: block shape {shape} differs from other layers' "
                f"{block_shape}; layers of one group must share a geometry"
            )
        block_shape = shape
        address = tensor.untyped_storage().data_ptr()
        if address not in pool_of:
            pool_of[address] = len(pools)
            pools.append(storage_pool(tensor))
        layer = layer_index(name, position)
        for role, view in views:
            regions.append((role, layer, view, pool_of[address]))
    assert block_shape is not None and split_kv is not None
    shape_tag = "x".join(str(d) for d in block_shape)
    dtype = f"{dtype_tag}+{shape_tag}"
    role_names = ("k", "v") if split_kv else ("kv",)
    layout = KvLayout(
        tp_size=tp_size,
        tokens_per_block=block_size,
        roles=tuple(Role(name, total_kv_heads, dtype) for name in role_names),
        groups=(
            LayerGroup(
                0,
                num_blocks,
                tuple(
                    Region.from_tensor(role, layer, view, pools[pool], pool)
                    for role, layer, view, pool in regions
                ),
                "attention",
            ),
        ),
        pool_sizes=tuple(p.numel() for p in pools),
    )
    return layout, pools


def _forms(tensor: torch.Tensor, num_blocks: int) -> tuple[bool, bool]:
    """Whether ``tensor`` reads as blocks first, and whether as K/V first."""
    shape = tuple(tensor.shape)
    blocks_first = len(shape) >= 2 and shape[0] == num_blocks
    kv_first = len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
    return blocks_first, kv_first
