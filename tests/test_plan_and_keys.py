import pytest

from kvconn.errors import ConfigError
from kvconn.hashing import block_hashes
from kvconn.keys import key_prefix, shard_component
from kvconn.layout import Chunked, KvLayout, LayerGroup, Region, Role
from kvconn.plan import (
    WriterPolicy,
    count_prefix_hit,
    lookup_keys,
    lookup_windows,
    plan_pages,
    rank_shares,
    restorable_prefixes,
    share_key,
    writer_replica,
    writes,
)
from kvconn.tools.models import RoleSpec, interleaved_layout, minimax_m3

H = block_hashes(list(range(32 * 4)), 32)
PREFIX = key_prefix("kvconn", "Org/Model-FP8@r1")


def keys_of_rank(layout, rank):
    plans = plan_pages(layout)
    return [share_key(PREFIX, s, H[0]) for s in rank_shares(layout, plans, rank)]


def test_the_replicated_page_is_named_without_a_rank():
    layout = minimax_m3(tp_size=8)
    replicated = {k for r in range(8) for k in keys_of_rank(layout, r) if "/replicated/" in k}
    assert len(replicated) == 1  # every rank names the same page
    assert not any(
        "r" in part and part.startswith("w") for part in next(iter(replicated)).split("/")
    )


def test_with_one_kv_head_per_rank_sharded_keys_are_the_per_rank_form():
    layout = minimax_m3(tp_size=8)
    for rank in range(8):
        assert f"/w8r{rank}/" in keys_of_rank(layout, rank)[0]


def test_at_tp1_kv_pages_are_w1r0_never_replicated():
    keys = keys_of_rank(minimax_m3(tp_size=1), 0)
    assert "/w1r0/" in keys[0] and "/replicated/" in keys[1]


def qwen_like(tp=8):
    return interleaved_layout(
        (RoleSpec("k", 256, 4, "bf16"), RoleSpec("v", 256, 4, "bf16")),
        tp_size=tp,
        layers=2,
        num_slots=8,
    )


def test_gqa_with_4_kv_heads_at_tp8_keys_pages_w4r0_to_w4r3_and_halves_bytes():
    layout = qwen_like()
    plans = plan_pages(layout)
    components = sorted(
        {
            share_key(PREFIX, s, H[0]).split("/")[2]
            for r in range(8)
            for s in rank_shares(layout, plans, r)
        }
    )
    assert components == ["w4r0", "w4r1", "w4r2", "w4r3"]
    stored = sum(p.page_size * p.shard_class.shard_count for p in plans)
    per_rank_keying = 8 * sum(p.page_size for p in plans)
    assert stored * 2 == per_rank_keying
    # consecutive ranks hold the same head, as the engine duplicates it
    assert keys_of_rank(layout, 2) == keys_of_rank(layout, 3) != keys_of_rank(layout, 4)


def test_sharded_and_replicated_bytes_form_separate_pages_even_when_interleaved():
    plans = plan_pages(minimax_m3(tp_size=8, layers=3))
    assert [p.shard_class.label for p in plans] == ["w8", "replicated"]
    assert [sorted(dict(p.role_bytes)) for p in plans] == [["k", "v"], ["index_k"]]
    assert [r.layer for r in plans[0].regions] == [0, 0, 1, 1, 2, 2]  # declared order


def test_lookup_covers_every_shard_and_every_replicated_page_of_every_group():
    roles = (Role("k", 8, "bf16"), Role("index_k", 1, "bf16"))
    groups = (
        LayerGroup(0, 4, (Region("k", 0, 0, 64, 128, 4), Region("index_k", 0, 64, 64, 128, 4))),
        LayerGroup(1, 2, (Region("k", 1, 512, 64, 64, 2),)),
    )
    layout = KvLayout(8, 32, roles, groups, (1024,))
    per_block = lookup_keys(PREFIX, plan_pages(layout), H[:2])
    assert len(per_block) == 2 and all(len(keys) == 8 + 1 + 8 for keys in per_block)
    assert sum("/lg1/" in k for k in per_block[0]) == 8


def test_the_hit_is_the_longest_prefix_of_blocks_with_every_page():
    assert count_prefix_hit([[True, True], [True, False], [True, True]]) == 1
    assert count_prefix_hit([[True], [True]]) == 2
    assert count_prefix_hit([[False, True]]) == 0
    assert count_prefix_hit([]) == 0


# One full-attention page and one sliding-window page per block, as in a hybrid model:
# T is stored, F is not. Rows are blocks.
T, F = True, False


