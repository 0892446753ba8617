"""Pages several ranks hold: sampling, judging, per-rank keys and the markers lookups follow.

The pure rules (kvconn.replicas, kvconn.lookup.PageKeys) need no store; what a lookup or
a connector does with a marker is checked on a real LMDB store. The group-level
behaviour (ranks comparing over gloo) is in test_replica_checks.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvconn.backend import tensor_bytes
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import ConfigError
from kvconn.hashing import block_hashes
from kvconn.layout import KvLayout, LayerGroup, Region, Role
from kvconn.lookup import Lookup, PageKeys
from kvconn.plan import WriterPolicy, plan_pages, writer_replica
from kvconn.registry import load_backend
from kvconn.replicas import (
    ABSENT,
    judge,
    per_rank_plan,
    sampled,
    shared_kinds,
)
from kvconn.tools.models import get_preset
from tests.helpers import fill_pool, slot_bytes

CHAIN = block_hashes(list(range(32 * 20_000)), 32)
HASHES = CHAIN[:4]


# ------------------------------------------------------------------ sampling
def test_about_one_block_in_every_is_sampled_and_every_rank_picks_the_same_ones():
    picked = [h for h in CHAIN if sampled(h, 100)]
    assert 140 <= len(picked) <= 260  # 200 expected; binomial sd 14
    assert picked == [h for h in CHAIN if sampled(bytes(h), 100)]  # a function of the hash
    assert all(sampled(h, 1) for h in HASHES)
    assert not any(sampled(h, 0) for h in CHAIN[:1000])


def test_samples_fall_on_every_writer_not_only_the_one_the_sampling_bits_favour():
    """Sampling reads other bits of the hash than the writer rule: with 1 in 2 sampled
    and pairs of replicas, both replicas' writes are sampled about equally."""
    writers = [writer_replica(h, 2, WriterPolicy.SPREAD) for h in CHAIN if sampled(h, 2)]
    assert 0.45 < sum(writers) / len(writers) < 0.55


# ------------------------------------------------------------------ per-rank keys
def test_a_kind_kept_per_rank_is_keyed_as_a_layout_declaring_its_roles_per_rank_keys_it():
    preset = get_preset("deepseek-v3.2")
    layout = preset.layout(4, 2, 8, 32)
    shared = plan_pages(layout)[0]
    assert shared.shard_class.replicated
    per_rank = per_rank_plan(shared, 4)
    declared = KvLayout(
        tp_size=4,
        tokens_per_block=32,
        roles=tuple(Role(r.name, 4, r.dtype) for r in layout.roles),
        groups=layout.groups,
        pool_sizes=layout.pool_sizes,
    )
    (as_declared,) = plan_pages(declared)
    assert per_rank.fingerprint == as_declared.fingerprint
    assert per_rank.manifest == as_declared.manifest
    assert per_rank.page_size == shared.page_size and per_rank.regions == shared.regions
    assert [per_rank.shard_class.component(r) for r in range(4)] == ["w4r0", "w4r1", "w4r2", "w4r3"]


def test_a_planner_with_a_kind_per_rank_looks_up_every_rank_s_page_and_no_shared_one():
    layout = get_preset("minimax-m3").layout(4, 2, 8, 32)
    keys = PageKeys({"model": "m", "backend": "lmdb"}, layout)
    assert [k.index for k in keys.shared] == [1]  # K/V at 8 heads over 4 ranks: dup 1
    split = keys.with_per_rank([1])
    shared_keys = set(keys.block_keys(HASHES[0]))
    split_keys = split.block_keys(HASHES[0])
    index_k = [k for k in split_keys if k not in shared_keys]
    assert len(index_k) == 4 and len(split_keys) == 4 + 4
    assert not any("/replicated/" in k for k in split_keys)
    for rank in range(4):
        share = split.shares(rank)[1]
        assert (share.dup, share.replica_index, share.shard_index) == (1, 0, rank)
        assert split.rank_keys(rank, HASHES[0])[1] == index_k[rank]
        assert split.shares(rank)[0] == keys.shares(rank)[0]  # K/V untouched
    # the per-rank keys were vetted for the backend's length limit from the start
    assert set(split.key_shapes()) <= set(keys.key_shapes())


