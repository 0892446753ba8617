"""Replica checks in real TP groups: rank processes over gloo and a real LMDB store.

What must hold (kvconn.replica_check): ranks that hold identical bytes are compared and
say nothing; a rank whose "shared" bytes differ is named, with the role, in one loud
error on every rank; the page kind then keys per rank on every rank, and so does a
scheduler's lookup in another process; every byte a rank loads afterwards is the one it
wrote itself (misses, never another rank's bytes).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.keys import page_key
from kvconn.layout import KvLayout, shard_position
from kvconn.lookup import Lookup, PageKeys
from kvconn.results import LoadResult
from kvconn.testing.tpgroup import expected_bytes, gloo_group
from kvconn.tools.models import get_preset
from kvconn.transfer import TransferService
from tests.fakes import DictBackend
from tests.helpers import KvconnRecords, run_over_store

pytestmark = pytest.mark.slow

SLOTS = 16
A = block_hashes(list(range(32 * 4)), 32)
B = block_hashes(list(range(5000, 5000 + 32 * 4)), 32)


# ------------------------------------------------------------------ bytes
def _region_bytes(
    layout: KvLayout, rank: int, odd: Sequence[tuple[str, int]], h: bytes, region: Any
) -> torch.Tensor:
    """What rank ``rank`` computes for a region: the shard's bytes, except that the roles
    ``odd`` names for this rank come out different (the fault under test)."""
    shard = shard_position(rank, layout.tp_size, layout.role(region.role).units).shard_index
    data = expected_bytes(h, region.layer, region.role, shard, region.size)
    if (region.role, rank) in odd:
        data = torch.bitwise_xor(data, 0x5A)
    return data


def _compute(layout, rank, odd, pools, hashes, slots) -> None:
    for h, slot in zip(hashes, slots):
        for group in layout.groups:
            for region in group.regions:
                start = region.base + slot * region.stride
                pools[region.pool][start : start + region.size] = _region_bytes(
                    layout, rank, odd, h, region
                )


def _wrong(layout, rank, odd, pools, hashes, slots) -> int:
    """Regions whose bytes are not what this rank itself computes (0: all its own)."""
    bad = 0
    for h, slot in zip(hashes, slots):
        for group in layout.groups:
            for region in group.regions:
                start = region.base + slot * region.stride
                got = pools[region.pool][start : start + region.size]
                bad += int(not torch.equal(got, _region_bytes(layout, rank, odd, h, region)))
    return bad


# ------------------------------------------------------------------ one rank
class _Rank:
    def __init__(
        self,
        rank: int,
        layout: KvLayout,
        path: str,
        rendezvous: str,
        odd: Sequence[tuple[str, int]] = (),
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.layout = layout
        self.path = path
        self.odd = tuple(odd)
        self.log = KvconnRecords()
        self.group = gloo_group(rank, layout.tp_size, rendezvous)
        self.coord = dist.new_group(list(range(layout.tp_size)))  # the test's own barrier
        self.pools = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]

    def config(self, **extra: Any) -> ConnectorConfig:
        return ConnectorConfig.from_dict(
            {"model": "m", "backend": "lmdb", "options": {"path": self.path}, **extra}
        )

    def connector(self, **extra: Any) -> Connector:
        return Connector(
            self.config(**extra), self.layout, rank=self.rank, pools=self.pools, group=self.group
        )

    def compute(self, hashes: Sequence[bytes], slots: Sequence[int]) -> None:
        _compute(self.layout, self.rank, self.odd, self.pools, hashes, slots)

    def wrong(self, hashes: Sequence[bytes], slots: Sequence[int]) -> int:
        return _wrong(self.layout, self.rank, self.odd, self.pools, hashes, slots)

    def clear(self, slots: Sequence[int]) -> None:
        for group in self.layout.groups:
            for region in group.regions:
                for slot in slots:
                    start = region.base + slot * region.stride
                    self.pools[region.pool][start : start + region.size] = 0

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.coord)

    def close(self) -> None:
        import torch.distributed as dist

        logging.getLogger("kvconn").removeHandler(self.log)
        dist.destroy_process_group()


def _run(target: Any, world: int, tmp_path: Any) -> list[dict[str, Any]]:
    return run_over_store(target, world, tmp_path, timeout_s=240)


def _loaded(transfer: Any) -> LoadResult:
    assert transfer.wait(60)
    result = transfer.result
    assert isinstance(result, LoadResult)
    return result


def _shared_keys(conn: Connector, hashes: Sequence[bytes], kind: int) -> list[str]:
    """The keys of kind ``kind``'s pages as planned (shared), every shard."""
    plan = conn.keys.planned[kind]
    return [
        page_key(conn.prefix, plan.shard_class.component(j), plan.group, plan.fingerprint, h)
        for h in hashes
        for j in range(plan.shard_class.shard_count)
    ]


