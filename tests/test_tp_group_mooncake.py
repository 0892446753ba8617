"""The TP-group rules on a real Mooncake Store: agreement, verified loads, faults, eviction.

Each test starts its own cluster (master + standalone storage processes on loopback) and
runs 8 ranks as processes through ``run_tp_group``; every loaded byte is checked
against recomputation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.testing.suite import require_or_skip
from kvconn.testing.tpgroup import (
    assert_group_consistent,
    overlapping_requests,
    run_tp_group,
)
from kvconn.tools.devserver.mooncake import MooncakeCluster
from kvconn.tools.models import minimax_m3

pytestmark = [pytest.mark.server, pytest.mark.slow]

MiB = 2**20


@pytest.fixture(autouse=True)
def loopback_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank processes inherit this: their transfer engines stay on loopback."""
    require_or_skip(MooncakeCluster.available())
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)


def _config(cluster: MooncakeCluster, **options: Any) -> dict[str, Any]:
    return {
        "model": "mm3",
        "backend": "mooncake",
        "options": {**cluster.options, "read_env": False, "setup_retries": 1, **options},
    }


def _full_blocks(requests: list[list[int]], tokens_per_block: int, num_slots: int) -> list[int]:
    return [min(len(tokens) // tokens_per_block, num_slots) for tokens in requests]


@pytest.fixture
def cluster() -> Iterator[MooncakeCluster]:
    with MooncakeCluster(storage_processes=1, segment_size=128 * MiB) as running:
        yield running


def test_eight_ranks_on_mooncake_agree_and_load_exactly_what_was_saved(
    cluster: MooncakeCluster,
) -> None:
    reports = run_tp_group(
        functools.partial(minimax_m3, tp_size=8, layers=2, num_slots=16),
        _config(cluster),
        overlapping_requests(6, 32),
    )
    assert_group_consistent(reports)
    assert sum(reports[0].hits) > 0
    assert all(r.stats["total"].get("dropped", {"pages": 0})["pages"] == 0 for r in reports)


def test_under_eviction_no_rank_loads_a_partial_block_and_all_agree_on_hits() -> None:
    # 16 MiB of storage (Mooncake's smallest segment) against ~35 MiB of pages: most
    # blocks are evicted again, and a writer that outruns eviction gets -200: a drop.
    with MooncakeCluster(storage_processes=1, segment_size=16 * MiB) as small:
        reports = run_tp_group(
            functools.partial(minimax_m3, tp_size=8, layers=4, num_slots=16),
            _config(small),
            overlapping_requests(30, 32, seed=3),
        )
        metrics = small.metrics()
    assert_group_consistent(reports, exact_loads=False)
    # what the writers offered, stored or refused for space: the load really was larger
    # than memory (checksummed values are a few % less dense in the segment, so fewer of
    # the offered pages are written than the bare pages were)
    offered = sum(
        r.stats["total"].get(event, {"bytes": 0})["bytes"]
        for r in reports
        for event in ("written", "dropped")
    )
    assert offered > 2 * 16 * MiB, offered
    assert metrics["master_evicted_key_count"] > 0


def test_a_master_killed_mid_run_gives_misses_drops_and_failed_loads_then_recovers(
    cluster: MooncakeCluster,
) -> None:
    layout = minimax_m3(tp_size=1, layers=2, num_slots=16)
    config = ConnectorConfig.from_dict({**_config(cluster), "retry_interval_s": 0})
    pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
    conn = Connector(config, layout, rank=0, pools=[pool])
    try:
        hashes = block_hashes(list(range(32 * 4)), 32)
        assert conn.save(hashes, [0, 1, 2, 3]).written > 0
        assert conn.lookup(hashes).blocks == 4
        before = pool.clone()
        cluster.kill_master()
        started = time.monotonic()
        hit = conn.lookup(hashes)
        saved = conn.save(hashes, [0, 1, 2, 3])
        loaded = conn.load(hashes, [4, 5, 6, 7])
        elapsed = time.monotonic() - started
        assert (hit.blocks, hit.available) == (0, False)
        assert saved.written == 0 and saved.dropped > 0
        assert loaded.loaded == 0 and loaded.failed == (0, 1, 2, 3)
        assert torch.equal(pool, before)  # failed loads leave the slots untouched
        assert conn.stats.backend_errors >= 3
        assert elapsed < 6.0  # at most one ~4.4 s call; the rest fail at the probe
        cluster.restart_master()  # same ports, every object gone
        again = conn.lookup(hashes)
        assert again.available and again.blocks == 0
        assert conn.save(hashes, [0, 1, 2, 3]).written > 0
        assert conn.lookup(hashes).blocks == 4
        result = conn.load(hashes, [4, 5, 6, 7])
        assert result.ok and result.loaded == 4
    finally:
        conn.close()


def test_with_two_replicas_every_block_still_loads_after_a_storage_process_is_killed() -> None:
    layout_factory = functools.partial(minimax_m3, tp_size=8, layers=2, num_slots=16)
    requests = overlapping_requests(6, 32, seed=5)
    # client_ttl=60: the master keeps listing the dead segment while the second group
    # runs, so every load of a page with a copy there must find the live copy itself.
    with MooncakeCluster(storage_processes=2, segment_size=64 * MiB, client_ttl=60) as pair:
        config = _config(pair, replica_num=2)
        first = run_tp_group(layout_factory, config, requests)
        assert_group_consistent(first)
        pair.kill_storage(0)
        assert len(pair.segments()) == 2
        second = run_tp_group(layout_factory, config, requests)
    assert_group_consistent(second)
    # Everything the first run saved is still there: each request hits in full.
    assert second[0].hits == _full_blocks(requests, 32, 16)
    assert sum(r.mismatched_regions for r in second) == 0
    assert all(r.verified_blocks > 0 for r in second)
