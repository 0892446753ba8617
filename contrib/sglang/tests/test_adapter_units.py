"""The adapter's configuration, host-pool description and refusals, in one process."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from harness import Case, minimax_host_pools
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from kvconn.errors import ConfigError, LayoutError
from kvconn.plan import plan_pages
from kvconn.registry import load_backend
from kvconn_sglang.host_layout import HostPoolShape, describe_host_pool, kv_units, page_slots
from kvconn_sglang.settings import AdapterSettings
from kvconn_sglang.storage import (
    KvconnHiCacheStorage,
    _every_rank_saves,
    _shape_of,
    tp_lcm_shards,
)

V1 = {"interface_v1": 1, "kvconn": {"backend": "lmdb"}}


def storage_config(**kw):
    fields = dict(
        tp_rank=0,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="org/model",
        extra_config=dict(V1),
    )
    return HiCacheStorageConfig(**(fields | kw))


def test_unknown_extra_config_keys_are_refused_by_name():
    with pytest.raises(ConfigError, match="kv_head"):
        AdapterSettings.from_extra_config(V1 | {"kv_head": 1}, "m", environ={})


def test_sglangs_own_prefetch_keys_pass_as_its_decode_side_offload_hands_them_over():
    """SGLang's controllers pop these before building a backend; its decode-side offload
    manager (PD disaggregation) passes the extra config on as it is."""
    own = {
        "prefetch_threshold": 256,
        "prefetch_timeout_base": 1,
        "prefetch_timeout_per_ki_token": 0.25,
        "hicache_storage_pass_prefix_keys": False,
        "tp_lcm_size": 4,
    }
    settings = AdapterSettings.from_extra_config(V1 | own, "m", environ={})
    assert settings.connector.backend == "lmdb"


def test_the_copying_interface_is_refused_without_interface_v1():
    with pytest.raises(ConfigError, match="interface_v1"):
        AdapterSettings.from_extra_config({"kvconn": {}}, "m", environ={})


def test_the_kvconn_entry_must_be_a_table():
    with pytest.raises(ConfigError, match="table"):
        AdapterSettings.from_extra_config({"interface_v1": 1, "kvconn": "redis"}, "m", environ={})


def test_the_model_defaults_to_the_weights_sglang_loads_as_in_every_adapter():
    """``<model path>@<revision>[+<quantization>]`` (kvconn.engine_settings), not the
    name SGLang serves under, which may be an alias two models share."""
    from types import SimpleNamespace

    from kvconn_sglang.settings import engine_model

    args = SimpleNamespace(model_path="org/model", revision="r1", quantization="fp8")
    settings = AdapterSettings.from_extra_config(V1, engine_model(args, "alias"), environ={})
    assert settings.connector.model == "org/model@r1+fp8"
    assert settings.connector.backend == "lmdb"
    # without published server arguments the served name is all there is
    unpublished = AdapterSettings.from_extra_config(V1, "org/model", environ={})
    assert unpublished.connector.model == "org/model@default"


def test_kvconn_environment_variables_override_the_extra_config():
    settings = AdapterSettings.from_extra_config(V1, "m", environ={"KVCONN_BACKEND": "redis"})
    assert settings.connector.backend == "redis"


def test_a_configuration_without_any_model_name_is_refused():
    with pytest.raises(ConfigError, match="model"):
        AdapterSettings.from_extra_config(V1, None, environ={})


@pytest.mark.parametrize("bad", [0, -1, True, "4", 2.0])
def test_kv_heads_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="kv_heads"):
        AdapterSettings.from_extra_config(V1 | {"kv_heads": bad}, "m", environ={})


def test_kv_heads_that_do_not_fit_the_host_pool_are_refused():
    assert kv_units(2, 4, 8) == 8
    assert kv_units(1, 8, 4) == 4  # each head on two consecutive ranks
    assert kv_units(2, 4, None) == 8  # unknown: every rank's heads are its own
    with pytest.raises(LayoutError, match="kv_heads=4"):
        kv_units(2, 4, 4)
    with pytest.raises(LayoutError, match="kv_heads=3"):
        kv_units(1, 4, 3)


def mha_shape(layout, pages=5, ps=4, layers=3, heads=2, dim=8, start_layer=0):
    size = pages * ps
    dims = {
        "layer_first": (2, layers, size, heads, dim),
        "page_first": (2, size, layers, heads, dim),
        "page_first_direct": (2, pages, layers, ps, heads, dim),
    }[layout]
    buffer = torch.zeros(dims, dtype=torch.bfloat16)
    return HostPoolShape("mha", layout, ps, layers, size, buffer, heads, start_layer=start_layer)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_two_pipeline_stages_with_pools_of_one_shape_key_their_pages_apart(layout):
    """Stage 1 of a 6-layer model holds layers 3-5 in a pool shaped like stage 0's
    layers 0-2: keyed alike, one stage would load the other's bytes as its own."""
    stage0 = plan_pages(describe_host_pool(mha_shape(layout), 2, 4))[0]
    stage1 = plan_pages(describe_host_pool(mha_shape(layout, start_layer=3), 2, 4))[0]
    assert stage0.page_size == stage1.page_size
    assert stage0.fingerprint != stage1.fingerprint
    per_layer = layout == "layer_first"  # else one region holds every layer of a page
    assert [r.layer for r in stage1.regions] == ([3, 4, 5] if per_layer else [3]) * 2  # K, V
    # a pool that starts at layer 0 numbers its regions as before, so its keys are those
    # of stores written before pipeline stages were keyed
    assert [r.layer for r in stage0.regions] == ([0, 1, 2] if per_layer else [0]) * 2


@pytest.mark.parametrize("bad", [-1, True, 1.0, None])
def test_a_host_pool_whose_first_layer_is_not_a_layer_index_is_refused(bad):
    buffer = mha_shape("page_first").kv_buffer
    with pytest.raises(LayoutError, match="start_layer"):
        HostPoolShape("mha", "page_first", 4, 3, 20, buffer, 2, start_layer=bad)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_stored_page_is_sglangs_flat_page_of_that_layout(layout):
    shape = mha_shape(layout)
    plan = plan_pages(describe_host_pool(shape, 2, 4))[0]
    # SGLang's flat data page: K and V of every layer of one page, bf16
    assert plan.page_size == 2 * 3 * 4 * 2 * 8 * 2
    first_region = plan.regions[0]
    assert (first_region.role, first_region.base) == ("k", 0)


