"""How vLLM's per-layer KV tensors become a kvconn layout (torch only, no engine).

What each layer holds comes as plain ``CacheGroup`` data here; ``test_vllm_specs.py``
derives it from vLLM's own spec objects and allocation.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import LayoutError
from kvconn.hashing import adopt_hashes
from kvconn.layout import KvLayout, UnitLayout
from kvconn.plan import plan_pages
from kvconn_vllm.layout import CacheGroup, LayerBytes, kv_layout, layer_index, layer_numbers

BLOCKS, BS, HEADS, DIM = 6, 32, 2, 64


def cpu_caches(layers: int = 2, heads: int = HEADS) -> dict[str, torch.Tensor]:
    """The CPU backend's form: [blocks, heads, block_size, 2 * head_size] per layer."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, heads, BS, 2 * DIM)
        for i in range(layers)
    }


def one_group(names, role: str = "kv", units: int = HEADS, index: int = 0, window=None):
    return CacheGroup(index, tuple((n, LayerBytes(role, units)) for n in names), window)


def describe(
    caches: dict[str, torch.Tensor],
    tp: int = 1,
    heads: int = HEADS,
    groups=None,
    shard_heads: int | None = None,
):
    return kv_layout(
        caches,
        groups or [one_group(caches, units=heads)],
        num_blocks=BLOCKS,
        block_size=BS,
        tp_size=tp,
        dtype_tags=dict.fromkeys(caches, "float32+CPU_ATTN"),
        shard_heads=shard_heads,
    )


def test_blocks_first_tensors_give_one_kv_region_per_layer_covering_a_whole_block():
    layout, pools = describe(cpu_caches())
    (group,) = layout.groups
    assert [(r.role, r.layer, r.size, r.stride) for r in group.regions] == [
        ("kv", 0, HEADS * BS * 2 * DIM * 4, HEADS * BS * 2 * DIM * 4),
        ("kv", 1, HEADS * BS * 2 * DIM * 4, HEADS * BS * 2 * DIM * 4),
    ]
    assert layout.roles[0].units == HEADS and layout.roles[0].dtype == "float32+CPU_ATTN+2x32x128"
    assert len(pools) == 2 and layout.tokens_per_block == BS and group.num_slots == BLOCKS


def test_a_cpu_cache_region_splits_into_one_contiguous_unit_per_local_head():
    layout, _ = describe(cpu_caches())
    assert {r.unit_layout for r in layout.groups[0].regions} == {
        UnitLayout(HEADS, BS * 2 * DIM * 4)
    }
    # at TP=2 each rank holds one of the two heads
    layout, _ = describe(cpu_caches(heads=1), tp=2)
    assert layout.groups[0].regions[0].unit_layout == UnitLayout(1, BS * 2 * DIM * 4)


def test_with_shard_heads_every_tp_size_names_the_block_with_all_the_models_heads():
    assert (
        describe(cpu_caches(), tp=1, shard_heads=2)[0].roles[0].dtype
        == (describe(cpu_caches(heads=1), tp=2, shard_heads=2)[0].roles[0].dtype)
        == "float32+CPU_ATTN+2x32x128"
    )
    # without it, each rank names its own block, as before
    assert describe(cpu_caches(heads=1), tp=2)[0].roles[0].dtype == "float32+CPU_ATTN+1x32x128"


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_with_shard_heads_pages_of_one_tp_size_load_at_another_head_by_head(
    tmp_path, writer_tp, reader_tp
):
    """vLLM's TP ranks hold consecutive heads: rank r of TP=2 holds head r, TP=1 both."""
    config = ConnectorConfig(
        model="m", backend="lmdb", options={"path": str(tmp_path)}, shard_heads=2
    )
    hashes = adopt_hashes("vllm:sha256", [bytes([i]) * 32 for i in range(3)])
    whole = cpu_caches()  # [blocks, 2 heads, ...]: what TP=1 holds
    per_rank = {
        1: [whole],
        2: [{n: t[:, r : r + 1].clone() for n, t in whole.items()} for r in range(2)],
    }

    def connectors(tp, caches_of_ranks):
        for rank, caches in enumerate(caches_of_ranks):
            layout, pools = describe(caches, tp=tp, shard_heads=2)
            yield Connector(config, layout, rank=rank, pools=pools)

    for conn in connectors(writer_tp, per_rank[writer_tp]):
        with conn:
            assert conn.save(hashes, [4, 1, 2]).ok
    empty = {
        tp: [{n: torch.zeros_like(t) for n, t in c.items()} for c in ranks]
        for tp, ranks in per_rank.items()
    }
    for conn in connectors(reader_tp, empty[reader_tp]):
        with conn:
            assert conn.lookup(hashes).blocks == 3
            assert conn.load(hashes, [0, 3, 5]).loaded == 3
    for got, want in zip(empty[reader_tp], per_rank[reader_tp]):
        for name, tensor in want.items():
            for src, dst in ((4, 0), (1, 3), (2, 5)):
                assert torch.equal(got[name][dst], tensor[src])


