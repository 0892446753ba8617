"""Building TP groups of connectors over one store, with pools whose bytes are known."""

from __future__ import annotations

import hashlib

import torch

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.layout import KvLayout, shard_position
from kvconn.plan import WriterPolicy


def fill_pool(layout: KvLayout, rank: int, pools: list[torch.Tensor], salt: int = 0) -> None:
    """Every (region, slot) gets bytes from its layer, role, shard and slot: replicas agree.

    One generator per region fills all its slots at once (one row each), drawing 8 bytes
    per number, through a strided view of the pool: a call per slot, or a byte per
    number, cost seconds per test at TP=8.
    """
    for group in layout.groups:
        for region in group.regions:
            shard = shard_position(rank, layout.tp_size, layout.role(region.role).units).shard_index
            name = f"{salt}/{group.index}/{region.layer}/{region.role}/{shard}".encode()
            flat = pools[region.pool]
            slots = flat.as_strided(
                (region.num_slots, region.size),
                (region.stride, 1),
                flat.storage_offset() + region.base,
            )
            slots.copy_(random_bytes(name, region.num_slots * region.size).view(slots.shape))


def random_bytes(name: bytes, count: int) -> torch.Tensor:
    """``count`` bytes that depend only on ``name``."""
    seed = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-count // 8),), dtype=torch.int64, generator=g)
    return words.view(torch.uint8)[:count]


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