def test_same_sized_pages_in_another_host_layout_get_other_keys():
    a = plan_pages(describe_host_pool(mha_shape("page_first"), 2, 4))[0]
    b = plan_pages(describe_host_pool(mha_shape("page_first_direct"), 2, 4))[0]
    assert a.page_size == b.page_size
    assert a.fingerprint != b.fingerprint


def test_an_unsupported_host_layout_is_refused_by_name():
    shape = mha_shape("page_first")
    odd = HostPoolShape("mha", "page_unified", 4, 3, 20, shape.kv_buffer, 2)
    with pytest.raises(LayoutError, match="page_unified"):
        describe_host_pool(odd, 2, 4)


def test_host_indices_that_are_not_whole_pages_are_refused():
    assert page_slots(torch.arange(8, 16), 4, 2).tolist() == [2, 3]
    with pytest.raises(LayoutError, match="page-aligned"):
        page_slots(torch.arange(2, 10), 4, 2)
    with pytest.raises(LayoutError, match="host indices for 3 pages"):
        page_slots(torch.arange(8), 4, 3)


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"attn_cp_size": 2}, "context parallelism"),
    ],
)
def test_parallel_shapes_the_adapter_would_key_wrongly_are_refused_at_start(fields, what):
    with pytest.raises(ConfigError, match=what):
        KvconnHiCacheStorage(storage_config(**fields))


def test_stripe_reads_without_a_tp_group_to_stripe_over_is_refused_at_start(tmp_path):
    import torch.distributed as dist

    striped = V1 | {"kvconn": {"backend": "lmdb", "stripe_reads": True}}
    with pytest.raises(ConfigError, match=r"stripe_reads at TP>1 needs torch\.distributed"):
        KvconnHiCacheStorage(storage_config(extra_config=striped))
    # a world of one process cannot be SGLang's TP group of two
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rv'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="no group of SGLang's TP size 2"):
            KvconnHiCacheStorage(storage_config(extra_config=striped))
    finally:
        dist.destroy_process_group()
    # at TP=1 there is nothing to stripe: no group, no rounds
    storage = KvconnHiCacheStorage(storage_config(tp_size=1, extra_config=striped))
    assert storage.group is None and storage.rounds is None


#: SGLang 0.5.23's MHA host buffers (MHATokenToKVPoolHost.init_kv_buffer), by layout:
#: the dimension of KV heads, and how a page's tokens or index select its part.
MHA_HEADS_DIM = {"layer_first": 3, "page_first": 3, "page_first_direct": 4, "page_head": 2}


def mha_buffer(layout, pages=5, ps=4, layers=3, heads=2, dim=8):
    size = pages * ps
    dims = {
        "layer_first": (2, layers, size, heads, dim),
        "page_first": (2, size, layers, heads, dim),
        "page_first_direct": (2, pages, layers, ps, heads, dim),
        "page_head": (2, pages, heads, ps, layers, dim),
    }[layout]
    return torch.zeros(dims, dtype=torch.bfloat16)


def pages_of(layout, buffer, first, count, ps=4):
    """The part of an MHA host buffer holding pages ``[first, first + count)``."""
    if layout == "layer_first":
        return buffer[:, :, first * ps : (first + count) * ps]
    if layout == "page_first":
        return buffer[:, first * ps : (first + count) * ps]
    return buffer[:, first : first + count]


@pytest.mark.parametrize(
    ("layout", "outer"),
    [("layer_first", 4), ("page_first", 4 * 3), ("page_first_direct", 3 * 4), ("page_head", 1)],
)
def test_mha_k_and_v_regions_say_which_bytes_hold_which_head(layout, outer):
    """[outer][heads][inner] per page: token-major slots have outer = the page's tokens
    (times the layers before the heads); page_head keeps each head's page contiguous."""
    shape = HostPoolShape("mha", layout, 4, 3, 20, mha_buffer(layout), 2)
    regions = describe_host_pool(shape, 2, 4).group(0).regions
    assert {r.role for r in regions} == {"k", "v"}
    for region in regions:
        units = region.unit_layout
        assert units is not None
        assert (units.units, units.outer, units.inner) == (2, outer, region.size // outer // 2)
    # the latent of an MLA pool is the same on every rank: nothing to cut by heads
    kv, _ = mla_dsa_shapes(layout if layout != "page_head" else "page_first")
    assert all(r.unit_layout is None for r in describe_host_pool(kv, 2, 1).group(0).regions)


def split_storage(layout, tp, rank, store, *, lcm=4, heads=4, kvconn=None, pages=5):
    """Rank ``rank`` of a TP=``tp`` instance with its own host pool, over one LMDB store;
    SGLang's config for tp_lcm_size (``should_split_heads`` as its controller sets it)."""
    extra = V1 | {"kv_heads": heads, "kvconn": {"backend": "lmdb", **(kvconn or {})}}
    config = storage_config(
        tp_rank=rank,
        tp_size=tp,
        tp_lcm_size=lcm,
        should_split_heads=layout == "page_head" and lcm > tp,
        extra_config=extra,
    )
    storage = KvconnHiCacheStorage(config)
    local = max(heads // tp, 1)
    buffer = mha_buffer(layout, pages=pages, heads=local)
    shape = HostPoolShape("mha", layout, 4, 3, pages * 4, buffer, local)
    storage.attach(shape, backend=load_backend("lmdb", {"path": str(store)}))
    return storage, buffer


def stored_shards(store):
    backend = load_backend("lmdb", {"path": str(store)})
    try:
        parts = [key.split("/") for key, _ in backend.list_keys("")]
    finally:
        backend.close()
    return sorted({p[2] for p in parts if p[2] != "_layout"})


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(4, 2), (2, 4)])
@pytest.mark.parametrize("layout", ["page_head", "layer_first", "page_first", "page_first_direct"])
def test_instances_at_tp_sizes_dividing_tp_lcm_size_share_kv_pages(
    tmp_path, layout, writer_tp, reader_tp
):
    """4 KV heads, tp_lcm_size=4: every rank of one instance stores its heads' pages,
    every rank of the other finds and loads its heads byte-exact, keyed w4r<j>.

    page_head is SGLang's split (should_split_heads); the other layouts share pages only
    with kvconn's shard_heads set in the kvconn config (SGLang splits only page_head).
    """
    kvconn = {} if layout == "page_head" else {"shard_heads": 4}
    hd = MHA_HEADS_DIM[layout]
    model = mha_buffer(layout, heads=4).normal_()  # every head of the model, every page
    keys = KEYS  # 3 pages
    written = torch.arange(0, 12)  # pages 0-2

    def instance(tp):
        return [split_storage(layout, tp, r, tmp_path, kvconn=kvconn) for r in range(tp)]

    writers = instance(writer_tp)
    readers = instance(reader_tp)
    try:
        for rank, (storage, buffer) in enumerate(writers):
            per = 4 // writer_tp
            buffer.copy_(model.narrow(hd, rank * per, per))
            assert storage.batch_set_v1(keys, written) == [True] * 3
            done = rank + 1 == writer_tp
            # the hit needs every head shard's page: no instance hits on part of them
            assert readers[0][0].batch_exists(keys) == (3 if done else 0)
        assert stored_shards(tmp_path) == ["w4r0", "w4r1", "w4r2", "w4r3"]
        for rank, (storage, buffer) in enumerate(readers):
            per = 4 // reader_tp
            assert storage.batch_exists(keys) == 3
            assert storage.batch_get_v1(keys, written) == [True] * 3
            expected = torch.zeros_like(buffer)
            pages_of(layout, expected, 0, 3).copy_(
                pages_of(layout, model, 0, 3).narrow(hd, rank * per, per)
            )
            assert torch.equal(buffer, expected), f"TP={reader_tp} rank {rank}"
    finally:
        for storage, _ in writers + readers:
            storage.close()


