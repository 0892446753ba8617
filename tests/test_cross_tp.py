"""Pages shared across TP sizes: head-sharded pages cut at ``shard_heads`` (``G``).

A rank at TP ``t`` holds ``G / min(t, heads)`` head shards of each sharded page kind per
block, ``w<G>r<j>``; a rank at another TP size holding the same heads holds the same
pages, byte for byte. Pure planning first (keys, manifests, byte order), then whole TP
groups of connectors over one in-memory store (the core's logic, not a backend proof).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import ConfigError, LayoutError
from kvconn.hashing import block_hashes
from kvconn.keys import parse_key
from kvconn.layout import KvLayout, LayerGroup, Region, Role, UnitLayout, shard_position
from kvconn.lookup import PageKeys
from kvconn.movement import PageMover, flat_bytes
from kvconn.plan import plan_pages, rank_shares

from .fakes import DictBackend
from .helpers import random_bytes

HEADS = 8
TOKENS = 4  # tokens per block
HEAD_BYTES = 16  # bytes per token of one head
LAYERS = 2
SLOTS = 6
HASHES = block_hashes(list(range(TOKENS * 4)), TOKENS)


def layout_at(tp: int, token_major: bool = False, heads: int = HEADS) -> KvLayout:
    """K and V by head, a replicated index-K, interleaved layer by layer in one pool.

    Head-major regions are ``[heads][tokens][head bytes]`` (each head contiguous, as
    vLLM's CPU cache); token-major ones ``[tokens][heads][head bytes]``.
    """
    local = heads // shard_position(0, tp, heads).num_shards
    size = local * TOKENS * HEAD_BYTES
    side = TOKENS * HEAD_BYTES
    per_layer = 2 * size + side
    stride = per_layer * LAYERS
    if token_major:
        units = UnitLayout(local, HEAD_BYTES, outer=TOKENS)
    else:
        units = UnitLayout(local, TOKENS * HEAD_BYTES)
    regions = []
    for layer in range(LAYERS):
        offset = layer * per_layer
        for role in ("k", "v"):
            regions.append(Region(role, layer, offset, size, stride, SLOTS, 0, units))
            offset += size
        regions.append(Region("index_k", layer, offset, side, stride, SLOTS))
    return KvLayout(
        tp,
        TOKENS,
        (Role("k", heads, "bf16"), Role("v", heads, "bf16"), Role("index_k", 1, "bf16")),
        (LayerGroup(0, SLOTS, tuple(regions)),),
        (stride * SLOTS,),
    )


def head_bytes(block: bytes, layer: int, role: str, head: int) -> torch.Tensor:
    """``[tokens, head bytes]``: what "computing" one head of one block gives, at any TP."""
    name = block + f"/{layer}/{role}/{head}".encode()
    return random_bytes(name, TOKENS * HEAD_BYTES).view(TOKENS, HEAD_BYTES)


def region_view(pool: torch.Tensor, region: Region, slot: int) -> torch.Tensor:
    """The region's bytes of one slot as ``[tokens, heads, head bytes]`` (replicated: one
    "head"), whichever way the layout orders tokens and heads."""
    start = region.base + slot * region.stride
    flat = pool[start : start + region.size]
    units = region.unit_layout
    if units is None:
        return flat.view(TOKENS, 1, HEAD_BYTES)
    if units.outer == 1:  # [heads][tokens][bytes]
        return flat.view(units.units, TOKENS, HEAD_BYTES).transpose(0, 1)
    return flat.view(TOKENS, units.units, HEAD_BYTES)


def heads_of(layout: KvLayout, rank: int, role: str) -> list[int]:
    units = layout.role(role).units
    pos = shard_position(rank, layout.tp_size, units)
    local = units // pos.num_shards
    return [pos.shard_index * local + u for u in range(local)]


def compute(layout: KvLayout, rank: int, pool: torch.Tensor, block: bytes, slot: int) -> None:
    for region in layout.groups[0].regions:
        view = region_view(pool, region, slot)
        for u, head in enumerate(heads_of(layout, rank, region.role)):
            view[:, u] = head_bytes(block, region.layer, region.role, head)


def holds(layout: KvLayout, rank: int, pool: torch.Tensor, block: bytes, slot: int) -> bool:
    """Whether the slot holds exactly what computing ``block`` on this rank gives."""
    return all(
        torch.equal(
            region_view(pool, region, slot)[:, u],
            head_bytes(block, region.layer, region.role, head),
        )
        for region in layout.groups[0].regions
        for u, head in enumerate(heads_of(layout, rank, region.role))
    )


def config(**extra: object) -> ConnectorConfig:
    return ConnectorConfig.from_dict(
        {"model": "m", "backend": "dict", "retry_interval_s": 0, **extra}
    )


def pages(backend: DictBackend) -> list[str]:
    """The page keys in the store (layout manifests left out)."""
    return [k for k in backend.data if parse_key(k) is not None]


def group_at(tp: int, backend: DictBackend, shard_heads: int | None, token_major: bool = False):
    layout = layout_at(tp, token_major)
    return layout, [
        Connector(
            config(shard_heads=shard_heads),
            layout,
            rank=rank,
            pools=[torch.zeros(layout.pool_sizes[0], dtype=torch.uint8)],
            backend=backend,
        )
        for rank in range(tp)
    ]


# ------------------------------------------------------------------ keys and planning
def test_with_shard_heads_every_tp_size_looks_up_the_same_keys_each_head_shard_once():
    at8 = PageKeys(config(shard_heads=8), layout_at(8))
    at4 = PageKeys(config(shard_heads=8), layout_at(4))
    at2 = PageKeys(config(shard_heads=8), layout_at(2))
    keys = at8.block_keys(HASHES[0])
    assert at4.block_keys(HASHES[0]) == at2.block_keys(HASHES[0]) == keys
    shards = [k.split("/")[2] for k in keys]
    assert shards == [f"w8r{j}" for j in range(8)] + ["replicated"]


def test_a_rank_holds_the_head_shards_of_its_heads_and_the_replicated_page():
    at4 = PageKeys(config(shard_heads=8), layout_at(4))
    at8 = PageKeys(config(shard_heads=8), layout_at(8))
    at1 = PageKeys(config(shard_heads=8), layout_at(1))
    h = HASHES[0]
    # TP=4 rank 1 holds heads 2 and 3: the pages TP=8 ranks 2 and 3 hold
    assert at4.rank_keys(1, h) == [
        at8.rank_keys(2, h)[0],
        at8.rank_keys(3, h)[0],
        *at8.rank_keys(3, h)[1:],
    ]
    assert [k.split("/")[2] for k in at1.rank_keys(0, h)] == [
        *(f"w8r{j}" for j in range(8)),
        "replicated",
    ]
    shares = at4.shares(1)
    assert [(s.shard_index, s.part, s.rank_shard, s.dup) for s in shares] == [
        (2, 0, 1, 1),
        (3, 1, 1, 1),
        (0, 0, 0, 4),
    ]


def test_without_shard_heads_each_tp_size_cuts_its_own_shards_so_tp8_pages_miss_at_tp4():
    at8 = PageKeys(config(), layout_at(8))
    at4 = PageKeys(config(), layout_at(4))
    sharded8 = {k for k in at8.block_keys(HASHES[0]) if "/replicated/" not in k}
    sharded4 = {k for k in at4.block_keys(HASHES[0]) if "/replicated/" not in k}
    assert sharded8.isdisjoint(sharded4)
    assert {k.split("/")[2] for k in sharded4} == {f"w4r{i}" for i in range(4)}


def test_shard_heads_equal_to_a_tp_sizes_own_shards_keeps_that_tp_sizes_keys():
    """TP=8 pages stored before shard_heads was set are the w8 pages a TP=4 reader with
    shard_heads = 8 asks for: the setting changes no key where it changes no cut."""
    for token_major in (False, True):
        layout = layout_at(8, token_major)
        assert PageKeys(config(shard_heads=8), layout).block_keys(HASHES[1]) == PageKeys(
            config(), layout
        ).block_keys(HASHES[1])


@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
def test_a_head_shard_has_one_manifest_and_one_byte_order_whichever_tp_size_cut_it(token_major):
    """TP=8 rank 3's whole K/V regions and TP=4 rank 1's second half of its regions are
    the same page: same manifest, hence same fingerprint and key, and the same bytes in
    the same order, gathered from memory laid out for 1 or 2 heads per rank."""
    block = HASHES[2]
    pages = []
    for tp, rank, j in ((8, 3, 3), (4, 1, 3), (2, 0, 3), (1, 0, 3)):
        layout = layout_at(tp, token_major)
        plans = plan_pages(layout, shard_heads=8)
        share = next(s for s in rank_shares(layout, plans, rank) if s.shard_index == j)
        assert share.plan.shard_class.label == "w8"
        pool = torch.zeros(layout.pool_sizes[0], dtype=torch.uint8)
        compute(layout, rank, pool, block, slot=4)
        out = torch.empty(1, share.plan.page_size, dtype=torch.uint8)
        mover = PageMover(share.regions, [flat_bytes(pool)], SLOTS)
        mover.gather(torch.tensor([4]), out)
        pages.append((share.plan.manifest, bytes(out[0].tolist())))
    (manifest, page), *others = pages
    assert manifest.regions == ((0, "k", 64), (0, "v", 64), (1, "k", 64), (1, "v", 64))
    assert all(m == manifest and p == page for m, p in others)
    # and the bytes are head 3's, K then V, layer after layer, token by token
    want = torch.cat(
        [head_bytes(block, layer, role, 3).flatten() for layer in range(2) for role in "kv"]
    )
    assert page == bytes(want.tolist())


def test_a_token_major_part_is_one_region_per_token_that_the_mover_folds_into_one_run():
    layout = layout_at(4, token_major=True)
    sharded = plan_pages(layout, shard_heads=8)[0]
    assert sharded.parts == 2 and len(sharded.part_regions[1]) == 4 * TOKENS
    pool = torch.zeros(layout.pool_sizes[0], dtype=torch.uint8)
    mover = PageMover(sharded.part_regions[1], [pool], SLOTS)
    # one run per layer (its K and V tokens lie at one step), not one per token
    assert len(mover.runs) == LAYERS


@pytest.mark.parametrize(
    ("tp", "shard_heads", "message"),
    [
        (8, 4, r"shard_heads=4 is not a multiple of TP=8's 8 shards of role 'k' \(8 units\)"),
        (4, 2, r"shard_heads=2 is not a multiple of TP=4's 4 shards of role 'k' \(8 units\)"),
        (4, 12, r"shard_heads=12 does not divide role 'k''s 8 units"),
        (2, 16, r"shard_heads=16 does not divide role 'k''s 8 units"),
    ],
)
def test_a_shard_heads_a_tp_size_cannot_share_is_refused_naming_it(tp, shard_heads, message):
    with pytest.raises(ConfigError, match=message):
        PageKeys(config(shard_heads=shard_heads), layout_at(tp))


def test_the_replicated_class_is_the_same_with_and_without_shard_heads():
    for tp in (1, 2, 4, 8):
        with_g = [p for p in plan_pages(layout_at(tp), shard_heads=8) if p.shard_class.replicated]
        without = [p for p in plan_pages(layout_at(tp)) if p.shard_class.replicated]
        assert with_g == without and with_g[0].parts == 1


def test_cutting_a_region_finer_than_its_rank_shard_needs_its_unit_layout():
    layout = layout_at(4)
    bare = KvLayout(
        4,
        TOKENS,
        layout.roles,
        (
            LayerGroup(
                0,
                SLOTS,
                tuple(
                    Region(r.role, r.layer, r.base, r.size, r.stride, r.num_slots)
                    for r in layout.groups[0].regions
                ),
            ),
        ),
        layout.pool_sizes,
    )
    with pytest.raises(LayoutError, match=r"region k@layer0: splitting it into 2 pages needs"):
        plan_pages(bare, shard_heads=8)
    assert plan_pages(bare, shard_heads=4)  # its own cut needs no unit layout


# ------------------------------------------------------------------ unit layouts
def test_a_unit_layout_must_cover_its_region_and_hold_the_roles_heads_per_rank():
    with pytest.raises(LayoutError, match=r"unit layout \[outer 1\]\[units 2\]\[inner 8\] is 16"):
        Region("k", 0, 0, 32, 32, 2, unit_layout=UnitLayout(2, 8))
    with pytest.raises(LayoutError, match="inner must be > 0"):
        UnitLayout(2, 0)
    region = Region("k", 0, 0, 32, 32, 2, unit_layout=UnitLayout(2, 16))
    with pytest.raises(
        LayoutError, match=r"holds 2 units, but role 'k' \(8 units at TP=2\) puts 4 on each rank"
    ):
        KvLayout(2, 4, (Role("k", 8, "bf16"),), (LayerGroup(0, 2, (region,)),), (64,))


def test_unit_layouts_travel_in_the_layout_dict():
    layout = layout_at(4, token_major=True)
    restored = KvLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert restored == layout
    assert restored.groups[0].regions[0].unit_layout == UnitLayout(2, HEAD_BYTES, outer=TOKENS)
    data = layout.to_dict()
    data["groups"][0]["regions"][0]["unit_layout"] = {"units": 2, "inner": 64}
    with pytest.raises(
        LayoutError, match=r"regions\[0\].unit_layout: missing field\(s\) \['outer'\]"
    ):
        KvLayout.from_dict(data)


def test_a_region_from_a_tensor_takes_its_unit_layout_from_the_heads_dimension():
    pool = torch.zeros(SLOTS, 2, TOKENS, 8, dtype=torch.float32)  # [slots, heads, tokens, dim]
    region = Region.from_tensor("k", 0, pool, pool, unit_dim=1)
    assert region.unit_layout == UnitLayout(2, TOKENS * 8 * 4)
    token_major = Region.from_tensor("k", 0, pool.view(SLOTS, TOKENS, 2, 8), pool, unit_dim=2)
    assert token_major.unit_layout == UnitLayout(2, 8 * 4, outer=TOKENS)
    assert Region.from_tensor("k", 0, pool, pool).unit_layout is None
    with pytest.raises(LayoutError, match="unit_dim 4 is not a dimension after the slot"):
        Region.from_tensor("k", 0, pool, pool, unit_dim=4)


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("value", [0, -8, True, 2.0, "8", 1 << 17])
def test_shard_heads_is_a_positive_number_of_shards_or_unset(value):
    with pytest.raises(ConfigError, match="shard_heads must be a number of head shards"):
        config(shard_heads=value)


def test_shard_heads_comes_from_the_environment_too():
    env = {"KVCONN_MODEL": "m", "KVCONN_SHARD_HEADS": "8"}
    assert ConnectorConfig.from_env(env).shard_heads == 8
    assert ConnectorConfig.from_env({"KVCONN_MODEL": "m"}).shard_heads is None
    with pytest.raises(ConfigError, match="shard_heads must be"):
        ConnectorConfig.from_env({**env, "KVCONN_SHARD_HEADS": "eight"})


# ------------------------------------------------------------------ TP groups over one store
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(8, 4), (4, 8), (2, 1), (1, 2), (8, 1)])
@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
def test_pages_written_at_one_tp_size_load_at_another_byte_for_byte(
    writer_tp, reader_tp, token_major
):
    backend = DictBackend()
    layout_w, writers = group_at(writer_tp, backend, 8, token_major)
    blocks = HASHES[:3]
    for rank, conn in enumerate(writers):
        for slot, h in zip((0, 1, 2), blocks):
            compute(layout_w, rank, conn.pools[0], h, slot)
        assert conn.save(blocks, [0, 1, 2]).ok
    # 8 head shards and the index-K, once each, whoever wrote them
    assert len(pages(backend)) == 3 * (8 + 1)
    layout_r, readers = group_at(reader_tp, backend, 8, token_major)
    assert readers[0].lookup(blocks).blocks == 3
    for rank, conn in enumerate(readers):
        result = conn.load(blocks, [5, 3, 4])
        assert result.loaded == 3 and not result.failed
        assert all(holds(layout_r, rank, conn.pools[0], h, s) for h, s in zip(blocks, (5, 3, 4)))
        parts = 8 // reader_tp
        assert conn.stats.pages("loaded") == 3 * (parts + 1)
        # a reader that computed the same blocks has nothing left to write
        assert conn.save(blocks, [5, 3, 4]).written == 0
    assert len(pages(backend)) == 3 * 9


def test_without_shard_heads_a_tp4_reader_misses_what_tp8_wrote():
    backend = DictBackend()
    layout_w, writers = group_at(8, backend, None)
    for rank, conn in enumerate(writers):
        compute(layout_w, rank, conn.pools[0], HASHES[0], 0)
        assert conn.save(HASHES[:1], [0]).ok
    _, readers = group_at(4, backend, None)
    assert readers[0].lookup(HASHES[:1]).blocks == 0


def test_a_missing_head_shard_is_a_miss_for_every_tp_size_and_fails_the_loads_that_need_it():
    backend = DictBackend()
    layout_w, writers = group_at(8, backend, 8)
    for rank, conn in enumerate(writers):
        for slot, h in enumerate(HASHES[:2]):
            compute(layout_w, rank, conn.pools[0], h, slot)
        conn.save(HASHES[:2], [0, 1])
    w8r5 = next(k for k in backend.data if "/w8r5/" in k and k.endswith(HASHES[1].hex()))
    del backend.data[w8r5]
    layout_r, readers = group_at(4, backend, 8)
    assert readers[0].lookup(HASHES[:2]).blocks == 1
    # rank 2 holds heads 4 and 5: its load of block 1 fails; rank 0's does not need it
    assert readers[2].load(HASHES[:2], [0, 1]).failed == (1,)
    assert readers[0].load(HASHES[:2], [0, 1]).loaded == 2
    assert holds(layout_r, 2, readers[2].pools[0], HASHES[0], 0)
    # the failed block's slot is not written, not even with the pages that did arrive
    regions = layout_r.groups[0].regions
    assert not any(bool(region_view(readers[2].pools[0], r, 1).any()) for r in regions)