def test_kv_first_tensors_give_k_and_v_regions():
    caches = {f"layers.{i}.attn": torch.randn(2, BLOCKS, BS, HEADS, DIM) for i in range(2)}
    layout, _ = describe(caches)
    assert [(r.role, r.layer) for r in layout.groups[0].regions] == [
        ("k", 0),
        ("v", 0),
        ("k", 1),
        ("v", 1),
    ]
    v0 = layout.groups[0].regions[1]
    assert v0.base == BLOCKS * BS * HEADS * DIM * 4  # V starts after every block's K


def test_layers_in_one_allocation_share_a_pool_and_a_shared_layer_adds_nothing():
    buffer = torch.randn(2, BLOCKS, HEADS, BS, 2 * DIM)
    caches = {"layers.0.attn": buffer[0], "layers.1.attn": buffer[1], "layers.2.attn": buffer[1]}
    layout, pools = describe(caches)
    assert len(pools) == 1 and pools[0].numel() == buffer.numel() * 4
    assert [r.layer for r in layout.groups[0].regions] == [0, 1]  # layer 2 reads layer 1's


def test_the_layout_round_trips_and_its_pages_are_exactly_the_blocks(tmp_path):
    caches = cpu_caches()
    layout, pools = describe(caches, tp=1)
    assert KvLayout.from_dict(layout.to_dict()) == layout
    config = ConnectorConfig(model="m", backend="lmdb", options={"path": str(tmp_path)})
    hashes = adopt_hashes("vllm:sha256", [bytes([i]) * 32 for i in range(3)])
    with Connector(config, layout, pools=pools) as writer:
        assert writer.save(hashes, [4, 1, 2]).written == 3
    other = {name: torch.zeros_like(t) for name, t in caches.items()}
    layout2, pools2 = describe(other)
    with Connector(config, layout2, pools=pools2) as reader:
        assert reader.load(hashes, [0, 3, 5]).loaded == 3
    for name, tensor in caches.items():
        for src, dst in ((4, 0), (1, 3), (2, 5)):
            assert torch.equal(other[name][dst], tensor[src])


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((BLOCKS + 1, HEADS, BS, 2 * DIM), r"neither \[num_blocks=6, \.\.\.\] nor"),
        ((2, 2, BS, HEADS), "ambiguous"),
    ],
)
def test_a_tensor_of_an_unknown_form_is_a_layout_error(shape, message):
    num_blocks = 2 if message == "ambiguous" else BLOCKS
    with pytest.raises(LayoutError, match=message):
        kv_layout(
            {"layers.0.attn": torch.zeros(shape)},
            [one_group(["layers.0.attn"])],
            num_blocks=num_blocks,
            block_size=BS,
            tp_size=1,
            dtype_tags={"layers.0.attn": "x"},
        )


def test_layers_of_one_role_with_different_block_shapes_are_refused():
    caches = cpu_caches()
    caches["model.layers.1.self_attn.attn"] = torch.zeros(BLOCKS, 1, BS, 2 * DIM)
    with pytest.raises(LayoutError, match="layers of one role must share a geometry"):
        describe(caches)