def test_tp_lcm_size_cuts_pages_at_the_heads_when_there_are_fewer_heads():
    """SGLang's own backends cannot split fewer heads than tp_lcm_size; kvconn cuts at
    one head per page, which every TP size dividing tp_lcm_size also cuts."""
    assert tp_lcm_shards(8, 2, 16) == 8
    assert tp_lcm_shards(8, 2, 4) == 4
    assert tp_lcm_shards(8, 4, 2) == 2  # one head on two ranks: the TP size's own shards
    with pytest.raises(ConfigError, match=r"tp_lcm_size=8 at TP=2 with 12 KV heads"):
        tp_lcm_shards(8, 2, 12)


def test_tp_lcm_size_combinations_kvconn_cannot_serve_are_refused_by_name(tmp_path):
    # 12 heads do not split into 8 shards of whole heads
    with pytest.raises(ConfigError, match=r"tp_lcm_size=8 at TP=2 with 12 KV heads"):
        split_storage("page_head", 2, 0, tmp_path, lcm=8, heads=12)
    # kvconn's own shard_heads must agree with tp_lcm_size's
    with pytest.raises(ConfigError, match=r"shard_heads=2.*tp_lcm_size=4 at TP=2"):
        split_storage("page_head", 2, 0, tmp_path, kvconn={"shard_heads": 2})
    # the same head count at every TP size, or the pages would not meet
    with pytest.raises(LayoutError, match="kv_heads=4 at TP=2"):
        KvconnHiCacheStorage(
            storage_config(
                tp_size=2,
                tp_lcm_size=4,
                should_split_heads=True,
                extra_config=V1 | {"kv_heads": 4},
            )
        ).attach(HostPoolShape("mha", "page_head", 4, 3, 20, mha_buffer("page_head", heads=1), 1))
    # one head on this rank and no kv_heads: the head count is unknown
    with pytest.raises(ConfigError, match=r"tp_lcm_size=8 at TP=4.*\"kv_heads\""):
        config = storage_config(tp_size=4, tp_lcm_size=8, should_split_heads=True)
        shape = HostPoolShape("mha", "page_head", 4, 3, 20, mha_buffer("page_head", heads=1), 1)
        KvconnHiCacheStorage(config).attach(shape)
    # a buffer not in SGLang's page_head shape says nothing of its heads: not cut
    odd = torch.zeros(2, 5, 2 * 4 * 3 * 8, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match=r"tp_lcm_size=4 at TP=2 with 4 KV heads.*unit layout"):
        config = storage_config(
            tp_size=2, tp_lcm_size=4, should_split_heads=True, extra_config=V1 | {"kv_heads": 4}
        )
        KvconnHiCacheStorage(config).attach(HostPoolShape("mha", "page_head", 4, 3, 20, odd, 2))
    # SGLang asserts it too: a tp_lcm_size that is no multiple of the TP size
    with pytest.raises(ConfigError, match=r"tp_lcm_size=6 at TP=4"):
        KvconnHiCacheStorage(storage_config(tp_size=4, tp_lcm_size=6, should_split_heads=True))


def test_sglang_saves_mla_from_rank_0_only_and_mha_from_every_rank():
    assert _every_rank_saves(storage_config(is_mla_model=False))
    assert not _every_rank_saves(storage_config(is_mla_model=True))


def test_the_copying_methods_point_at_interface_v1():
    storage = KvconnHiCacheStorage(storage_config())
    for call in (
        lambda: storage.get("k"),
        lambda: storage.batch_get(["k"]),
        lambda: storage.set("k", None),
        lambda: storage.batch_set(["k"], []),
    ):
        with pytest.raises(ConfigError, match="interface_v1"):
            call()


def test_transfers_before_a_host_pool_is_registered_are_refused():
    storage = KvconnHiCacheStorage(storage_config())
    with pytest.raises(ConfigError, match="no host pool"):
        storage.batch_exists(["ab" * 32])


def test_a_host_pool_kind_the_adapter_does_not_know_is_refused_by_name():
    with pytest.raises(LayoutError, match="dict"):
        _shape_of({})


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("mamba", "MambaPoolHost"),  # a Mamba pool of another class
        ("swa", "MHATokenToKVPoolHost"),  # an SWA pool of another kind (MLA, DeepSeek-V4)
        ("deepseek_v4_c4", "DeepSeek-V4"),
        ("draft", "MHATokenToKVPoolHost or MLATokenToKVPoolHost"),
        # QSA's indexer is neither DeepSeek-V3.2's nor MiniMax-M3's
        ("indexer", "DSAIndexerPoolHost.*MHATokenToKOnlyPoolHost"),
    ],
)
def test_side_pools_kvconn_does_not_store_per_page_are_refused_by_name(name, why):
    storage = KvconnHiCacheStorage(storage_config())
    storage.register_mem_host_pool_v2(object(), "kv")  # hybrid controllers register KV too
    with pytest.raises(ConfigError, match=rf"'{name}' pool \(object\): .*{why}"):
        storage.register_mem_host_pool_v2(object(), PoolName(name))


