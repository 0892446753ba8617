"""Building TP groups of connectors over one store, with pools whose bytes are known."""

from __future__ import annotations

import torch

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.layout import KvLayout, shard_position
from kvconn.plan import WriterPolicy


def fill_pool(layout: KvLayout, rank: int, pools: list[torch.Tensor], salt: int = 0) -> None:
    """Every (region, slot) gets bytes from its layer, role, shard and slot: replicas agree."""
    for group in layout.groups:
        for region in group.regions:
            shard = shard_position(rank, layout.tp_size, layout.role(region.role).units).shard_index
            flat = pools[region.pool]
            for slot in range(region.num_slots):
                start = region.base + slot * region.stride
                seed = hash((salt, group.index, region.layer, region.role, shard, slot)) & 0xFFFF
                g = torch.Generator().manual_seed(seed)
                flat[start : start + region.size] = torch.randint(
                    0, 256, (region.size,), dtype=torch.uint8, generator=g
                )


def tp_group(
    layout: KvLayout,
    backend: Backend,
    *,
    policy: str = "spread",
    model: str = "test-model",
    fill: bool = True,
) -> list[Connector]:
    config = ConnectorConfig(
        model=model, backend="dict", writer_policy=WriterPolicy(policy), retry_interval_s=0
    )
    group = []
    for rank in range(layout.tp_size):
        pools = [torch.zeros(size, dtype=torch.uint8) for size in layout.pool_sizes]
        if fill:
            fill_pool(layout, rank, pools)
        group.append(Connector(config, layout, rank=rank, pools=pools, backend=backend))
    return group


def slot_bytes(layout: KvLayout, pools: list[torch.Tensor], slot: int, roles=None) -> bytes:
    """The bytes of one slot, region by region (optionally only some roles)."""
    out = []
    for group in layout.groups:
        for region in group.regions:
            if roles is None or region.role in roles:
                start = region.base + slot * region.stride
                out.append(bytes(pools[region.pool][start : start + region.size].tolist()))
    return b"".join(out)
