"""Layouts of real models, as the engines lay out their KV pools.

Used by ``kvconn simulate``, the tests and the benchmarks, so the figures they report
(bytes stored, savings) come from real geometry rather than toy shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvconn.layout import KvLayout, LayerGroup, Region, Role


@dataclass(frozen=True)
class RoleSpec:
    """A role's bytes per token *on one rank*, and its global unit count."""

    name: str
    bytes_per_token: int
    units: int
    dtype: str


def interleaved_layout(
    roles: Sequence[RoleSpec],
    *,
    tp_size: int,
    layers: int,
    num_slots: int,
    tokens_per_block: int = 32,
) -> KvLayout:
    """One pool; each slot holds, layer after layer, every role's bytes for one block.

    This is the hardest case for page assembly (sharded and replicated bytes interleave
    within a slot) and the layout TensorRT-LLM uses for MiniMax-M3's index-K.
    """
    per_layer = sum(r.bytes_per_token for r in roles) * tokens_per_block
    stride = per_layer * layers
    regions = []
    for layer in range(layers):
        offset = layer * per_layer
        for role in roles:
            size = role.bytes_per_token * tokens_per_block
            regions.append(Region(role.name, layer, offset, size, stride, num_slots))
            offset += size
    return KvLayout(
        tp_size=tp_size,
        tokens_per_block=tokens_per_block,
        roles=tuple(Role(r.name, r.units, r.dtype) for r in roles),
        groups=(LayerGroup(0, num_slots, tuple(regions)),),
        pool_sizes=(stride * num_slots,),
    )


MINIMAX_M3 = (
    RoleSpec("k", 256, 8, "bf16"),
    RoleSpec("v", 256, 8, "bf16"),
    RoleSpec("index_k", 256, 1, "bf16"),
)


def minimax_m3(tp_size: int = 8, layers: int = 4, num_slots: int = 64) -> KvLayout:
    """MiniMax-M3-like: 8 KV heads x 128 bf16 for K and V; a replicated index-K."""
    heads_per_rank = max(1, 8 // tp_size)
    roles = (
        RoleSpec("k", 256 * heads_per_rank, 8, "bf16"),
        RoleSpec("v", 256 * heads_per_rank, 8, "bf16"),
        RoleSpec("index_k", 256, 1, "bf16"),
    )
    return interleaved_layout(roles, tp_size=tp_size, layers=layers, num_slots=num_slots)


def make_pool(layout: KvLayout, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for size in layout.pool_sizes
    ]