def test_only_a_kind_several_ranks_hold_can_be_keyed_per_rank():
    layout = get_preset("minimax-m3").layout(4, 2, 8, 32)
    with pytest.raises(ValueError, match=r"\[0\] are not"):
        PageKeys({"model": "m", "backend": "lmdb"}, layout, per_rank=[0])


# ------------------------------------------------------------------ judging
def _two_group_layout() -> KvLayout:
    """TP=2: K (2 heads) and index-K in two layer groups, so index-K has two kinds."""
    regions = []
    for group in range(2):
        for j, role in enumerate(("k", "index_k", "latent")):
            base = group * 512 + j * 64
            regions.append(Region(role, group, base, 64, 192, 2))
    return KvLayout(
        tp_size=2,
        tokens_per_block=32,
        roles=(Role("k", 2, "bf16"), Role("index_k", 1, "bf16"), Role("latent", 1, "bf16")),
        groups=(LayerGroup(0, 2, tuple(regions[:3])), LayerGroup(1, 2, tuple(regions[3:]))),
        pool_sizes=(1024,),
    )


def test_judging_names_the_role_and_the_ranks_that_differ_from_the_most_common_bytes():
    layout = get_preset("deepseek-v3.2").layout(4, 2, 8, 32)
    kinds = shared_kinds(4, plan_pages(layout))
    assert [r.role for r in kinds[0].roles] == ["latent", "index_k"]
    same = [[11, 22]] * 4
    assert judge(same, kinds, 1).verified == 1 and not judge(same, kinds, 1).disagreements
    odd = [[11, 22], [11, 99], [11, 22], [11, 22]]
    verdict = judge(odd, kinds, 1)
    (d,) = verdict.disagreements
    assert (d.role, d.odd, d.agreeing, verdict.verified, verdict.mismatched) == (
        "index_k",
        (1,),
        (0, 2, 3),
        0,
        1,
    )
    # a rank with nothing to compare is neither blamed nor counted against the others
    absent = [[11, 22], [ABSENT, ABSENT], [11, 22], [11, 22]]
    assert judge(absent, kinds, 1).verified == 1
    # two against two: no bytes are the most common, every holder is named
    split = [[11, 22], [11, 22], [11, 33], [11, 33]]
    (d,) = judge(split, kinds, 1).disagreements
    assert (d.odd, d.agreeing) == ((0, 1, 2, 3), ())
    assert judge(odd, kinds, 1, skip=[kinds[0].index]).disagreements == ()


