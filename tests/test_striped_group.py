"""Striped loads' group protocol: two rank processes over gloo and a real LMDB store.

What must hold when the ranks do not move in step: a rank loading other blocks, a load
cancelled or without staging on one rank, a service closed with loads queued. In every
case each rank reports the same result, no slot receives a byte of a failed block, and
the group is still usable for the next load.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import pytest
import torch

from kvconn.connector import Connector
from kvconn.errors import ConfigError
from kvconn.hashing import block_hashes
from kvconn.results import LoadResult
from kvconn.testing.ranks import run_ranks
from kvconn.testing.tpgroup import gloo_group
from kvconn.tools.models import get_preset
from kvconn.transfer import TransferService
from tests.helpers import KvconnRecords, StripedRank, run_over_store

pytestmark = pytest.mark.slow

WORLD = 2
A = block_hashes(list(range(32 * 4)), 32)
B = block_hashes(list(range(1000, 1000 + 32 * 4)), 32)
LOAD_SLOTS = [8, 9, 10, 11]


def _layout() -> Any:
    """DeepSeek-V3.2's pages at TP=2: every byte replicated on both ranks."""
    return get_preset("deepseek-v3.2").layout(WORLD, 2, 16, 32)


def _Rank(rank: int, path: str, rendezvous: str) -> StripedRank:
    """One rank: its pools, a connector over the group, blocks A and B saved."""
    return StripedRank(rank, path, rendezvous, A + B)


def _loaded(transfer: Any) -> LoadResult:
    result = transfer.result
    assert isinstance(result, LoadResult)
    return result


def _run(target: Any, tmp_path: Any, *extra: Any) -> list[dict[str, Any]]:
    return run_over_store(target, WORLD, tmp_path, *extra)