# ------------------------------------------------------------------ identical bytes
def _identical(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, get_preset("deepseek-v3.2").layout(2, 2, SLOTS, 32), path, rendezvous)
        conn = r.connector(verify_replicas_every=1)
        r.compute(A + B, range(8))
        first = conn.save(A, [0, 1, 2, 3])  # the start-up check, before the store
        service = TransferService(conn)
        second = service.save(B, [4, 5, 6, 7])  # every block sampled: checked on the load thread
        assert second.wait(60)
        r.barrier()
        r.clear(range(8, 16))
        loaded = _loaded(service.load(A + B, list(range(8, 16))))
        payload = {
            "saved": first.ok and second.result.ok,
            "verified": conn.stats.replicas_verified,
            "mismatch": conn.stats.replica_mismatch,
            "per_rank": conn.stats.per_rank,
            "loaded": loaded.loaded,
            "wrong": r.wrong(A + B, range(8, 16)),
            "errors": r.log.at(logging.ERROR),
            "closed": service.close(timeout_s=10),
        }
        conn.close()
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_identical_replicated_bytes_are_compared_at_the_first_save_and_on_samples_silently(
    tmp_path,
):
    for payload in _run(_identical, 2, tmp_path):
        assert payload["saved"]
        # DeepSeek-V3.2 at TP=2: one shared page per block; 4 at start-up + 4 sampled
        assert payload["verified"] == 8
        assert payload["mismatch"] == 0 and payload["per_rank"] == ()
        assert payload["errors"] == []
        assert payload["loaded"] == 8 and payload["wrong"] == 0
        assert payload["closed"]


def _out_of_step(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, get_preset("deepseek-v3.2").layout(2, 2, SLOTS, 32), path, rendezvous)
        conn = r.connector(verify_replicas_every=1)
        r.compute(A + B, range(8))
        mine = A if rank == 0 else B  # an engine that handed the ranks different saves
        assert conn.save(mine, [0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7]).ok
        astray = (conn.stats.group_mismatches, conn.stats.replicas_verified)
        r.barrier()
        assert conn.save(B, [4, 5, 6, 7]).ok  # the same save on both: compared again
        payload = {
            "astray": astray,
            "after": (conn.stats.group_mismatches, conn.stats.replicas_verified),
            "mismatch": conn.stats.replica_mismatch,
            "per_rank": conn.stats.per_rank,
            "errors": r.log.at(logging.ERROR),
        }
        conn.close()
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_ranks_comparing_different_blocks_decide_nothing_and_the_next_check_compares(tmp_path):
    for payload in _run(_out_of_step, 2, tmp_path):
        assert payload["astray"] == (1, 0)
        assert payload["mismatch"] == 0 and payload["per_rank"] == ()
        assert len(payload["errors"]) == 1 and "not comparing the same" in payload["errors"][0]
        # B, compared by rank 1 in the slip, is compared again on both: checks depend on
        # the save alone, so the group is back in step
        assert payload["after"] == (1, 4)