def test_an_mla_latent_is_a_replicated_role_so_one_page_per_block_at_any_tp():
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, 1, 16, 576) for i in (0, 1)}
    for tp in (1, 2, 8):
        layout, _ = describe(caches, tp=tp, groups=[one_group(caches, "latent", 1)])
        assert [(r.name, r.units) for r in layout.roles] == [("latent", 1)]
        (plan,) = plan_pages(layout)
        assert plan.shard_class.replicated and plan.page_size == 2 * 16 * 576 * 4


def test_groups_that_share_memory_are_described_over_a_pool_each():
    """vLLM's hybrid allocator lays its KV-cache groups over one buffer: layer 0 (group 0)
    and layer 1 (group 1) are the same bytes, each block id owned by one group at a time.
    Each group gets its own pool index over that memory, so both layers have regions
    and kvconn's overlap check still holds inside each group."""
    buffer = torch.randn(2, BLOCKS, HEADS, BS, 2 * DIM)
    caches = {
        "layers.0.attn": buffer[0],
        "layers.2.attn": buffer[1],
        "layers.1.attn": buffer[0],
        "layers.3.attn": buffer[1],
    }
    groups = [
        one_group(["layers.0.attn", "layers.2.attn"], index=0, window=2),
        one_group(["layers.1.attn", "layers.3.attn"], index=1),
    ]
    layout, pools = describe(caches, groups=groups)
    assert [(g.index, g.window, [r.layer for r in g.regions]) for g in layout.groups] == [
        (0, 2, [0, 2]),
        (1, None, [1, 3]),
    ]
    assert [r.pool for g in layout.groups for r in g.regions] == [0, 0, 1, 1]
    assert len(pools) == 2 and pools[0].data_ptr() == pools[1].data_ptr()


def test_a_group_layer_without_a_tensor_is_a_layout_error():
    groups = [one_group(["model.layers.0.self_attn.attn", "model.layers.9.self_attn.attn"])]
    with pytest.raises(LayoutError, match=r"'model.layers.9.self_attn.attn' of KV cache group 0"):
        describe(cpu_caches(), groups=groups)


def test_layer_numbers_come_from_the_name_or_else_the_position():
    assert layer_index("model.layers.17.self_attn.attn", 3) == 17
    assert layer_index("decoder.attn", 3) == 3
    assert layer_index("model.layers.1.experts.2.attn", 5) == 5  # two numbers: ambiguous


def test_a_draft_models_layers_number_after_the_targets_and_the_targets_keep_theirs():
    names = [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "draft_model.model.layers.0.self_attn.attn",
        "draft_model.model.layers.1.self_attn.attn",
        "decoder.attn",
    ]
    assert list(layer_numbers(names).values()) == [0, 1, 2, 3, 4]
    # a model with no draft numbers as before: the name's number, else the position
    assert layer_numbers(["model.layers.7.attn", "decoder.attn"]) == {
        "model.layers.7.attn": 7,
        "decoder.attn": 1,
    }


def test_layers_of_one_number_under_one_prefix_keep_it():
    """An attention layer and its indexer (DeepSeek-V3.2) are two roles of one layer."""
    names = ["model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"]
    assert list(layer_numbers(names).values()) == [0, 0]


def target_and_draft(draft: LayerBytes) -> KvLayout:
    """A 2-KV-head target layer and a 1-KV-head draft model layer in one group."""
    caches = {
        "model.layers.0.self_attn.attn": torch.zeros(8, 2, 32, 128),
        "draft_model.model.layers.0.self_attn.attn": torch.zeros(8, 1, 32, 128),
    }
    group = CacheGroup(
        0,
        (
            ("model.layers.0.self_attn.attn", LayerBytes("kv", 2)),
            ("draft_model.model.layers.0.self_attn.attn", draft),
        ),
    )
    layout, _ = kv_layout(
        caches,
        [group],
        num_blocks=8,
        block_size=32,
        tp_size=1,
        dtype_tags=dict.fromkeys(caches, "float32"),
    )
    return layout