def mla_dsa_shapes(layout="page_first", pages=8, ps=4, layers=2, dim=24, row=132):
    """An MLA host pool and DeepSeek-V3.2's indexer host pool in SGLang's buffer shapes
    (the indexer with two spare pages, as DSAIndexerPoolHost allocates)."""
    size = pages * ps
    if layout == "layer_first":
        kv = torch.zeros(layers, size, 1, dim, dtype=torch.bfloat16)
        index = torch.zeros(layers, pages + 2, ps * row, dtype=torch.uint8)
    else:
        kv = torch.zeros(size, layers, 1, dim, dtype=torch.bfloat16)
        index = torch.zeros(pages + 2, layers, 1, ps * row, dtype=torch.uint8)
    return (
        HostPoolShape("mla", layout, ps, layers, size, kv),
        HostPoolShape("indexer", layout, ps, layers, size, index, name="indexer"),
    )


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_the_dsa_indexer_is_a_replicated_layer_group_over_its_own_pool(layout):
    kv, index = mla_dsa_shapes(layout)
    described = describe_host_pool(kv, 8, 1, [index])
    plans = plan_pages(described)
    # one page per pool and block, identical on every rank: stored once at any TP
    assert [(p.group, p.shard_class.label, p.page_size) for p in plans] == [
        (0, "replicated", 2 * 4 * 24 * 2),
        (1, "replicated", 2 * 4 * 132),
    ]
    assert [r.role for r in plans[1].regions] == ["index_k"] * len(plans[1].regions)
    assert {r.pool for r in plans[1].regions} == {1}
    assert described.group(1).num_slots == described.group(0).num_slots == 8


def minimax_pools(layout="layer_first", heads=2, layers=3, pages=8, nvfp4=False):
    """SGLang's own host pools of MiniMax-M3's sparse cache, the harness's (K/V, index
    keys); with ``nvfp4`` MiniMax-M3.1's page rows (128-token pages, head_dim 128)."""
    ps, dim = (128, 128) if nvfp4 else (4, 8)
    model = "minimax-nvfp4" if nvfp4 else "minimax"
    case = Case("unit", model=model, layout=layout, page_size=ps, layers=layers, heads=heads)
    _, host, index = minimax_host_pools(dataclasses.replace(case, head_dim=dim), pages * ps)
    return host, index


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_minimax_m3s_index_keys_are_a_replicated_layer_group_beside_each_ranks_kv(layout):
    """The index keys are one head SGLang computes whole on every rank: one page per
    block for the group at any TP, over the KV pool's slots, as SGLang's flat page."""
    from kvconn_sglang.storage import _side_pool_shape

    host, index = minimax_pools(layout)
    shape = _side_pool_shape(index, PoolName.INDEXER)
    described = describe_host_pool(_shape_of(host), 2, 4, [shape])
    plans = plan_pages(described)
    flat = index.get_dummy_flat_data_page()
    assert [(p.group, p.shard_class.label) for p in plans] == [(0, "w2"), (1, "replicated")]
    assert plans[1].page_size == flat.numel() * flat.element_size()  # 2 layers x 4 x 16
    assert {r.role for r in plans[1].regions} == {"index_k"}
    assert described.group(1).num_slots == described.group(0).num_slots
    assert described.roles[-1].dtype == f"bfloat16:{layout}"


def test_minimax_m3s_index_key_pool_under_pipeline_parallelism_is_refused_by_name():
    """Its host pool numbers the sparse layers from 0 on every stage."""
    _, index = minimax_pools()
    storage = KvconnHiCacheStorage(storage_config(pp_size=2))
    with pytest.raises(ConfigError, match="'indexer' pool under pipeline parallelism"):
        storage.register_mem_host_pool_v2(index, PoolName.INDEXER)


@pytest.mark.parametrize("heads", [1, 2, 8])
def test_an_nvfp4_rows_head_count_is_read_off_sglangs_own_row_width(heads):
    host, _ = minimax_pools(heads=heads, nvfp4=True)
    assert _shape_of(host).head_num == heads


def test_an_nvfp4_row_of_no_msa_v1_width_is_refused():
    host, _ = minimax_pools(nvfp4=True)
    host.row_bytes += 128
    with pytest.raises(LayoutError, match="is no MSA-v1 main row"):
        _shape_of(host)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_minimax_m31s_nvfp4_rows_are_kv_per_rank_and_index_keys_once(layout):
    """The K/V rows hold the rank's heads (never cut finer: no head is one range of a
    row); the index rows are the same on every rank. Both roles name the encoding."""
    from kvconn_sglang.storage import _side_pool_shape

    host, index = minimax_pools(layout, layers=2, nvfp4=True)
    shape = _shape_of(host)
    described = describe_host_pool(shape, 2, 4, [_side_pool_shape(index, PoolName.INDEXER)])
    plans = plan_pages(described)
    assert [(p.group, p.shard_class.label) for p in plans] == [(0, "w2"), (1, "replicated")]
    flat = [pool.get_dummy_flat_data_page().numel() for pool in (host, index)]
    assert [p.page_size for p in plans] == flat
    assert [(r.name, r.units, r.dtype) for r in described.roles] == [
        ("kv", 4, f"nvfp4-msa-v1:{layout}"),
        ("index_k", 1, f"nvfp4-msa-v1:{layout}"),
    ]
    with pytest.raises(LayoutError, match="needs its unit layout"):
        plan_pages(described, shard_heads=4)


def test_a_side_pool_that_does_not_follow_the_kv_pools_pages_is_refused():
    kv, index = mla_dsa_shapes()
    odd = HostPoolShape("indexer", "page_first", 8, 2, 32, index.kv_buffer, name="indexer")
    with pytest.raises(LayoutError, match="must follow the KV pool's slots"):
        describe_host_pool(kv, 2, 1, [odd])