def test_a_gqa_pair_that_differs_is_judged_alone_and_the_other_pairs_verify():
    layout = get_preset("qwen3-235b-a22b").layout(8, 2, 8, 32)
    kinds = shared_kinds(8, plan_pages(layout))
    assert [(k.dup, k.shards) for k in kinds] == [(2, 4)]
    table = [[10 * (rank // 2), 5] for rank in range(8)]  # k digest per shard, v alike
    table[5][0] = 777
    verdict = judge(table, kinds, 1)
    (d,) = verdict.disagreements
    assert (d.role, d.shard, d.odd, d.agreeing, verdict.verified) == ("k", 2, (4, 5), (), 3)


def test_a_role_that_differs_in_one_layer_group_splits_every_kind_holding_it():
    layout = _two_group_layout()
    plans = plan_pages(layout)
    kinds = shared_kinds(2, plans)
    assert [(plans[k.index].group, [r.role for r in k.roles]) for k in kinds] == [
        (0, ["index_k", "latent"]),
        (1, ["index_k", "latent"]),
    ]
    # block 0: group 0's index-K differs between the two ranks; group 1 agrees
    table = [[1, 2, 3, 4], [9, 2, 3, 4]]
    verdict = judge(table, kinds, 1)
    assert [d.kind.index for d in verdict.disagreements] == [kinds[0].index]
    assert verdict.kinds_to_split(kinds, done=()) == {k.index for k in kinds}
    assert verdict.kinds_to_split(kinds, done=[kinds[1].index]) == {kinds[0].index}


# ------------------------------------------------------------------ markers
def _config(path) -> ConnectorConfig:
    return ConnectorConfig.from_dict(
        {"model": "m", "backend": "lmdb", "options": {"path": str(path)}}
    )


def _ranks(layout, config, backend) -> list[Connector]:
    conns = []
    for rank in range(layout.tp_size):
        pools = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]
        fill_pool(layout, rank, pools)
        conns.append(Connector(config, layout, rank=rank, pools=pools, backend=backend))
    return conns


def test_a_scheduler_lookup_follows_a_marker_to_per_rank_pages_and_misses_till_they_exist(
    tmp_path,
):
    layout = get_preset("minimax-m3").layout(2, 2, 8, 32)
    config = _config(tmp_path)
    backend = load_backend("lmdb", config.options)
    scheduler = Lookup(config, layout, backend=backend)
    before = _ranks(layout, config, backend)
    for conn in before:
        assert conn.save(HASHES, [0, 1, 2, 3]).ok
    assert scheduler.lookup(HASHES).blocks == 4
    # another instance found its ranks' index-K different and marked the kind
    marker = scheduler.keys.markers[1]
    assert backend.put([marker], [memoryview(b"{}")]) == [True]
    assert scheduler.lookup(HASHES).blocks == 0  # the shared pages are no longer asked for
    assert scheduler.keys.per_rank == {1}
    assert before[0].lookup(HASHES).blocks == 4  # built before the marker: shared keys still
    after = _ranks(layout, config, backend)  # built after it: per rank from the start
    assert [c.stats.per_rank for c in after] == [("lg0/replicated",)] * 2
    for conn in after:
        assert conn.save(HASHES, [0, 1, 2, 3]).ok
        assert conn.stats.pages("written") == 4  # its own index-K pages; K/V were stored
    assert scheduler.lookup(HASHES).blocks == 4
    for conn in after:
        want = [slot_bytes(layout, conn.pools, s) for s in range(4)]
        for pool in conn.pools:
            pool.zero_()
        assert conn.load(HASHES, [4, 5, 6, 7]).loaded == 4
        assert [slot_bytes(layout, conn.pools, s) for s in range(4, 8)] == want
    scheduler.close()
    backend.close()


def test_without_a_group_nothing_is_compared_and_the_connector_says_so_once(
    tmp_path, caplog, monkeypatch
):
    import kvconn.replica_check as replica_check

    monkeypatch.setattr(replica_check, "_told_unverified", False)
    layout = get_preset("deepseek-v3.2").layout(2, 2, 8, 32)
    config = _config(tmp_path)
    backend = load_backend("lmdb", config.options)
    with caplog.at_level(logging.INFO, logger="kvconn"):
        conns = _ranks(layout, config, backend)
        for conn in conns:
            assert conn.save(HASHES, [0, 1, 2, 3]).ok
    told = [r for r in caplog.records if "unverified" in r.getMessage()]
    assert len(told) == 1 and "lg0/replicated" in told[0].getMessage()
    assert [c.stats.replicas_verified for c in conns] == [0, 0]
    backend.close()


def test_pages_captured_under_shared_keys_are_not_stored_once_their_kind_keys_per_rank(
    tmp_path,
):
    """A save captured before a check that split its kind must not write the shared
    page afterwards (the transfer service's store thread stores captures later)."""
    layout = get_preset("deepseek-v3.2").layout(2, 2, 8, 32)
    config = _config(tmp_path)
    backend = load_backend("lmdb", config.options)
    conn = _ranks(layout, config, backend)[0]
    hashes, slots = conn.check_transfer(HASHES, [0, 1, 2, 3])
    pages = conn.owned_pages(hashes, slots, "all")
    buffer = torch.empty(conn.capture_bytes(pages), dtype=torch.uint8)
    captured = conn.capture(hashes, slots, pages, buffer, tensor_bytes(buffer))
    conn._use_keys(conn.keys.with_per_rank([0]))  # what a check that found a mismatch does
    (result,) = conn.store_captured([captured])
    assert (result.written, result.dropped) == (0, 4)
    assert backend.exists([p.key for p in pages]) == [False] * 4
    backend.close()


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("bad", [-1, 1.5, True, "1000", 1 << 33])
def test_verify_replicas_every_must_be_a_block_count_from_zero(bad):
    with pytest.raises(ConfigError, match="verify_replicas_every"):
        ConnectorConfig.from_dict({"model": "m", "verify_replicas_every": bad})


def test_verify_replicas_every_is_read_from_the_environment():
    env = {"KVCONN_MODEL": "m", "KVCONN_VERIFY_REPLICAS_EVERY": "0"}
    assert ConnectorConfig.from_env(env).verify_replicas_every == 0
    assert ConnectorConfig.from_dict({"model": "m"}).verify_replicas_every == 1000