def test_windowed_group_needs_only_the_blocks_inside_its_window():
    # the window page of block 0 is gone: a 4-block hit with a 2-block window needs it
    # only for blocks 2 and 3
    present = [[T, F], [T, T], [T, T], [T, T]]
    assert count_prefix_hit(present, [None, 2]) == 4
    assert count_prefix_hit(present) == 0  # without the window every page counts


def test_a_windowed_group_still_needs_every_block_inside_the_window_of_the_hit():
    present = [[T, T], [T, T], [T, T], [T, F]]
    assert count_prefix_hit(present, [None, 2]) == 3  # block 3's window page is missing
    present = [[T, T], [T, T], [T, F], [T, T]]
    # N=4 needs blocks 2-3 and N=3 needs 1-2: both miss block 2; N=2 needs 0-1
    assert count_prefix_hit(present, [None, 2]) == 2


def test_a_full_attention_group_needs_every_block_of_the_hit_whatever_the_windows():
    present = [[T, T], [F, T], [T, T], [T, T]]
    assert count_prefix_hit(present, [None, 2]) == 1


def test_a_windowed_hit_may_reach_past_a_gap_its_window_has_left_behind():
    """Like vLLM's own sliding-window cache hit, the largest N counts, not the first
    gap: with only windowed pages, a missing block 1 fails N=2 and N=3 but not N=4."""
    present = [[T], [F], [T], [T]]
    assert count_prefix_hit(present, [2]) == 4
    assert count_prefix_hit(present[:3], [2]) == 1


def test_a_window_longer_than_the_hit_needs_every_block_from_the_first():
    present = [[T, F], [T, T]]
    assert count_prefix_hit(present, [None, 4]) == 0
    assert count_prefix_hit([[T, T], [T, T]], [None, 4]) == 2


def test_every_restorable_prefix_is_listed_with_the_holes_a_window_leaves():
    """SGLang intersects these lists over its ranks: the largest alone is not enough."""
    present = [[T], [F], [T], [T], [F], [T]]
    assert restorable_prefixes(present, [2]) == [1, 4]
    assert count_prefix_hit(present, [2]) == 4
    assert restorable_prefixes(present, [1]) == [1, 3, 4, 6]


def test_without_windows_every_prefix_up_to_the_hit_is_restorable():
    present = [[T, T], [T, T], [T, F], [T, T]]
    assert restorable_prefixes(present) == [1, 2]
    assert restorable_prefixes([]) == []
    assert restorable_prefixes(present, [None, None]) == [1, 2]


def test_a_full_page_missing_ends_the_restorable_prefixes_whatever_the_window():
    present = [[T, T], [T, F], [F, T], [T, T]]
    assert restorable_prefixes(present, [None, 1]) == [1]


def test_a_chunked_group_needs_only_the_blocks_of_the_chunk_the_hit_ends_in():
    """Chunked local attention of 2-block chunks: a hit of N blocks needs that group's
    blocks [N - N % 2, N), which is none where N ends a chunk (vLLM's
    ChunkedLocalAttentionManager pads the rest with null blocks)."""
    chunked = [None, Chunked(2)]
    present = [[T, F], [T, F], [T, T], [T, F], [T, F]]
    # N=1 needs block 0 (missing), N=2 nothing, N=3 block 2, N=4 nothing, N=5 block 4
    assert restorable_prefixes(present, chunked) == [2, 3, 4]
    assert count_prefix_hit(present, chunked) == 4
    assert count_prefix_hit(present, [None, 2]) == 0  # a sliding window would need 3-4
    assert restorable_prefixes([[F], [F], [F], [T]], [Chunked(3)]) == [3, 4]


def test_a_chunked_window_still_needs_every_full_attention_block():
    present = [[T, T], [F, T], [T, T], [T, T]]
    assert restorable_prefixes(present, [None, Chunked(2)]) == [1]


def test_windows_must_be_positive_and_name_every_page_of_a_block():
    with pytest.raises(ValueError, match="windows must be None, ints >= 1 or Chunked"):
        count_prefix_hit([[T, T]], [None, 0])
    with pytest.raises(ValueError, match="block 0 has 2 pages, windows name 1"):
        count_prefix_hit([[T, T]], [None])


def hybrid_layout(tp=2, window=2):
    """A full-attention group (K/V by head) and a sliding-window group over one pool."""
    roles = (Role("kv", 2, "bf16"),)
    groups = (
        LayerGroup(0, 4, (Region("kv", 1, 0, 64, 64, 4),), "full"),
        LayerGroup(1, 4, (Region("kv", 0, 256, 64, 64, 4),), "sliding", window=window),
    )
    return KvLayout(tp, 32, roles, groups, (512,))