@pytest.fixture
def dsa_storage(tmp_path):
    """One rank's storage over an MLA pool and the DSA indexer pool, on LMDB."""
    storage = KvconnHiCacheStorage(storage_config(tp_size=1, is_mla_model=True))
    kv, index = mla_dsa_shapes()
    kv.kv_buffer.normal_()
    index.kv_buffer.random_(0, 256)
    storage.attach(kv, side_pools=[index], backend=load_backend("lmdb", {"path": str(tmp_path)}))
    yield storage, kv.kv_buffer, index.kv_buffer
    storage.close()


def indexer(keys, host_indices, policy=PoolHitPolicy.ALL_PAGES):
    return PoolTransfer(
        name=PoolName.INDEXER, keys=keys, host_indices=host_indices, hit_policy=policy
    )


KEYS = [f"{i:064x}" for i in range(1, 4)]


def test_each_v2_call_moves_only_the_pool_it_names_and_the_hit_needs_every_pool(dsa_storage):
    storage, kv, index = dsa_storage
    first, second = torch.arange(0, 12), torch.arange(12, 24)  # pages 0-2, pages 3-5
    assert storage.batch_set_v2([indexer(KEYS, first)]) == {"indexer": [True] * 3}
    # the indexer pages alone are no hit: a block needs its latent page too
    assert storage.batch_exists(KEYS) == 0
    assert storage.batch_exists_v2(KEYS, [indexer(None, None)]).kv_hit_pages == 0
    assert storage.batch_set_v1(KEYS, first) == [True] * 3
    hit = storage.batch_exists_v2(KEYS, [indexer(None, None)])
    assert hit.kv_hit_pages == 3
    assert hit.extra_pool_hit_pages == {"kv": 3, "indexer": 3}
    assert hit.restorable_prefix_pages == [1, 2, 3]
    kv_before, index_before = kv[:12].clone(), index[:3].clone()
    kv.zero_()
    index.zero_()
    # v1 loads the latent, and only the latent
    assert storage.batch_get_v1(KEYS, second) == [True] * 3
    assert torch.equal(kv[12:24], kv_before)
    assert int(torch.count_nonzero(index)) == 0
    # v2 loads the indexer into the same pages
    assert storage.batch_get_v2([indexer(KEYS, second)]) == {"indexer": [True] * 3}
    assert torch.equal(index[3:6], index_before)


def test_v2_calls_for_a_pool_not_registered_or_a_trailing_policy_are_refused(dsa_storage):
    storage = dsa_storage[0]
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=KEYS, host_indices=torch.arange(12))
    with pytest.raises(ConfigError, match="'mamba' pool, which is not registered"):
        storage.batch_get_v2([mamba])
    with pytest.raises(ConfigError, match="trailing_pages"):
        storage.batch_exists_v2(KEYS, [indexer(None, None, PoolHitPolicy.TRAILING_PAGES)])


def test_sglangs_empty_v2_calls_move_nothing(dsa_storage):
    storage = dsa_storage[0]
    # after every KV prefetch SGLang asks for its non-KV side pools, here none
    assert storage.batch_get_v2([]) == {}
    empty = torch.empty(0, dtype=torch.long)
    assert storage.batch_set_v2([indexer([], empty)]) == {"indexer": []}


def test_the_adapter_leaves_no_finished_transfers_behind_in_the_service(dsa_storage):
    """The service keeps each finished transfer until an engine polls ``finished()``;
    SGLang never polls, so the adapter drains it after each call (unbounded otherwise)."""
    storage = dsa_storage[0]
    for _ in range(20):
        storage.batch_set_v1(KEYS, torch.arange(0, 12))
        storage.batch_get_v1(KEYS, torch.arange(12, 24))
        storage.batch_get_v2([indexer(KEYS, torch.arange(12, 24))])
    assert storage.transfers is not None
    # at most the last call's transfer, if it was recorded after its caller woke
    assert len(storage.transfers.finished()) <= 1


def test_a_large_batch_set_does_not_delay_batch_exists_on_a_thread_safe_backend():
    """SGLang's backup thread stores while its prefetch thread asks: nothing serializes
    them when the backend is safe to share (the store's put is held until the end)."""
    import threading

    from kvconn.hashing import adopt_hashes
    from tests.fakes import GatedBackend

    store = GatedBackend()  # declares thread_safe
    storage = KvconnHiCacheStorage(storage_config(tp_size=1))
    shape = mha_shape("page_first", pages=64)
    shape.kv_buffer.normal_()
    storage.attach(shape, backend=store)
    try:
        stored = ["ab" * 32]
        storage.batch_set_v1(stored, torch.arange(0, 4))
        assert storage.batch_exists(stored) == 1
        big = [f"{i:064x}" for i in range(1, 60)]
        store.hold("put")
        backup = threading.Thread(
            target=storage.batch_set_v1, args=(big, torch.arange(4, 4 + 4 * len(big)))
        )
        backup.start()
        assert store.wait_entered("put")
        assert storage.batch_exists(stored) == 1  # answered while the put is held
        assert storage.batch_exists(big[:1]) == 0
        store.release("put")
        backup.join(10)
        assert storage.batch_exists(big) == len(big)
        assert storage.connector is not None
        assert storage.connector.lookup(adopt_hashes("sglang:sha256", big)).blocks == len(big)
    finally:
        store.release("put")
        storage.close()


def test_a_stalled_put_does_not_hold_sglangs_backup_thread_past_load_timeout_s(caplog):
    """The backup thread waits for a save's outcome within ``load_timeout_s``: then its
    pages are reported not stored, and the captured pages still reach the store once it
    answers again."""
    import time

    from tests.fakes import GatedBackend

    store = GatedBackend()
    extra = {"interface_v1": 1, "kvconn": {"backend": "lmdb", "load_timeout_s": 0.2}}
    storage = KvconnHiCacheStorage(storage_config(tp_size=1, extra_config=extra))
    shape = mha_shape("page_first", pages=16)
    shape.kv_buffer.normal_()
    storage.attach(shape, backend=store)
    keys = [f"{i:064x}" for i in range(1, 4)]
    try:
        store.hold("put")
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="kvconn"):
            assert storage.batch_set_v1(keys, torch.arange(0, 12)) == [False] * 3
            assert storage.batch_set_v1(keys[:1], torch.arange(0, 4)) == [False]
        took = time.monotonic() - start
        assert 0.4 <= took < 2.0  # two saves, each waited load_timeout_s, not for the store
        assert storage.late_saves == 2
        late = [r.getMessage() for r in caplog.records if "load_timeout_s" in r.getMessage()]
        assert late == [  # once a minute at most
            "kvconn: a save of 3 pages is unfinished after load_timeout_s (0.2 s): "
            "SGLang is told they are not stored (1 such saves so far)"
        ]
        store.release("put")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and storage.batch_exists(keys) < 3:
            time.sleep(0.01)
        assert storage.batch_exists(keys) == 3  # captured before the stall: written after
        assert storage.batch_set_v1(keys, torch.arange(0, 12)) == [True] * 3
    finally:
        store.release("put")
        storage.close()


