"""TensorRT-LLM's primary KV pool described as a kvconn layout.

The pool is ``[num_blocks, num_layers, kv_factor, tokens_per_block * heads * head_dim]``:
a block id is a kvconn slot, and all of one block's bytes are contiguous, so its page is
declared in memory order (layer by layer, K then V) and moves as one run. ``kv_factor``
2 holds K and V of this rank's heads; 1 holds one latent per token (MLA), identical on
every rank and therefore stored once for the group.

The pool's dtype is tagged ``:trtllm`` in every key: the order of heads and tokens
inside a block is the engine's own, so pages written by another engine with the same
sizes must miss here rather than be read in the wrong order.
"""

from __future__ import annotations

import torch

from kvconn.errors import LayoutError
from kvconn.layout import KvLayout, LayerGroup, Region, Role


def describe_pool(
    pool: torch.Tensor, *, tp_size: int, tokens_per_block: int, kv_heads: int | None
) -> KvLayout:
    """The layout of one rank's primary pool; ``kv_heads`` as in TrtllmSettings."""
    if pool.dim() != 4:
        raise LayoutError(
            "TensorRT-LLM's KV pool must be [blocks, layers, kv_factor, tokens*heads*dim], "
            f"got shape {tuple(pool.shape)}"
        )
    blocks, layers, kv_factor, width = pool.shape
    if width % tokens_per_block != 0:
        raise LayoutError(
            f"a block row of {width} elements is not a multiple of tokens_per_block="
            f"{tokens_per_block}"
        )
    if not pool.is_contiguous():
        raise LayoutError("TensorRT-LLM's KV pool tensor must be contiguous")
    dtype = f"{str(pool.dtype).removeprefix('torch.')}:trtllm"
    roles: tuple[Role, ...]
    if kv_factor == 2:
        units = kv_heads if kv_heads is not None else tp_size
        roles = (Role("k", units, dtype), Role("v", units, dtype))
    elif kv_factor == 1:
        roles = (Role("latent", 1, dtype),)
    else:
        raise LayoutError(f"kv_factor must be 1 (MLA) or 2 (K and V), got {kv_factor}")
    regions = [
        Region.from_tensor(role.name, layer, pool[:, layer, c], pool)
        for layer in range(layers)
        for c, role in enumerate(roles)
    ]
    return KvLayout(
        tp_size=tp_size,
        tokens_per_block=tokens_per_block,
        roles=roles,
        groups=(LayerGroup(0, blocks, tuple(regions), name="trtllm primary pool"),),
        pool_sizes=(pool.numel() * pool.element_size(),),
    )