# ------------------------------------------------------------------ one rank differs
def _index_k_differs(rank: int, path: str, rendezvous: str, results: Any) -> None:
    """MiniMax-M3 at TP=4: rank 1 computes an index-K the other three do not."""
    try:
        layout = get_preset("minimax-m3").layout(4, 2, SLOTS, 32)
        r = _Rank(rank, layout, path, rendezvous, odd=[("index_k", 1)])
        r.compute(A, [0, 1, 2, 3])
        # Unverified (as without a group): the shared index-K pages are some writer's bytes
        old = r.connector(verify_replicas_every=0)
        assert old.save(A, [0, 1, 2, 3]).ok
        r.barrier()
        r.clear(range(8, 12))
        unverified = old.load(A, [8, 9, 10, 11]).loaded
        wrong_unverified = r.wrong(A, [8, 9, 10, 11])
        old.close()
        r.barrier()

        conn = r.connector()  # verify_replicas_every = 1000: the first save is compared
        shared = _shared_keys(conn, A, 1)  # lg0/replicated: the index-K pages
        assert conn.save(A, [0, 1, 2, 3]).ok  # checked first, so stored per rank already
        r.barrier()
        shared_left = conn.backend.exists(shared)
        scheduler = Lookup(r.config(), layout)  # another process's lookup: follows markers
        hit = scheduler.lookup(A).blocks
        r.clear(range(8, 12))
        loaded = conn.load(A, [8, 9, 10, 11]).loaded
        wrong = r.wrong(A, [8, 9, 10, 11])
        r.barrier()
        restarted = r.connector()  # a later run keys the kind per rank from the start
        payload = {
            "unverified": unverified,
            "wrong_unverified": wrong_unverified,
            "errors": r.log.at(logging.ERROR),
            "mismatch": conn.stats.replica_mismatch,
            "per_rank": conn.stats.per_rank,
            "share": (conn.shares[1].dup, conn.shares[1].plan.shard_class.component(rank)),
            "written": conn.stats.snapshot()["by_role"]["written"]["index_k"]["pages"],
            "shared_left": shared_left,
            "marker": conn.backend.exists([conn.keys.markers[1]]) == [True],
            "hit": hit,
            "loaded": loaded,
            "wrong": wrong,
            "restarted": restarted.stats.per_rank,
            "restarted_hit": restarted.lookup(A).blocks,
        }
        scheduler.close()
        restarted.close()
        conn.close()
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_a_rank_whose_index_k_differs_is_named_and_every_rank_then_keys_index_k_per_rank(
    tmp_path,
):
    out = _run(_index_k_differs, 4, tmp_path)
    # the hazard: unverified, ranks loaded another rank's index-K without noticing
    assert all(p["unverified"] == 4 for p in out)
    assert sum(p["wrong_unverified"] for p in out) > 0
    for rank, p in enumerate(out):
        assert len(p["errors"]) == 1, p["errors"]
        error = p["errors"][0]
        assert "role 'index_k' of page kind lg0/replicated" in error
        assert "ranks [1] hold other bytes than ranks [0, 2, 3]" in error
        assert p["mismatch"] == 4  # the first save's four blocks, one shared page each
        assert p["per_rank"] == ("lg0/replicated",)
        assert p["share"] == (1, f"w4r{rank}")
        assert p["written"] == 4  # every rank wrote its own index-K page of every block
        assert p["shared_left"] == [False] * 4  # the stale shared copies were deleted
        assert p["marker"]
        # the scheduler finds the per-rank pages, and every byte loaded is the rank's own
        assert p["hit"] == 4 and p["loaded"] == 4 and p["wrong"] == 0
        assert p["restarted"] == ("lg0/replicated",) and p["restarted_hit"] == 4