# ------------------------------------------------------------------ sliding-window pools
def swa_shape(layout="page_first", pages=6, ps=4, layers=2, heads=2, dim=8):
    """An SWA host pool (SGLang's MHATokenToKVPoolHost over the SWA layers), with host
    slots of its own: fewer pages than the KV pool."""
    shape = mha_shape(layout, pages=pages, ps=ps, layers=layers, heads=heads, dim=dim)
    return dataclasses.replace(shape, name="swa", own_slots=True)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_the_swa_pool_is_a_layer_group_of_its_own_slots_keyed_by_head(layout):
    kv, swa = mha_shape(layout, pages=10), swa_shape(layout, pages=6)
    described = describe_host_pool(kv, 2, 4, [swa], {"swa": 4})
    assert described.group(0).num_slots == 10 and described.group(1).num_slots == 6
    assert {r.role for r in described.group(1).regions} == {"swa_k", "swa_v"}
    assert {r.pool for r in described.group(1).regions} == {1}
    plans = plan_pages(described)
    assert [(p.group, p.shard_class.label) for p in plans] == [(0, "w2"), (1, "w2")]


def test_an_swa_pool_with_other_pages_than_the_kv_pool_is_refused():
    odd = dataclasses.replace(swa_shape(), page_size=2)
    with pytest.raises(LayoutError, match="2-token pages, the KV pool 4-token pages"):
        describe_host_pool(mha_shape("page_first", pages=10), 2, 4, [odd], {"swa": 4})


def test_an_swa_pool_under_pipeline_parallelism_is_refused_by_name():
    """SGLang's hybrid SWA pools number their layers from 0 on every stage."""
    pool = host_pool_of(swa_shape())
    storage = KvconnHiCacheStorage(storage_config(pp_size=2))
    with pytest.raises(ConfigError, match="'swa' pool under pipeline parallelism"):
        storage.register_mem_host_pool_v2(pool, PoolName.SWA)
    plain = KvconnHiCacheStorage(storage_config())
    plain.register_mem_host_pool_v2(pool, PoolName.SWA)
    assert plain._side_pools["swa"].own_slots


def host_pool_of(shape):
    """An SGLang host pool object of ``shape``'s class (MHA or MLA) with its attributes,
    as the adapter reads them, without allocating SGLang's buffers."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    pool = object.__new__(MHATokenToKVPoolHost if shape.kind == "mha" else MLATokenToKVPoolHost)
    for field in dataclasses.fields(shape):
        if field.name not in ("kind", "name", "own_slots", "components", "model_layers"):
            setattr(pool, field.name, getattr(shape, field.name))
    return pool


@pytest.fixture
def swa_storage(tmp_path):
    """One rank's storage over a KV pool of 10 pages and an SWA pool of 6, on LMDB."""
    storage = KvconnHiCacheStorage(storage_config(tp_size=1))
    kv, swa = mha_shape("page_first", pages=10), swa_shape(pages=6)
    kv.kv_buffer.normal_()
    swa.kv_buffer.normal_()
    storage.attach(kv, side_pools=[swa], backend=load_backend("lmdb", {"path": str(tmp_path)}))
    yield storage, kv.kv_buffer, swa.kv_buffer
    storage.close()


def trailing(name, keys, host_indices=None):
    """A transfer of a pool SGLang loads only at the end of a hit (SWA, Mamba)."""
    return PoolTransfer(
        name=name,
        keys=keys,
        host_indices=host_indices,
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def swa(keys, host_indices=None):
    return trailing(PoolName.SWA, keys, host_indices)


SIX = [f"{i:064x}" for i in range(1, 7)]


def window(pages):
    """SGLang's prefetch query: placeholder keys, one per page of the window."""
    return swa(["__placeholder__"] * pages)


def test_a_hit_needs_the_swa_pages_of_its_window_only(swa_storage):
    storage = swa_storage[0]
    assert storage.batch_set_v1(SIX, torch.arange(0, 24)) == [True] * 6
    # SGLang backs up a node's trailing SWA pages: pages 3 and 5 of the six (0-based)
    assert storage.batch_set_v2([swa([SIX[2], SIX[3]], torch.arange(0, 8))]) == {"swa": [True] * 2}
    assert storage.batch_set_v2([swa(SIX[5:], torch.arange(8, 12))]) == {"swa": [True]}
    # without a window SGLang asks for the KV pages alone (v1: no SWA to load)
    assert storage.batch_exists(SIX) == 6
    # a 2-page window: prefixes 4 (pages 2-3) and 6 (4-5)? page 4 is missing, so only 4
    hit = storage.batch_exists_v2(SIX, [window(2)])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [4])
    assert hit.extra_pool_hit_pages == {"kv": 4, "swa": 4}
    # a 1-page window: 3, 4 and 6, each ending on a stored SWA page
    hit = storage.batch_exists_v2(SIX, [window(1)])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (6, [3, 4, 6])


def test_a_window_reaching_before_the_span_needs_only_the_spans_pages(swa_storage):
    storage = swa_storage[0]
    storage.batch_set_v1(SIX[:2], torch.arange(0, 8))
    storage.batch_set_v2([swa(SIX[:2], torch.arange(0, 8))])
    hit = storage.batch_exists_v2(SIX[:2], [window(4)])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (2, [1, 2])


