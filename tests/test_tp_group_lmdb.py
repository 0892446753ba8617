"""Eight rank processes over one LMDB store, MiniMax-M3-like interleaved layout."""

import functools

import pytest

from kvconn.testing.tpgroup import assert_group_consistent, overlapping_requests, run_tp_group
from kvconn.tools.models import minimax_m3

pytestmark = pytest.mark.slow


def test_eight_ranks_agree_on_every_hit_and_load_exactly_what_was_saved(tmp_path):
    layout_factory = functools.partial(minimax_m3, tp_size=8, layers=2, num_slots=16)
    requests = overlapping_requests(6, 32)
    config = {"model": "minimax-m3-test", "backend": "lmdb", "options": {"path": str(tmp_path)}}
    reports = run_tp_group(layout_factory, config, requests)
    assert len(reports) == 8
    assert_group_consistent(reports)
    assert sum(reports[0].hits) > 0  # shared prefixes were found again
    assert reports[0].hits[0] == 0
    assert all(r.verified_blocks == sum(r.hits) for r in reports)
    replicated_writes = sum(
        r.stats["by_class"].get("written", {}).get("replicated", {}).get("pages", 0)
        for r in reports
    )
    sharded_writes = [r.stats["by_class"]["written"]["w8"]["pages"] for r in reports]
    assert len(set(sharded_writes)) == 1  # each rank wrote each new block's own shard once
    assert replicated_writes == sharded_writes[0]  # and the replicated page exactly once