def test_a_draft_layer_of_another_geometry_is_a_role_of_its_own():
    """A draft model with 1 KV head beside a target with 2: role ``draft_kv`` of 1 unit
    (stored once for a TP group), the target's ``kv`` of 2."""
    layout = target_and_draft(LayerBytes("kv", 1, draft=True))
    assert {(r.name, r.units) for r in layout.roles} == {("kv", 2), ("draft_kv", 1)}
    assert [(r.role, r.layer) for r in layout.groups[0].regions] == [("kv", 0), ("draft_kv", 1)]


def test_drafts_of_one_shape_and_other_weights_are_other_bytes():
    """Two deployments of one target with different draft checkpoints of the same shape
    must not load each other's draft K/V: the draft's weights are in its roles' dtype."""

    def roles(weights: str) -> dict[str, str]:
        layout = target_and_draft(LayerBytes("kv", 1, draft=True, weights=weights))
        return {r.name: r.dtype for r in layout.roles}

    a, b = roles("5f0c1a2b3c4d5e6f"), roles("0123456789abcdef")
    assert a["kv"] == b["kv"]  # the target's pages are the target's
    assert a["draft_kv"] != b["draft_kv"] and "+draft=" in a["draft_kv"]


def test_importing_kvconn_and_the_adapter_package_does_not_import_vllm():
    code = (
        "import sys, kvconn, kvconn_vllm, kvconn_vllm.layout\n"
        "kvconn.Connector, kvconn.KvLayout, kvconn.adopt_hashes\n"
        "assert 'vllm' not in sys.modules, 'vllm was imported'\n"
        "kvconn_vllm.KvconnConnector\n"  # first use of the connector imports vLLM
        "assert 'vllm' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------- pipeline stages
def stage_caches(first: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """A pipeline stage's caches: vLLM names its layers as the model does."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, HEADS, BS, 2 * DIM)
        for i in range(first, first + layers)
    }


def test_two_pipeline_stages_describe_their_own_layers_under_keys_of_their_own():
    stage0, _ = describe(stage_caches(0))
    stage1, _ = describe(stage_caches(2))
    assert [r.layer for r in stage1.groups[0].regions] == [2, 3]
    (plan0,), (plan1,) = plan_pages(stage0), plan_pages(stage1)
    assert plan0.page_size == plan1.page_size  # one shape, other layers: other keys
    assert plan0.fingerprint != plan1.fingerprint


def handshakes(layouts: dict[tuple[int, int], KvLayout]) -> dict[tuple[int, int], Any]:
    from kvconn_vllm.connector import LayoutHandshake

    return {ranks: LayoutHandshake(layout.to_dict()) for ranks, layout in layouts.items()}


def test_the_scheduler_takes_one_layout_per_pipeline_stage_in_stage_order():
    from kvconn_vllm.connector import pipeline_layouts

    stage0, _ = describe(stage_caches(0))
    stage1, _ = describe(stage_caches(2))
    metadata = handshakes({(1, 0): stage1, (0, 0): stage0})
    assert pipeline_layouts(metadata, 2) == [stage0, stage1]
    assert pipeline_layouts({}, 2) == []  # before the workers described theirs


def test_a_missing_pipeline_stage_or_ranks_of_a_stage_that_disagree_are_refused():
    from kvconn.errors import ConfigError
    from kvconn_vllm.connector import pipeline_layouts

    stage0, _ = describe(stage_caches(0))
    stage1, _ = describe(stage_caches(2))
    with pytest.raises(ConfigError, match=r"pipeline stages \[0\] of 2"):
        pipeline_layouts(handshakes({(0, 0): stage0}), 2)
    disagree = handshakes({(0, 0): stage0, (1, 0): stage1, (1, 1): stage0})
    with pytest.raises(ConfigError, match="workers of pipeline stage 1 described different"):
        pipeline_layouts(disagree, 2)
