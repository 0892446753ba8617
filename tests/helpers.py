"""Building TP groups of connectors over one store, with pools whose bytes are known."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.layout import KvLayout, shard_position
from kvconn.plan import WriterPolicy
from kvconn.testing.ranks import run_ranks
from kvconn.testing.tpgroup import compute_block, gloo_group, verify_block
from kvconn.tools.models import get_preset


class KvconnRecords(logging.Handler):
    """The kvconn log records of this process (a rank's), warnings and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        logging.getLogger("kvconn").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


def native_threads() -> set[int]:
    """This process's threads as the kernel lists them: a native client's too, which
    ``threading.enumerate`` does not see."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


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


def run_over_store(
    target: Any, world: int, tmp_path: Any, *extra: Any, timeout_s: float = 180
) -> list[dict[str, Any]]:
    """``target(rank, store, rendezvous, *extra, results)`` in ``world`` processes; the
    payloads by rank, after checking that no rank reported an error."""
    store = str(tmp_path / "store")
    os.makedirs(store, exist_ok=True)
    args = (store, str(tmp_path / "rendezvous"), *extra)
    out = run_ranks(target, world, args, timeout_s=timeout_s)
    for payload in out:
        assert "error" not in payload, payload["error"]
    return out


class StripedRank:
    """One of two rank processes over gloo: DeepSeek-V3.2's pages at TP=2 (every byte
    replicated on both ranks), a connector over the group with ``stripe_reads``, and
    ``blocks`` saved from slots 0, 1, ... and then zeroed in the pools."""

    WORLD = 2

    def __init__(
        self, rank: int, path: str, rendezvous: str, blocks: list[bytes], **config: Any
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.group = gloo_group(rank, self.WORLD, rendezvous)
        self.coord = dist.new_group([0, 1])  # the test's own barrier: never kvconn's group
        self.layout = get_preset("deepseek-v3.2").layout(self.WORLD, 2, 16, 32)
        self.pools = [torch.zeros(n, dtype=torch.uint8) for n in self.layout.pool_sizes]
        settings = {"model": "m", "backend": "lmdb", "options": {"path": path}}
        settings |= {"retry_interval_s": 0, "stripe_reads": True} | config
        self.conn = Connector(
            ConnectorConfig.from_dict(settings),
            self.layout,
            rank=rank,
            pools=self.pools,
            group=self.group,
        )
        for slot, h in enumerate(blocks):
            compute_block(self.layout, rank, self.pools, h, slot)
        assert self.conn.save(blocks, list(range(len(blocks)))).ok
        self.barrier()
        self.clear()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.coord)

    def clear(self) -> None:
        for pool in self.pools:
            pool.zero_()

    def untouched(self) -> bool:
        return all(not bool(pool.any()) for pool in self.pools)

    def verified(self, hashes: list[bytes], slots: list[int]) -> bool:
        return all(
            verify_block(self.layout, self.rank, self.pools, h, s) == 0
            for h, s in zip(hashes, slots)
        )

    def close(self) -> None:
        import torch.distributed as dist

        self.conn.close()
        dist.destroy_process_group()