# ------------------------------------------------------------------ different blocks
def _different_blocks(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        log = KvconnRecords()
        mine = A if rank == 0 else B
        wrong = r.conn.load(mine, LOAD_SLOTS)
        untouched = r.untouched()
        right = r.conn.load(A, LOAD_SLOTS)
        again = r.conn.load(mine, LOAD_SLOTS)  # out of step once more, within the interval
        payload = {
            "wrong": (wrong.loaded, wrong.failed),
            "untouched": untouched,
            "right": right.loaded,
            "verified": r.verified(A, LOAD_SLOTS),
            "again": again.loaded,
            "mismatches": r.conn.stats.group_mismatches,
            "warnings": [m for m in log.at(logging.WARNING) if "not loading the same" in m],
        }
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_ranks_loading_different_blocks_fail_on_every_rank_and_exchange_nothing(tmp_path):
    out = _run(_different_blocks, tmp_path)
    for payload in out:
        assert payload["wrong"] == (0, (0, 1, 2, 3))
        assert payload["untouched"]  # no byte of another load's pages reached a slot
        # the next load, the same on both ranks, loads in full: the group is in step
        assert payload["right"] == 4 and payload["verified"]
        assert payload["again"] == 0 and payload["mismatches"] == 2
        # one warning an interval, with the count (not one per load, nor once ever)
        assert len(payload["warnings"]) == 1
        assert "(mismatched loads so far: 1)" in payload["warnings"][0]


# ------------------------------------------------------------------ the service
def _service_in_order(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        service = TransferService(r.conn, load_threads=4)
        loads = [
            service.load(A[:2], [8, 9]),
            service.load(B, [10, 11, 12, 13]),
            service.load(A[2:], [14, 15]),
        ]
        done = all(t.wait(60) for t in loads)
        payload = {
            "threads": service._load_threads,
            "done": done,
            "loaded": [_loaded(t).loaded for t in loads],
            "verified": r.verified(A[:2] + B + A[2:], list(range(8, 16))),
            "closed": service.close(timeout_s=10),
        }
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_service_over_a_group_runs_its_loads_on_one_thread_in_order_and_loads_every_byte(
    tmp_path,
):
    for payload in _run(_service_in_order, tmp_path):
        assert payload["threads"] == 1
        assert payload["done"] and payload["loaded"] == [2, 4, 2]
        assert payload["verified"] and payload["closed"]


def _cancelled_on_one_rank(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        service = TransferService(r.conn)
        cancelled = None
        if rank == 1:
            # rank 0 has not submitted it yet, so it cannot have finished here
            first = service.load(A, LOAD_SLOTS)
            cancelled = first.cancel()
        r.barrier()
        if rank == 0:
            first = service.load(A, LOAD_SLOTS)
        assert first.wait(60)
        untouched = r.untouched()
        second = service.load(B, LOAD_SLOTS)
        assert second.wait(60)
        payload = {
            "cancelled": cancelled,
            "first": (_loaded(first).loaded, _loaded(first).failed),
            "untouched": untouched,
            "second": _loaded(second).loaded,
            "verified": r.verified(B, LOAD_SLOTS),
            "closed": service.close(timeout_s=10),
        }
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_load_cancelled_on_one_rank_fails_on_every_rank_and_the_next_load_loads(tmp_path):
    rank0, rank1 = _run(_cancelled_on_one_rank, tmp_path)
    assert rank1["cancelled"] is True
    assert rank0["first"] == rank1["first"] == (0, (0, 1, 2, 3))
    assert rank0["untouched"] and rank1["untouched"]
    assert rank0["second"] == rank1["second"] == 4
    assert rank0["verified"] and rank1["verified"] and rank0["closed"] and rank1["closed"]


def _no_staging_on_one_rank(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        # rank 1's in-flight staging holds one block's load, not four
        room = r.conn.load_bytes(1) if rank == 1 else None
        service = TransferService(r.conn, inflight_bytes=room)
        big = service.load(A, LOAD_SLOTS)
        assert big.wait(60)
        untouched = r.untouched()
        small = service.load(B[:1], LOAD_SLOTS[:1])
        assert small.wait(60)
        payload = {
            "big": (_loaded(big).loaded, _loaded(big).failed),
            "untouched": untouched,
            "small": _loaded(small).loaded,
            "verified": r.verified(B[:1], LOAD_SLOTS[:1]),
            "closed": service.close(timeout_s=10),
        }
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_rank_without_staging_for_a_load_fails_it_on_every_rank_instead_of_stalling_them(
    tmp_path,
):
    for payload in _run(_no_staging_on_one_rank, tmp_path):
        assert payload["big"] == (0, (0, 1, 2, 3))
        assert payload["untouched"]
        assert payload["small"] == 1 and payload["verified"] and payload["closed"]


def _close_with_loads_queued(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        service = TransferService(r.conn)
        loads = [service.load(h, LOAD_SLOTS) for h in (A, B, A, B, A)]
        closed = service.close(timeout_s=30)
        payload = {
            "closed": closed,
            "done": all(t.done() for t in loads),
            "failed_or_loaded": all(_loaded(t).loaded in (0, 4) for t in loads),
        }
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_services_closed_with_loads_queued_end_without_waiting_on_each_other(tmp_path):
    for payload in _run(_close_with_loads_queued, tmp_path):
        assert payload["closed"] and payload["done"] and payload["failed_or_loaded"]


# ------------------------------------------------------------------ configuration
def _swapped_ranks(rank: int, path: str, rendezvous: str, results: Any) -> None:
    group = gloo_group(rank, WORLD, rendezvous)
    layout = _layout()
    pools = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]
    config = {"model": "m", "backend": "lmdb", "options": {"path": path}, "stripe_reads": True}
    try:
        Connector(config, layout, rank=1 - rank, pools=pools, group=group)
        results.put((rank, "built"))
    except ConfigError as exc:
        results.put((rank, str(exc)))


def test_a_group_whose_ranks_are_not_the_tp_ranks_in_order_is_refused_on_every_rank(tmp_path):
    store = str(tmp_path / "store")
    os.makedirs(store)
    out = run_ranks(_swapped_ranks, WORLD, (store, str(tmp_path / "rv")), timeout_s=120)
    assert all("not the TP ranks in order" in message for message in out), out


def _group_of_other_size(rank: int, path: str, rendezvous: str, results: Any) -> None:
    group = gloo_group(rank, WORLD, rendezvous)
    layout = get_preset("deepseek-v3.2").layout(4, 2, 16, 32)
    config = {"model": "m", "backend": "lmdb", "options": {"path": path}, "stripe_reads": True}
    try:
        Connector(config, layout, rank=rank, group=group)
        results.put((rank, "built"))
    except ConfigError as exc:
        results.put((rank, str(exc)))


def test_a_group_of_another_size_than_the_tp_group_is_refused(tmp_path):
    store = str(tmp_path / "store")
    os.makedirs(store)
    out = run_ranks(_group_of_other_size, WORLD, (store, str(tmp_path / "rv")), timeout_s=120)
    assert all("has 2 ranks but the layout's TP size is 4" in message for message in out), out
