"""Pages cut at ``shard_heads`` and striped loads: a TP=2 group over gloo loads what a
TP=1 rank wrote, over a real LMDB store.

Striped loads plan readers per page a rank holds; with ``shard_heads = 8`` a TP=2 rank
holds four K/V head shards per block (each read by that rank alone) and the replicated
index-K page (read once for the pair and passed over the group).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.layout import KvLayout
from kvconn.testing.tpgroup import gloo_group
from kvconn.tools.models import get_preset
from kvconn.tools.simulate.synth import Synth
from tests.helpers import run_over_store

pytestmark = pytest.mark.slow

HASHES = block_hashes(list(range(32 * 5)), 32)
G = 8


def _layout(tp: int) -> KvLayout:
    return get_preset("minimax-m3").layout(tp, 2, 8, 32)  # 8 KV heads, index-K replicated


def _config(path: str) -> ConnectorConfig:
    return ConnectorConfig.from_dict(
        {
            "model": "m",
            "backend": "lmdb",
            "options": {"path": path},
            "shard_heads": G,
            "stripe_reads": True,
        }
    )


def _region_rows(pool: torch.Tensor, region: Any, slots: list[int]) -> torch.Tensor:
    rows = pool.as_strided((region.num_slots, region.size), (region.stride, 1), region.base)
    return rows[torch.tensor(slots)]


def _compute(layout: KvLayout, rank: int, pool: torch.Tensor, slots: list[int]) -> None:
    synth = Synth(layout, rank, "m", G)
    for region in layout.groups[0].regions:
        rows = pool.as_strided((region.num_slots, region.size), (region.stride, 1), region.base)
        rows[torch.tensor(slots)] = synth.region_bytes(HASHES, region)


def _holds(layout: KvLayout, rank: int, pool: torch.Tensor, slots: list[int]) -> bool:
    synth = Synth(layout, rank, "m", G)
    return all(
        torch.equal(_region_rows(pool, region, slots), synth.region_bytes(HASHES, region))
        for region in layout.groups[0].regions
    )


def _reader(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        import torch.distributed as dist

        group = gloo_group(rank, 2, rendezvous)
        layout = _layout(2)
        pool = torch.zeros(layout.pool_sizes[0], dtype=torch.uint8)
        conn = Connector(_config(path), layout, rank=rank, pools=[pool], group=group)
        hit = conn.lookup(HASHES).blocks
        slots = [7, 2, 5, 0, 3]
        result = conn.load(HASHES, slots)
        stats = conn.stats
        payload = {
            "hit": hit,
            "loaded": result.loaded,
            "holds": _holds(layout, rank, pool, slots),
            "read": stats.pages("store_read"),
            "received": stats.pages("group_received"),
            "read_by_class": conn.stats.snapshot()["by_class"].get("store_read", {}),
        }
        conn.close()
        dist.destroy_process_group()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_tp2_group_stripes_its_load_of_head_shards_a_tp1_rank_wrote(tmp_path):
    store = str(tmp_path / "store")
    os.makedirs(store)
    layout = _layout(1)
    pool = torch.zeros(layout.pool_sizes[0], dtype=torch.uint8)
    _compute(layout, 0, pool, [0, 1, 2, 3, 4])
    with Connector(_config(store), layout, rank=0, pools=[pool]) as writer:
        assert writer.save(HASHES, [0, 1, 2, 3, 4]).written == 5 * (G + 1)  # pages
    out = run_over_store(_reader, 2, tmp_path)
    blocks = len(HASHES)
    assert [(p["hit"], p["loaded"], p["holds"]) for p in out] == [(blocks, blocks, True)] * 2
    # each rank reads its own four head shards; the index-K page leaves the store once
    # for the pair and reaches the other rank over the group
    assert [p["read_by_class"]["w8"]["pages"] for p in out] == [4 * blocks] * 2
    assert sum(p["read_by_class"]["replicated"]["pages"] for p in out) == blocks
    assert sum(p["received"] for p in out) == blocks


def _checker(rank: int, path: str, rendezvous: str, diverged: bool, results: Any) -> None:
    """Rank ``rank`` of a TP=2 group saves with replica checks on; with ``diverged``,
    rank 1 computes other index-K bytes than rank 0."""
    try:
        import torch.distributed as dist

        group = gloo_group(rank, 2, rendezvous)
        layout = _layout(2)
        pool = torch.zeros(layout.pool_sizes[0], dtype=torch.uint8)
        odd = frozenset({"index_k"}) if diverged and rank == 1 else frozenset()
        synth = Synth(layout, rank, "m", G, odd)
        slots = [0, 1, 2, 3, 4]
        for region in layout.groups[0].regions:
            rows = pool.as_strided((region.num_slots, region.size), (region.stride, 1), region.base)
            rows[torch.tensor(slots)] = synth.region_bytes(HASHES, region)
        config = replace(_config(path), stripe_reads=False, verify_replicas_every=1)
        conn = Connector(config, layout, rank=rank, pools=[pool], group=group)
        conn.save(HASHES, slots)
        payload = {
            "per_rank": conn.stats.per_rank,
            "verified": conn.stats.replicas_verified,
            "mismatch": conn.stats.replica_mismatch,
        }
        conn.close()
        dist.destroy_process_group()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.parametrize("diverged", [False, True])
def test_replica_checks_compare_the_replicated_page_behind_head_shards(tmp_path, diverged):
    """With ``shard_heads`` a rank holds several K/V pages per block before its index-K
    page: the check must still compare the index-K bytes, not a head shard's."""
    out = run_over_store(_checker, 2, tmp_path, diverged)
    blocks = len(HASHES)
    if diverged:
        assert [p["per_rank"] for p in out] == [("lg0/replicated",)] * 2
        assert [p["mismatch"] for p in out] == [blocks] * 2
    else:
        assert [p["per_rank"] for p in out] == [()] * 2
        assert [(p["verified"], p["mismatch"]) for p in out] == [(blocks, 0)] * 2
