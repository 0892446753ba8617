"""Striped loads in a real TP group: eight rank processes over gloo, one real store.

Every loaded byte is checked against recomputation (``run_tp_group``); the stores are
real (LMDB in a directory, a redis-server on a free loopback port).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from kvconn.hashing import block_hashes
from kvconn.lookup import PageKeys
from kvconn.stripe import pages_read
from kvconn.testing.suite import require_or_skip
from kvconn.testing.tpgroup import (
    DamagePage,
    RankReport,
    assert_group_consistent,
    overlapping_requests,
    run_tp_group,
)
from kvconn.tools.devserver.redis import RedisServer
from kvconn.tools.models import get_preset

pytestmark = pytest.mark.slow

SLOTS = 16
REQUESTS = overlapping_requests(6, 32)


def layout_of(model: str, tp: int = 8) -> functools.partial[Any]:
    return functools.partial(get_preset(model).layout, tp, 2, SLOTS, 32)


def lmdb(path: Any) -> dict[str, Any]:
    return {"model": "striped-test", "backend": "lmdb", "options": {"path": str(path)}}


def counted(report: RankReport, event: str, table: str = "total") -> Any:
    stats = report.stats[table].get(event, {})
    return stats.get("pages", 0) if table == "total" else stats


def expected_reads(model: str, reports: list[RankReport], requests: list[list[int]]) -> list[int]:
    """Pages each rank reads from the store when every hit loads: its own shard pages,
    and of each shared page only those the spread rule makes it the reader of."""
    keys = PageKeys({"model": "striped-test", "backend": "lmdb"}, layout_of(model)())
    out = []
    for rank in range(len(reports)):
        shares = keys.shares(rank)
        out.append(
            sum(
                pages_read(shares, block_hashes(tokens, 32)[:SLOTS][:hit])
                for tokens, hit in zip(requests, reports[0].hits)
            )
        )
    return out


@pytest.mark.parametrize("model", ["minimax-m3", "qwen3-235b-a22b", "deepseek-v3.2"])
def test_striped_loads_read_each_shared_page_once_per_group_and_every_byte_verifies(
    model, tmp_path
):
    reports = run_tp_group(layout_of(model), lmdb(tmp_path), REQUESTS, stripe=True)
    assert_group_consistent(reports)
    loaded_blocks = sum(reports[0].loaded)
    assert loaded_blocks > 0
    assert all(r.verified_blocks == loaded_blocks for r in reports)
    reads = [counted(r, "store_read") for r in reports]
    assert reads == expected_reads(model, reports, REQUESTS)
    keys = PageKeys({"model": "m", "backend": "lmdb"}, layout_of(model)())
    unique_pages_per_block = sum(p.shard_class.shard_count for p in keys.plans)
    # the whole group read each page of each loaded block exactly once
    assert sum(reads) == unique_pages_per_block * loaded_blocks
    # every page a rank loaded came from the store or from the group, never both
    for r in reports:
        assert counted(r, "store_read") + counted(r, "group_received") == counted(r, "loaded")
    sent = sum(counted(r, "group_sent") for r in reports)
    assert sent == sum(counted(r, "group_received") for r in reports) > 0


def test_without_a_group_every_rank_reads_every_page_it_loads(tmp_path):
    reports = run_tp_group(layout_of("deepseek-v3.2"), lmdb(tmp_path), REQUESTS)
    assert_group_consistent(reports)
    for r in reports:
        assert counted(r, "store_read") == counted(r, "loaded") == sum(r.loaded) > 0
        assert counted(r, "group_received") == counted(r, "group_sent") == 0


def _same_result_everywhere(reports: list[RankReport], request: int, loaded: int) -> None:
    hit = reports[0].hits[request]
    assert all(r.loaded[request] == loaded for r in reports), [r.loaded for r in reports]
    assert all(r.failed[request] == tuple(range(loaded, hit)) for r in reports)


@pytest.mark.parametrize("component", ["replicated", "w8r3"])
def test_a_page_evicted_after_lookup_fails_its_block_and_every_later_one_on_every_rank(
    component, tmp_path
):
    """An evicted page read by one rank (its reader, or the one rank holding a shard)
    fails the block on all eight, with identical results: none of them loads past it."""
    requests = [REQUESTS[0], REQUESTS[0], REQUESTS[0]]
    fault = DamagePage(request=1, block=1, component=component)
    reports = run_tp_group(
        layout_of("minimax-m3"), lmdb(tmp_path), requests, stripe=True, between=fault
    )
    assert_group_consistent(reports, exact_loads=False)
    assert reports[0].hits[1] > 2
    _same_result_everywhere(reports, 1, 1)
    # an evicted page is a miss, not a bad page; the rewrite makes the next one whole
    assert sum(counted(r, "corrupt") for r in reports) == 0
    _same_result_everywhere(reports, 2, reports[0].hits[2])


def test_a_corrupted_replicated_page_fails_on_every_rank_and_its_one_reader_repairs_it(
    tmp_path,
):
    requests = [REQUESTS[0], REQUESTS[0], REQUESTS[0]]
    fault = DamagePage(request=1, block=2, component="replicated", corrupt=True)
    reports = run_tp_group(
        layout_of("deepseek-v3.2"), lmdb(tmp_path), requests, stripe=True, between=fault
    )
    assert_group_consistent(reports, exact_loads=False)
    _same_result_everywhere(reports, 1, 2)
    corrupt = [counted(r, "corrupt") for r in reports]
    assert sorted(corrupt) == [0] * 7 + [1]  # only the page's reader saw its bytes
    assert [counted(r, "repaired") for r in reports] == corrupt
    # deleted, so the next save rewrote it: the third request loads every block
    _same_result_everywhere(reports, 2, reports[0].hits[2])
    assert all(r.mismatched_regions == 0 for r in reports)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    require_or_skip(RedisServer.available())
    with RedisServer() as server:
        yield server


@pytest.mark.server
def test_striped_loads_on_redis_read_shared_pages_once_and_load_exactly_what_was_saved(
    redis_server,
):
    config = {"model": "striped-test", "backend": "redis", "options": redis_server.options}
    reports = run_tp_group(layout_of("minimax-m3"), config, REQUESTS, stripe=True)
    assert_group_consistent(reports)
    assert [counted(r, "store_read") for r in reports] == expected_reads(
        "minimax-m3", reports, REQUESTS
    )