def test_the_swa_pages_load_into_their_own_host_slots_and_nothing_else(swa_storage):
    storage, kv, pool = swa_storage
    storage.batch_set_v1(SIX, torch.arange(0, 24))
    # pages 4-5 of the block chain sit in SWA slots 1 and 4
    slots = torch.cat([torch.arange(4, 8), torch.arange(16, 20)])
    assert storage.batch_set_v2([swa(SIX[4:], slots)]) == {"swa": [True, True]}
    kv_pages, swa_pages = kv.clone(), pool.clone()
    kv.zero_()
    pool.zero_()
    assert storage.batch_get_v2([swa(SIX[4:], torch.arange(8, 16))]) == {"swa": [True, True]}
    assert torch.equal(pool[:, 8:12], swa_pages[:, 4:8])
    assert torch.equal(pool[:, 12:16], swa_pages[:, 16:20])
    assert int(torch.count_nonzero(pool[:, :8])) == int(torch.count_nonzero(pool[:, 16:])) == 0
    assert int(torch.count_nonzero(kv)) == 0  # the KV pool is not touched
    # a window page never stored fails, and so does every page after it (SGLang counts
    # a pool's leading successes)
    assert storage.batch_get_v2([swa(SIX[3:5], torch.arange(0, 8))]) == {"swa": [False, False]}
    assert storage.batch_get_v1(SIX, torch.arange(0, 24)) == [True] * 6
    assert torch.equal(kv[:, :24], kv_pages[:, :24])


def test_a_pool_on_its_own_slots_asked_for_every_page_needs_every_page(swa_storage):
    """SGLang moves an MTP draft's sliding layers on the KV pool's indices with every
    page (``draft_swa`` registered ``all_pages``): a hit then needs that pool's page of
    every block, not a window of them."""
    storage = swa_storage[0]
    assert storage.batch_set_v1(SIX, torch.arange(0, 24)) == [True] * 6
    assert storage.batch_set_v2([swa(SIX[:4], torch.arange(0, 16))]) == {"swa": [True] * 4}
    every = PoolTransfer(name=PoolName.SWA, keys=None, hit_policy=PoolHitPolicy.ALL_PAGES)
    hit = storage.batch_exists_v2(SIX, [every])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (4, {"kv": 4, "swa": 4})
    assert storage.batch_exists_v2(SIX, [window(1)]).kv_hit_pages == 4  # 5 and 6 lack it
    unknown = PoolTransfer(name=PoolName.SWA, keys=None, hit_policy="block_groups")
    with pytest.raises(ConfigError, match="serves all_pages and trailing_pages"):
        storage.batch_exists_v2(SIX, [unknown])


# ------------------------------------------------------------------ Mamba state pools
def mamba_pool(slots=8, layers=2, temporal=(2, 4, 4), convs=((8, 3), (4, 3))):
    """SGLang's own MambaPoolHost over CPU state buffers (page_first, unpinned)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal),
        conv=tuple(torch.zeros(layers, slots, *c, dtype=torch.bfloat16) for c in convs),
    )
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")


def test_a_mamba_state_page_is_sglangs_flat_state_page_over_its_buffers():
    from kvconn_sglang.storage import _side_pool_shape

    pool = mamba_pool()
    shape = _side_pool_shape(pool, PoolName.MAMBA)
    described = describe_host_pool(mha_shape("page_first"), 2, 4, [shape], {"mamba": 2})
    group = described.group(1)
    assert group.num_slots == pool.size  # one state per slot, slots of its own
    assert [r.role for r in group.regions] == ["mamba_temporal", "mamba_conv0", "mamba_conv1"]
    assert [r.pool for r in group.regions] == [1, 2, 3]  # each buffer a pool of its own
    assert len(described.pool_sizes) == 4
    (plan,) = [p for p in plan_pages(described) if p.group == 1]
    assert plan.page_size == pool.get_dummy_flat_data_page().numel()
    assert plan.shard_class.label == "w2"  # each rank's state its own page


def test_a_conv_only_mamba_state_has_no_temporal_region():
    from kvconn_sglang.storage import _side_pool_shape

    pool = mamba_pool(temporal=(0,))
    shape = _side_pool_shape(pool, PoolName.MAMBA)
    described = describe_host_pool(mha_shape("page_first"), 1, 2, [shape], {"mamba": 1})
    assert [r.role for r in described.group(1).regions] == ["mamba_conv0", "mamba_conv1"]
    (plan,) = [p for p in plan_pages(described) if p.group == 1]
    assert plan.page_size == pool.get_dummy_flat_data_page().numel()


@pytest.fixture
def mamba_storage(tmp_path):
    """One rank's storage over a KV pool of 10 pages and a Mamba pool of 8 states."""
    storage = KvconnHiCacheStorage(storage_config(tp_size=1))
    kv = mha_shape("page_first", pages=10)
    kv.kv_buffer.normal_()
    pool = mamba_pool()
    storage.register_mem_host_pool_v2(pool, PoolName.MAMBA)  # as the hybrid controller does
    backend = load_backend("lmdb", {"path": str(tmp_path)})
    storage.attach(kv, side_pools=[storage._side_pools["mamba"]], backend=backend)
    pool.temporal_buffer.normal_()
    for conv in pool.conv_buffer:
        conv.normal_()
    yield storage, pool
    storage.close()


def state(keys, host_indices=None):
    return trailing(PoolName.MAMBA, keys, host_indices)


def test_a_hit_ends_on_a_page_whose_state_is_stored(mamba_storage):
    storage, pool = mamba_storage
    storage.batch_set_v1(SIX, torch.arange(0, 24))
    # checkpoints at pages 2 and 4 (0-based), one state slot each
    assert storage.batch_set_v2([state([SIX[2], SIX[4]], torch.tensor([3, 6]))]) == {
        "mamba": [True, True]
    }
    hit = storage.batch_exists_v2(SIX, [state(["__placeholder__"])])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (5, [3, 5])
    assert hit.extra_pool_hit_pages == {"kv": 5, "mamba": 5}
    stored = pool.get_data_page(6).clone()
    pool.temporal_buffer.zero_()
    for conv in pool.conv_buffer:
        conv.zero_()
    assert storage.batch_get_v2([state([SIX[4]], torch.tensor([1]))]) == {"mamba": [True]}
    assert torch.equal(pool.get_data_page(1), stored)
    assert int(torch.count_nonzero(pool.get_data_page(6))) == 0  # only the slot named


