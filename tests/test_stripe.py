"""Which rank reads which page in a striped load: pure planning, no store, no group."""

from __future__ import annotations

import pytest

from kvconn.hashing import block_hashes
from kvconn.lookup import PageKeys
from kvconn.stripe import chunk_digest, pages_read, reader_replica, striped_rows
from kvconn.tools.models import get_preset

HASHES = block_hashes(list(range(32 * 64)), 32)


def keys_for(model: str, tp: int = 8) -> PageKeys:
    layout = get_preset(model).layout(tp, 2, 16, 32)
    return PageKeys({"model": "m", "backend": "lmdb"}, layout)


@pytest.mark.parametrize("model", ["minimax-m3", "qwen3-235b-a22b", "deepseek-v3.2"])
def test_every_replica_of_a_shard_plans_the_same_rows_and_readers(model):
    keys = keys_for(model)
    for s, plan in enumerate(keys.plans):
        by_shard: dict[int, set[tuple[object, ...]]] = {}
        for rank in range(8):
            share = keys.shares(rank)[s]
            rows = striped_rows(share, HASHES)
            seen = tuple((g.replica, g.first_row, g.blocks) for g in rows.segments)
            by_shard.setdefault(share.shard_index, set()).add(seen)
        assert all(len(plans) == 1 for plans in by_shard.values()), plan.label


@pytest.mark.parametrize("model", ["minimax-m3", "qwen3-235b-a22b", "deepseek-v3.2"])
def test_each_page_of_a_block_is_read_by_exactly_one_rank_of_the_group(model):
    keys = keys_for(model)
    reads = [pages_read(keys.shares(rank), HASHES) for rank in range(8)]
    unique_pages = sum(p.shard_class.shard_count for p in keys.plans) * len(HASHES)
    assert sum(reads) == unique_pages


def test_a_page_only_one_rank_holds_is_read_by_that_rank_for_every_block():
    keys = keys_for("minimax-m3")
    sharded = next(s for s in keys.shares(3) if s.dup == 1)
    rows = striped_rows(sharded, HASHES)
    assert rows.mine.blocks == tuple(range(len(HASHES)))
    assert rows.peers() == []


def test_the_reader_of_a_page_is_the_replica_the_spread_rule_makes_its_writer():
    keys = keys_for("qwen3-235b-a22b")  # 4 KV heads at TP=8: pairs of ranks
    for rank in (4, 5):
        share = keys.shares(rank)[0]
        rows = striped_rows(share, HASHES)
        mine = [i for i, h in enumerate(HASHES) if reader_replica(h, 2) == share.replica_index]
        assert list(rows.mine.blocks) == mine
        assert [peer for peer, _ in rows.peers()] == [9 - rank]  # the other rank of the pair


def test_reads_of_a_replicated_page_balance_across_eight_ranks():
    keys = keys_for("deepseek-v3.2")
    hashes = block_hashes(list(range(32 * 4000)), 32)
    reads = [pages_read(keys.shares(rank), hashes) for rank in range(8)]
    assert sum(reads) == len(hashes)
    assert max(reads) / (sum(reads) / 8) < 1.1, reads


def test_a_segment_counts_only_its_rows_inside_the_good_prefix():
    keys = keys_for("deepseek-v3.2")
    rows = striped_rows(keys.shares(0)[0], HASHES[:16])
    for good in range(17):
        assert sum(g.below(good) for g in rows.segments) == good
        for g in rows.segments:
            assert all(b < good for b in g.blocks[: g.below(good)])


def test_the_chunk_digest_names_the_blocks_and_negates_within_a_signed_64_bit_int():
    digests = {chunk_digest(HASHES[i : i + 4]) for i in range(0, 32, 4)}
    assert len(digests) == 8
    assert all(0 <= d < 2**62 for d in digests)
    assert chunk_digest(HASHES[:4]) == chunk_digest(list(HASHES[:4]))
