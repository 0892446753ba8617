"""Agreed striped loads (kvconn.rounds): two rank processes over gloo and a real LMDB store.

What must hold when one rank skips loads the other makes, as SGLang's prefetch I/O
thread does: no rank waits for a load that does not come longer than the patience, every
byte that reaches a slot is verified, and loads both ranks make are still read once per
group.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.rounds import LoadRounds
from kvconn.tools.models import get_preset
from tests.helpers import StripedRank, run_over_store

WORLD = 2
A = block_hashes(list(range(32 * 4)), 32)
B = block_hashes(list(range(1000, 1000 + 32 * 4)), 32)
C = block_hashes(list(range(2000, 2000 + 32 * 4)), 32)
SLOTS_A = [0, 1, 2, 3]  # saved from, then zeroed and loaded into again
SLOTS_B = [4, 5, 6, 7]
SLOTS_C = [8, 9, 10, 11]
PATIENCE_S = 0.2


class _Rank(StripedRank):
    """One rank: a connector over the group with rounds, A, B and C saved."""

    def __init__(self, rank: int, path: str, rendezvous: str) -> None:
        super().__init__(rank, path, rendezvous, A + B + C, verify_replicas_every=0)
        self.rounds = LoadRounds(self.conn, patience_s=PATIENCE_S)

    def reads(self) -> int:
        count = self.conn.stats.snapshot()["total"].get("store_read", {"pages": 0})
        return int(count["pages"])

    def close(self) -> dict[str, Any]:  # type: ignore[override]
        ended = self.rounds.close(timeout_s=10)
        super().close()
        return {"ended": ended, "striped": self.rounds.striped, "back": self.rounds.handed_back}


def _run(target: Any, tmp_path: Any) -> list[dict[str, Any]]:
    return run_over_store(target, WORLD, tmp_path)


def _in_step(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        before = r.reads()
        a = r.rounds.load(A, SLOTS_A)
        b = r.rounds.load(B, SLOTS_B)
        payload = {
            "loaded": (a.loaded, b.loaded),
            "verified": r.verified(A + B, SLOTS_A + SLOTS_B),
            "reads": r.reads() - before,
            "pages": 8 * len(r.conn.shares),
        }
        results.put((rank, payload | r.close()))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_loads_every_rank_makes_are_read_once_per_group(tmp_path):
    out = _run(_in_step, tmp_path)
    for p in out:
        assert p["loaded"] == (4, 4) and p["verified"]
        assert p["striped"] == 2 and p["back"] == 0 and p["ended"]
    # every page is replicated on both ranks: the group reads each once, not twice
    assert sum(p["reads"] for p in out) == out[0]["pages"]


def _one_rank_skips(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        started = time.monotonic()
        a = r.rounds.load(A, SLOTS_A) if rank == 0 else None  # rank 1 skips A
        b = r.rounds.load(B, SLOTS_B)
        waited = time.monotonic() - started
        r.barrier()
        before = r.reads()
        c = r.rounds.load(C, SLOTS_C)
        payload = {
            "a": a.loaded if a is not None else None,
            "b": b.loaded,
            "c": c.loaded,
            "verified": r.verified(B + C, SLOTS_B + SLOTS_C)
            and (rank == 1 or r.verified(A, SLOTS_A)),
            "waited_s": waited,
            "c_reads": r.reads() - before,
            "pages": 4 * len(r.conn.shares),
        }
        results.put((rank, payload | r.close()))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_load_another_rank_skipped_is_read_per_rank_and_the_ranks_get_back_in_step(tmp_path):
    zero, one = _run(_one_rank_skips, tmp_path)
    # rank 0 is not left waiting for rank 1's A: it reads A itself, every byte checked
    assert zero["a"] == 4 and zero["b"] == 4 and one["b"] == 4
    assert zero["back"] >= 1
    # the skip costs about one patience, not one per later load (each rank gave up on the
    # other's head at most once; a head the other already read alone goes at once)
    assert zero["waited_s"] < 2 * PATIENCE_S + 5.0
    for p in (zero, one):
        assert p["c"] == 4 and p["verified"] and p["ended"]
        assert p["striped"] >= 1  # C, which both make in step, is striped again
    assert zero["c_reads"] + one["c_reads"] == zero["pages"]


def _given_up_while_striped(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        striped = r.conn._striped
        assert striped is not None
        if rank == 1:  # rank 1 is slow to join: rank 0's caller gives up meanwhile
            chunk = striped.chunk

            def slow_chunk(*args: Any, **kwargs: Any) -> Any:
                time.sleep(1.5)
                return chunk(*args, **kwargs)

            striped.chunk = slow_chunk  # type: ignore[method-assign]
        started = time.monotonic()
        a = r.rounds.load(A, SLOTS_A, timeout_s=0.3 if rank == 0 else None)
        waited = time.monotonic() - started
        deadline = time.monotonic() + 30
        while r.rounds.striped < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the given-up load runs to its end with rank 1
        untouched = all(not bool(pool.any()) for pool in r.pools)
        r.barrier()
        if rank == 1:
            striped.chunk = chunk  # type: ignore[method-assign]
        b = r.rounds.load(B, SLOTS_B)
        payload = {
            "a": (a.loaded, a.failed),
            "waited_s": waited,
            "untouched": untouched,
            "a_verified": r.verified(A, SLOTS_A),
            "b": b.loaded,
            "b_verified": r.verified(B, SLOTS_B),
        }
        results.put((rank, payload | r.close()))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_striped_load_given_up_after_its_timeout_writes_nothing_more(tmp_path):
    zero, one = _run(_given_up_while_striped, tmp_path)
    # rank 0 stops waiting at its timeout, with nothing scattered: every block failed
    assert zero["a"] == (0, (0, 1, 2, 3)) and zero["waited_s"] < 1.4
    # the load still ran with rank 1, who was making it; rank 0's slots got no byte of it
    assert zero["untouched"]
    assert one["a"] == (4, ()) and one["a_verified"]
    for p in (zero, one):
        assert p["b"] == 4 and p["b_verified"] and p["striped"] == 2 and p["ended"]


def _close_while_other_idles(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, path, rendezvous)
        if rank == 0:
            ended = r.rounds.close(timeout_s=10)
        else:  # rank 1 never closes: rank 0's close ends its rounds too
            r.rounds._thread.join(10)
            ended = not r.rounds._thread.is_alive()
        after = r.rounds.load(A, SLOTS_A)  # rounds over: read per rank, nothing waits
        payload = {
            "ended": ended,
            "after": after.loaded,
            "verified": r.verified(A, SLOTS_A),
        }
        results.put((rank, payload | {"striped": r.rounds.striped}))
        r.conn.close()
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_one_rank_closing_ends_every_ranks_rounds(tmp_path):
    for p in _run(_close_while_other_idles, tmp_path):
        assert p["ended"] and p["after"] == 4 and p["verified"] and p["striped"] == 0


def test_rounds_need_a_group_and_no_replica_checks(tmp_path):
    layout = get_preset("deepseek-v3.2").layout(1, 2, 16, 32)
    pools = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]

    def connector(every: int) -> Connector:
        settings = {"model": "m", "backend": "lmdb", "options": {"path": str(tmp_path)}}
        config = ConnectorConfig.from_dict(settings | {"verify_replicas_every": every})
        return Connector(config, layout, rank=0, pools=pools)

    conn = connector(0)
    with conn, pytest.raises(ValueError, match="group"):
        LoadRounds(conn)
    with connector(1000) as conn:
        conn.group = object()  # type: ignore[assignment]  # the check comes before any use
        with pytest.raises(ValueError, match="verify_replicas_every = 0"):
            LoadRounds(conn)