# ------------------------------------------------------------------ draft model pools
def lmdb_config(path, **kw):
    extra = {"interface_v1": 1, "kvconn": {"backend": "lmdb", "options": {"path": str(path)}}}
    return storage_config(**({"tp_size": 1, "extra_config": extra} | kw))


def test_a_draft_pool_registered_after_start_up_joins_the_layout_before_any_call(tmp_path):
    """SGLang registers a draft model's pool once its draft worker is up, after the
    storage started: the connector starts again with it, so the draft's pages have keys
    and a hit needs them."""
    storage = KvconnHiCacheStorage(lmdb_config(tmp_path))
    kv = mha_shape("page_first", pages=10)
    storage.register_mem_pool_host(host_pool_of(kv))
    storage.on_host_pools_registered()
    assert storage.pool_groups == {"kv": 0}
    draft = dataclasses.replace(mha_shape("page_first", pages=10, layers=1), name="draft")
    draft.kv_buffer.normal_()
    storage.register_mem_host_pool_v2(host_pool_of(draft), PoolName.DRAFT)
    try:
        assert storage.pool_groups == {"kv": 0, "draft": 1}
        assert storage.batch_set_v1(SIX, torch.arange(0, 24)) == [True] * 6
        assert storage.batch_exists(SIX) == 0  # the draft's pages are not stored yet
        sidecar = PoolTransfer(name=PoolName.DRAFT, keys=SIX, host_indices=torch.arange(0, 24))
        assert storage.batch_set_v2([sidecar]) == {"draft": [True] * 6}
        assert storage.batch_exists(SIX) == 6
        # once the store has answered, the layout (every key) is fixed
        with pytest.raises(ConfigError, match=r"'draft' pool was registered after .* answered"):
            storage.register_mem_host_pool_v2(host_pool_of(draft), PoolName.DRAFT)
    finally:
        storage.close()


@pytest.mark.parametrize("revision", [None, "v2"])
def test_a_draft_pools_roles_name_the_draft_checkpoint_it_was_loaded_from(
    tmp_path, monkeypatch, revision
):
    """Two deployments of one target with different draft checkpoints of one shape must
    not load each other's draft K/V (their drafts would silently be accepted less): the
    draft's ``--speculative-draft-model-path`` and revision are in its roles' dtypes,
    the target's roles are the target's."""
    from kvconn.engine_settings import EngineModel
    from kvconn_sglang import storage as storage_module

    def draft_dtypes(path):
        args = types.SimpleNamespace(
            speculative_draft_model_path=path, speculative_draft_model_revision=revision
        )
        monkeypatch.setattr(storage_module, "_published_server_args", lambda: args)
        storage = KvconnHiCacheStorage(lmdb_config(tmp_path / str(path).replace("/", "_")))
        storage.register_mem_pool_host(host_pool_of(mha_shape("page_first", pages=10)))
        storage.on_host_pools_registered()
        draft = dataclasses.replace(mha_shape("page_first", pages=10, layers=1), name="draft")
        storage.register_mem_host_pool_v2(host_pool_of(draft), PoolName.DRAFT)
        try:
            return {r.name: r.dtype for r in storage.connector.layout.roles}
        finally:
            storage.close()

    a, b, none = draft_dtypes("org/eagle-a"), draft_dtypes("org/eagle-b"), draft_dtypes(None)
    assert a["k"] == b["k"] == none["k"]
    assert a["draft_k"] != b["draft_k"] and a["draft_k"] != none["draft_k"]
    assert a["draft_k"].endswith(f"+draft={EngineModel.of('org/eagle-a', revision).tag}")


def test_an_mha_draft_an_mla_target_saves_from_rank_0_alone_is_refused(tmp_path):
    """SGLang backs up a dynamic backend's draft pools from rank 0 only with an MLA
    target: a draft split by heads would never be whole in the store."""
    storage = KvconnHiCacheStorage(lmdb_config(tmp_path, tp_size=2, is_mla_model=True))
    kv, _ = mla_dsa_shapes()
    draft = dataclasses.replace(mha_shape("page_first", pages=8, layers=1), name="draft")
    with pytest.raises(ConfigError, match=r"'draft' pool.* at TP=2 with an MLA target"):
        storage.attach(kv, side_pools=[draft])


def test_each_draft_pool_has_roles_of_its_own_beside_its_targets():
    """A draft's pools are described like their targets' under roles named after them,
    so no two pools' pages share a fingerprint."""
    kv, index = mla_dsa_shapes()
    draft = dataclasses.replace(kv, name="draft")
    draft_index = dataclasses.replace(index, name="draft_indexer")
    described = describe_host_pool(kv, 2, 1, [index, draft, draft_index])
    roles = [{r.role for r in described.group(g).regions} for g in range(4)]
    assert roles == [{"latent"}, {"index_k"}, {"draft_latent"}, {"draft_index_k"}]
    mha = mha_shape("page_first", pages=10)
    swa, draft_swa = swa_shape(), dataclasses.replace(swa_shape(), name="draft_swa")
    described = describe_host_pool(mha, 2, 4, [swa, draft_swa], {"swa": 4, "draft_swa": 4})
    assert {r.role for r in described.group(2).regions} == {"draft_swa_k", "draft_swa_v"}
    fingerprints = [p.fingerprint for p in plan_pages(described)]
    assert len(set(fingerprints)) == len(fingerprints)


def test_the_connector_starts_once_after_sglang_registers_every_start_up_pool(tmp_path):
    """A hybrid controller registers its pools one by one, then says it is done: one
    start with all of them, not one per pool (each would open the store again)."""
    storage = KvconnHiCacheStorage(lmdb_config(tmp_path))
    starts = []
    attach = storage.attach

    def counted(shape, **kw):
        starts.append([p.name for p in kw.get("side_pools", ())])
        attach(shape, **kw)

    storage.attach = counted  # type: ignore[method-assign]
    kv = mha_shape("page_first", pages=10)
    storage.register_mem_pool_host(host_pool_of(kv))
    storage.register_mem_host_pool_v2(host_pool_of(swa_shape()), PoolName.SWA)
    storage.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
    assert starts == [] and storage.connector is None
    storage.on_host_pools_registered()
    try:
        assert starts == [["swa", "mamba"]]
        assert storage.pool_groups == {"kv": 0, "swa": 1, "mamba": 2}
    finally:
        storage.close()
