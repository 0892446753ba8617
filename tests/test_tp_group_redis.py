"""The TP-group rules on real Redis servers: agreement, verified loads, faults, eviction."""

import functools
from collections.abc import Iterator

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.testing.suite import require_or_skip
from kvconn.testing.tpgroup import assert_group_consistent, overlapping_requests, run_tp_group
from kvconn.tools.devserver.redis import RedisCluster, RedisServer
from kvconn.tools.models import minimax_m3

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    require_or_skip(RedisServer.available())
    with RedisServer() as server:
        yield server


def test_eight_ranks_on_one_redis_agree_and_load_exactly_what_was_saved(redis_server):
    reports = run_tp_group(
        functools.partial(minimax_m3, tp_size=8, layers=2, num_slots=16),
        {"model": "mm3", "backend": "redis", "options": redis_server.options},
        overlapping_requests(6, 32),
    )
    assert_group_consistent(reports)
    assert sum(reports[0].hits) > 0


def test_eight_ranks_on_a_redis_cluster_agree_and_load_exactly_what_was_saved():
    require_or_skip(RedisCluster.available())
    with RedisCluster(3) as cluster:
        reports = run_tp_group(
            functools.partial(minimax_m3, tp_size=8, layers=2, num_slots=16),
            {"model": "mm3", "backend": "redis", "options": cluster.options},
            overlapping_requests(6, 32),
        )
    assert_group_consistent(reports)
    assert sum(reports[0].hits) > 0


def test_under_eviction_no_rank_loads_a_partial_block_and_all_agree_on_hits():
    require_or_skip(RedisServer.available())
    # ~4 MiB of memory against ~25 MiB of pages: most blocks are evicted again
    with RedisServer(maxmemory="4mb", maxmemory_policy="allkeys-lru") as server:
        reports = run_tp_group(
            functools.partial(minimax_m3, tp_size=8, layers=4, num_slots=16),
            {"model": "mm3", "backend": "redis", "options": server.options},
            overlapping_requests(12, 32, seed=3),
        )
        stats = server.command("INFO", "stats")
    if isinstance(stats, bytes):
        stats = stats.decode()
    assert_group_consistent(reports, exact_loads=False)
    evicted = int(str(stats).split("evicted_keys:")[1].split("\r\n")[0].strip())
    assert evicted > 0  # the load really was larger than memory


def test_a_server_killed_mid_run_gives_misses_and_drops_then_the_same_connector_recovers(
    redis_server,
):
    layout = minimax_m3(tp_size=2, layers=2, num_slots=16)
    config = ConnectorConfig(
        model="mm3",
        backend="redis",
        options={**redis_server.options, "timeout_s": 1.0, "connect_timeout_s": 0.5},
        retry_interval_s=0,
    )
    pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
    conn = Connector(config, layout, rank=0, pools=[pool])
    hashes = block_hashes(list(range(32 * 4)), 32)
    conn.save(hashes, [0, 1, 2, 3])
    redis_server.kill()
    hit = conn.lookup(hashes)
    saved = conn.save(hashes, [0, 1, 2, 3])
    loaded = conn.load(hashes, [4, 5, 6, 7])
    assert (hit.blocks, hit.available) == (0, False)
    assert saved.written == 0 and saved.dropped > 0
    assert loaded.loaded == 0 and loaded.failed == (0, 1, 2, 3)
    assert conn.stats.backend_errors >= 3
    redis_server.restart()  # same port, empty
    assert conn.lookup(hashes).available
    assert conn.save(hashes, [0, 1, 2, 3]).written > 0
    conn.close()