def test_lookup_windows_name_each_lookup_key_in_order():
    plans = plan_pages(hybrid_layout(tp=2))
    keys = lookup_keys(PREFIX, plans, H[:1])[0]
    windows = lookup_windows(plans)
    assert [("/lg1/" in k, w) for k, w in zip(keys, windows)] == [
        (False, None),
        (False, None),
        (True, 2),
        (True, 2),
    ]


def test_the_window_is_not_part_of_any_key():
    """A window changes which pages a hit needs, not what a page holds: engines with
    and without a hybrid allocator share pages."""
    windowed = lookup_keys(PREFIX, plan_pages(hybrid_layout(window=2)), H[:2])
    full = lookup_keys(PREFIX, plan_pages(hybrid_layout(window=None)), H[:2])
    assert windowed == full


@pytest.mark.parametrize(
    "change",
    [
        lambda: minimax_m3(tp_size=8, layers=5),  # another layer count → bytes per page
        lambda: interleaved_layout(
            (
                RoleSpec("k", 256, 8, "fp8"),
                RoleSpec("v", 256, 8, "bf16"),
                RoleSpec("index_k", 256, 1, "bf16"),
            ),
            tp_size=8,
            layers=4,
            num_slots=64,
        ),  # dtype
        lambda: interleaved_layout(
            (
                RoleSpec("v", 256, 8, "bf16"),
                RoleSpec("k", 256, 8, "bf16"),
                RoleSpec("index_k", 256, 1, "bf16"),
            ),
            tp_size=8,
            layers=4,
            num_slots=64,
        ),  # role order
        lambda: interleaved_layout(
            (
                RoleSpec("k", 256, 8, "bf16"),
                RoleSpec("v", 256, 8, "bf16"),
                RoleSpec("index_k", 256, 1, "bf16"),
            ),
            tp_size=8,
            layers=4,
            num_slots=64,
            tokens_per_block=64,
        ),  # tokens per block
    ],
    ids=["layers", "dtype", "role-order", "tokens-per-block"],
)
def test_a_layout_change_changes_the_key_of_every_page_it_touches(change):
    before = keys_of_rank(minimax_m3(tp_size=8, layers=4), 0)
    after = keys_of_rank(change(), 0)
    assert before[0] != after[0]  # the K/V page changed in every case
    # the index-K page changes only when its own bytes do (layers, tokens per block)
    index_k_changed = before[1] != after[1]
    assert index_k_changed == (
        change().groups[0].regions[-1].size != 8192 or len(change().groups[0].regions) != 12
    )


def test_memory_placement_does_not_change_keys():
    a = minimax_m3(tp_size=8, layers=2, num_slots=16)
    b = minimax_m3(tp_size=8, layers=2, num_slots=64)  # bigger pool, other strides
    assert keys_of_rank(a, 3) == keys_of_rank(b, 3)


def test_model_names_with_slashes_stay_one_key_segment():
    key = keys_of_rank(minimax_m3(), 0)[0]
    assert key.startswith("kvconn/Org%2FModel-FP8@r1/w8r0/lg0/t32b")
    assert key.endswith("/" + H[0].hex())
    with pytest.raises(ConfigError):
        key_prefix("kvconn", "")


def test_shard_components():
    assert shard_component(None) == "replicated"
    assert shard_component(4, 3) == "w4r3"
    with pytest.raises(ConfigError):
        shard_component(4, 4)


def test_first_policy_always_picks_replica_zero_and_spread_uses_all():
    hashes = block_hashes(list(range(32 * 800)), 32)
    assert {writer_replica(h, 8, WriterPolicy.FIRST) for h in hashes} == {0}
    counts = [0] * 8
    for h in hashes:
        counts[writer_replica(h, 8, WriterPolicy.SPREAD)] += 1
    assert min(counts) > 0.7 * 100 and max(counts) < 1.3 * 100
    assert writer_replica(hashes[0], 1, WriterPolicy.SPREAD) == 0


def test_an_unknown_writer_policy_names_the_choices():
    with pytest.raises(ConfigError, match="choose one of: spread, first"):
        WriterPolicy.parse("rank0")


def test_under_the_all_policy_every_replica_is_a_writer_of_every_block():
    layout = minimax_m3(tp_size=8)
    plans = plan_pages(layout)
    for rank in range(8):
        for share in rank_shares(layout, plans, rank):
            assert all(writes(share, h, WriterPolicy.ALL) for h in H)
    replicated = [rank_shares(layout, plans, r)[-1] for r in range(8)]
    for h in H:  # under spread, exactly one of the 8 replicas writes
        assert sum(writes(s, h, WriterPolicy.SPREAD) for s in replicated) == 1