# ------------------------------------------------------------------ GQA pairs
def _pair_differs(rank: int, path: str, rendezvous: str, results: Any) -> None:
    """Qwen3-235B at TP=8 (4 KV heads, each on a pair of ranks): rank 5's K differs from
    rank 4's, its pair; the other pairs agree. Saves and loads go through the service."""
    try:
        layout = get_preset("qwen3-235b-a22b").layout(8, 2, SLOTS, 32)
        r = _Rank(rank, layout, path, rendezvous, odd=[("k", 5)])
        r.compute(A, [0, 1, 2, 3])
        conn = r.connector()
        scheduler = Lookup(r.config(), layout)
        service = TransferService(conn)
        first = service.save(A, [0, 1, 2, 3])
        # after the check in the same queue: keys per rank, pages not stored yet -> a miss
        r.clear(range(8, 12))
        early = _loaded(service.load(A, [8, 9, 10, 11]))
        untouched = all(not bool(p.any()) for p in _slots_of(r, range(8, 12)))
        assert first.wait(60)
        r.barrier()
        hit_before = scheduler.lookup(A).blocks
        again = service.save(A, [0, 1, 2, 3])
        assert again.wait(60)
        r.barrier()
        hit_after = scheduler.lookup(A).blocks
        loaded = _loaded(service.load(A, [8, 9, 10, 11]))
        payload = {
            "errors": r.log.at(logging.ERROR),
            "per_rank": conn.stats.per_rank,
            "verified": conn.stats.replicas_verified,
            "mismatch": conn.stats.replica_mismatch,
            "early": early.loaded,
            "untouched": untouched,
            "hit_before": hit_before,
            "hit_after": hit_after,
            "loaded": loaded.loaded,
            "wrong": r.wrong(A, [8, 9, 10, 11]),
            "closed": service.close(timeout_s=10),
        }
        scheduler.close()
        conn.close()
        r.close()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def _slots_of(r: _Rank, slots: Sequence[int]) -> list[torch.Tensor]:
    out = []
    for group in r.layout.groups:
        for region in group.regions:
            for slot in slots:
                start = region.base + slot * region.stride
                out.append(r.pools[region.pool][start : start + region.size])
    return out


def test_a_gqa_pair_that_differs_is_named_and_its_kind_keys_per_rank_on_every_rank(tmp_path):
    out = _run(_pair_differs, 8, tmp_path)
    for p in out:
        assert len(p["errors"]) == 1, p["errors"]
        error = p["errors"][0]
        assert "role 'k' of page kind lg0/w4, shard 2" in error
        assert "ranks [4, 5] hold other bytes than each other" in error
        assert "role 'v'" not in error and "shard 0" not in error
        # 4 blocks x 4 shards compared: 3 pairs agreed on each block, pair (4, 5) did not
        assert p["verified"] == 12 and p["mismatch"] == 4
        assert p["per_rank"] == ("lg0/w4",)
        # a load after the check asks for per-rank pages not stored yet: a miss, no byte
        assert p["early"] == 0 and p["untouched"]
        # the first save was captured under shared keys: the scheduler misses until a
        # save stores the per-rank pages, then finds them; every rank loads its own bytes
        assert p["hit_before"] == 0
        assert p["hit_after"] == 4 and p["loaded"] == 4 and p["wrong"] == 0
        assert p["closed"]


# ------------------------------------------------------------------ configuration
def _different_rates(rank: int, path: str, rendezvous: str, results: Any) -> None:
    try:
        r = _Rank(rank, get_preset("deepseek-v3.2").layout(2, 2, SLOTS, 32), path, rendezvous)
        try:
            r.connector(verify_replicas_every=1000 if rank == 0 else 10)
            message = "built"
        except Exception as exc:
            message = str(exc)
        r.close()
        results.put((rank, {"message": message}))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_ranks_that_sample_replica_checks_differently_are_refused_on_every_rank(tmp_path):
    for payload in _run(_different_rates, 2, tmp_path):
        assert "different verify_replicas_every (10 to 1000)" in payload["message"]


def test_the_shared_keys_helper_names_the_planned_index_k_pages():
    """The tests above read shared keys through ``_shared_keys``: they must be the keys a
    lookup of the planned layout checks, or the deletion assertion proves nothing."""
    layout = get_preset("minimax-m3").layout(4, 2, SLOTS, 32)
    conn = Connector({"model": "m", "backend": "dict"}, layout, backend=DictBackend())
    planned = {k for h in A for k in PageKeys(conn.config, layout).block_keys(h)}
    shared = _shared_keys(conn, A, 1)
    assert len(shared) == 4 and set(shared) <= planned
    assert all("/replicated/" in k for k in shared)
