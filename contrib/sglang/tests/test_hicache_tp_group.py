"""kvconn behind SGLang's real HiCache controller, in a group of two real processes: the
two ranks of a TP group, or (``pp-`` cases) the two stages of a pipeline at TP=1.

Every case runs SGLang 0.5.23's own ``HiCacheController`` (its threads, its page hashing,
its MIN all-reduces over gloo) with the kvconn backend loaded the way an operator turns
it on: ``hicache_storage_backend="dynamic"`` and the extra config below. The store is
LMDB in a temporary directory that both ranks open, read back here to count pages.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import (
    WORLD,
    Case,
    EvictPage,
    expected_flat_kv_page,
    expected_page,
    run_cases,
    written,
)

from kvconn.integrity import PageChecksum
from kvconn.registry import load_backend

PAGES = 6
#: SGLang's DSA pool takes 64-token pages only.
DSA_PAGE = 64
#: A MiniMax-M3 case's layers: one dense, two sparse.
MINIMAX_LAYERS = 3
#: SGLang's MiniMax-M3.1 NVFP4 (MSA-v1) cache takes 128-token pages only.
MSA_PAGE = 128


def extra_config(store: Path, *, stripe: bool = False, **more: Any) -> dict[str, Any]:
    kvconn = {"model": "test/model@rev", "backend": "lmdb", "options": {"path": str(store)}}
    return {
        "backend_name": "kvconn",
        "module_path": "kvconn_sglang",
        "class_name": "KvconnHiCacheStorage",
        "interface_v1": 1,
        "kvconn": kvconn | ({"stripe_reads": True} if stripe else {}),
        **more,
    }


def _cases(root: Path) -> dict[str, Case]:
    def case(name: str, *, stripe: bool = False, **kw: Any) -> Case:
        config = extra_config(root / name, stripe=stripe)
        return Case(name, pages=PAGES, extra_config=config, **kw)

    return {
        c.name: c
        for c in (
            case("mha-layer-first"),
            case("mha-page-first", layout="page_first"),
            case("mha-page-first-direct", layout="page_first_direct"),
            # SGLang splits heads for instances of TP sizes dividing 4: kvconn cuts K/V
            # at 4 head shards, two per rank (4 KV heads)
            Case(
                "mha-page-head-tp-lcm-4",
                pages=PAGES,
                layout="page_head",
                extra_config=extra_config(root / "mha-page-head-tp-lcm-4", tp_lcm_size=4),
            ),
            # one KV head for the model at TP=2: both ranks hold the same K/V
            case("gqa-duplicated", heads=1, kv_heads=1),
            case("mla-layer-first", model="mla"),
            # reads striped over kvconn's own gloo group: each shared page read once
            case("gqa-duplicated-striped", heads=1, kv_heads=1, stripe=True),
            case("mla-striped", model="mla", stripe=True),
            # rank 1's scheduler terminates the prefetch first: its I/O thread skips
            # every batch, so rank 0 must read the pages alone, not wait for rank 1
            case("mla-striped-rank-1-skips", model="mla", stripe=True, terminated_on=1),
            case("mla-page-first", model="mla", layout="page_first"),
            # after the hit query, the page of block 3 that only rank 1 loads disappears
            case("evicted-after-lookup", between_hit_and_get=EvictPage(3, f"w{WORLD}r1")),
            case("dsa-layer-first", model="dsa", page_size=DSA_PAGE),
            case("dsa-page-first", model="dsa", layout="page_first", page_size=DSA_PAGE),
            # after the hit query, block 3's indexer page (layer group 1) disappears
            case(
                "dsa-indexer-evicted",
                model="dsa",
                page_size=DSA_PAGE,
                between_hit_and_get=EvictPage(3, "replicated", group=1),
            ),
            # MiniMax-M3's sparse attention: GQA K/V of 3 layers, the index keys (one
            # head, whole on every rank) of the 2 sparse ones in a K-only side pool
            case("minimax-layer-first", model="minimax", layers=MINIMAX_LAYERS),
            case("minimax-page-first", model="minimax", layers=MINIMAX_LAYERS, layout="page_first"),
            case(
                "minimax-page-first-direct",
                model="minimax",
                layers=MINIMAX_LAYERS,
                layout="page_first_direct",
            ),
            # after the hit query, block 3's index-key page (layer group 1) disappears
            case(
                "minimax-indexer-evicted",
                model="minimax",
                layers=MINIMAX_LAYERS,
                between_hit_and_get=EvictPage(3, "replicated", group=1),
            ),
            # MiniMax-M3.1's NVFP4 cache: K/V and index keys packed in page rows
            case(
                "minimax-nvfp4-layer-first",
                model="minimax-nvfp4",
                page_size=MSA_PAGE,
                head_dim=128,
            ),
            case(
                "minimax-nvfp4-page-first",
                model="minimax-nvfp4",
                layout="page_first",
                page_size=MSA_PAGE,
                head_dim=128,
            ),
            # one KV head for the model at TP=2: both ranks' K/V rows are the same bytes
            case(
                "minimax-nvfp4-gqa-duplicated",
                model="minimax-nvfp4",
                page_size=MSA_PAGE,
                head_dim=128,
                heads=1,
                kv_heads=1,
            ),
            # pipeline parallelism at TP=1: each process a stage with 2 of the 4 layers
            case("pp-mha-layer-first", pipeline=True),
            case("pp-mha-page-first", pipeline=True, layout="page_first"),
            case("pp-mla-page-first", pipeline=True, model="mla", layout="page_first"),
            case(
                "pp-dsa-page-first",
                pipeline=True,
                model="dsa",
                layout="page_first",
                page_size=DSA_PAGE,
            ),
            # after the hit query, stage 1's page of block 3 disappears
            case(
                "pp-stage-1-evicted",
                pipeline=True,
                between_hit_and_get=EvictPage(3, "w1r0", rank=1),
            ),
            # a hybrid sliding-window model (SGLang's SWAKVPool): a 2-page window, the
            # SWA pages of the last two blocks stored
            case("swa-layer-first", model="swa"),
            case("swa-page-first", model="swa", layout="page_first"),
            # the SWA pages of blocks 2, 3 and 5 stored (three nodes' backups): only a
            # hit of 4 blocks has its whole window
            case(
                "swa-window-holes", model="swa", layout="page_first_direct", window_stored=(2, 3, 5)
            ),
            # after the hit query, the SWA page of block 5 that only rank 1 loads disappears
            case(
                "swa-window-page-evicted",
                model="swa",
                between_hit_and_get=EvictPage(PAGES - 1, f"w{WORLD}r1", group=1),
            ),
            # one KV head for the model at TP=2, in both pools: each stored once
            case("swa-gqa-duplicated", model="swa", heads=1, kv_heads=1),
            # a speculative draft model's KV pool, registered after the storage started:
            # EAGLE's MHA draft on an MHA target, DeepSeek MTP's MLA draft on MLA
            case("draft-mha-page-first", draft=True, layout="page_first"),
            case("draft-mla-layer-first", draft=True, model="mla"),
            # a target of 2 KV heads (one a rank), an EAGLE draft of 1 that SGLang
            # duplicates on both ranks: its K/V stored once, read from its config
            case("draft-head-duplicated", draft=True, heads=1, draft_kv_heads=1),
            # after the hit query, the draft page of block 3 only rank 1 loads disappears
            case(
                "draft-page-evicted",
                draft=True,
                between_hit_and_get=EvictPage(3, f"w{WORLD}r1", group=1),
            ),
            # a hybrid linear-attention model (SGLang's MambaPoolHost): the state of the
            # last page stored
            case("mamba-layer-first", model="mamba"),
            case("mamba-page-first", model="mamba", layout="page_first"),
            # states stored at pages 2 and 4 only (two nodes' checkpoints)
            case("mamba-checkpoints", model="mamba", window_stored=(2, 4)),
            # after the hit query, the state of page 5 that only rank 1 loads disappears
            case(
                "mamba-state-evicted",
                model="mamba",
                between_hit_and_get=EvictPage(PAGES - 1, f"w{WORLD}r1", group=1),
            ),
        )
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("stores")
    cases = _cases(root)
    results = run_cases(list(cases.values()))
    out = dict(zip(cases, results))
    for name, ranks in out.items():
        for r in ranks:
            assert "error" not in r, f"{name} failed on rank {r['rank']}:\n{r['error']}"
    return out | {"_root": root}  # type: ignore[dict-item]


def stored_pages(runs: dict[str, Any], name: str) -> Counter[str]:
    """Pages in the case's store by shard component (manifests left out)."""
    return Counter(component for component, _ in stored_pages_by_group(runs, name).elements())


def stored_pages_by_group(runs: dict[str, Any], name: str) -> Counter[tuple[str, str]]:
    """Pages in the case's store by shard component and layer group (``lg0``: KV)."""
    backend = load_backend("lmdb", {"path": str(runs["_root"] / name)})
    try:
        parts = [key.split("/") for key, _ in backend.list_keys("")]
    finally:
        backend.close()
    return Counter((p[2], p[3]) for p in parts if p[2] != "_layout")


def stored_value(runs: dict[str, Any], name: str, key: str) -> bytes:
    backend = load_backend("lmdb", {"path": str(runs["_root"] / name)})
    try:
        buffer = bytearray(1 << 20)
        (size,) = [n for k, n in backend.list_keys(key) if k == key]
        view = memoryview(buffer)[:size]
        assert backend.get([key], [view]) == [True]
        return bytes(view)
    finally:
        backend.close()


ALL_LOADED = [
    "draft-mha-page-first",
    "draft-head-duplicated",
    "draft-mla-layer-first",
    "mamba-layer-first",
    "mamba-page-first",
    "swa-layer-first",
    "swa-page-first",
    "swa-gqa-duplicated",
    "mha-layer-first",
    "mha-page-first",
    "mha-page-first-direct",
    "mha-page-head-tp-lcm-4",
    "gqa-duplicated",
    "mla-layer-first",
    "mla-page-first",
    "gqa-duplicated-striped",
    "mla-striped",
    "pp-mha-layer-first",
    "pp-mha-page-first",
    "pp-mla-page-first",
]


def test_the_storage_sglang_builds_from_the_extra_config_is_kvconns(runs):
    for name in ALL_LOADED:
        assert {r["storage_class"] for r in runs[name]} == {"KvconnHiCacheStorage"}


@pytest.mark.parametrize("name", ALL_LOADED)
def test_a_cold_prompt_misses_and_its_second_pass_loads_identical_bytes(runs, name):
    for r in runs[name]:
        assert r["cold_hit_tokens"] == 0
        assert r["hit_tokens"] == PAGES * 4
        assert r["loaded_tokens"] == PAGES * 4
        assert r["pages_equal"] == [True] * PAGES, f"rank {r['rank']}"


@pytest.mark.parametrize("name", ["mha-layer-first", "mha-page-first", "mha-page-first-direct"])
def test_distinct_heads_on_each_rank_are_stored_once_per_rank(runs, name):
    assert stored_pages(runs, name) == {f"w{WORLD}r0": PAGES, f"w{WORLD}r1": PAGES}
    assert [written(r) for r in runs[name]] == [PAGES, PAGES]


def test_sglangs_head_split_stores_each_rank_s_heads_as_pages_any_tp_dividing_4_cuts(runs):
    """``tp_lcm_size = 4`` at TP=2 (4 KV heads): each rank writes its two heads as two
    one-head pages, ``w4r<j>``, the pages a TP=1 or TP=4 instance cuts too."""
    name = "mha-page-head-tp-lcm-4"
    assert stored_pages(runs, name) == {f"w4r{j}": PAGES for j in range(4)}
    assert [written(r) for r in runs[name]] == [2 * PAGES, 2 * PAGES]


def test_a_gqa_head_duplicated_on_both_ranks_is_stored_once_with_writes_spread(runs):
    # SGLang itself would key each rank's copy apart and store 2 * PAGES pages
    assert stored_pages(runs, "gqa-duplicated") == {"replicated": PAGES}
    per_rank = [written(r) for r in runs["gqa-duplicated"]]
    assert sum(per_rank) == PAGES
    assert all(n > 0 for n in per_rank), per_rank  # both replicas took a share


@pytest.mark.parametrize("name", ["mla-layer-first", "mla-page-first"])
def test_mla_pages_saved_by_rank_0_alone_are_all_written_once(runs, name):
    rank0, rank1 = runs[name]
    # SGLang skips every backup on rank 1 for MLA; rank 0 must then write every page
    assert rank1["backup_completed_tokens"] == 0
    assert written(rank1) == 0
    assert written(rank0) == PAGES
    assert stored_pages(runs, name) == {"replicated": PAGES}


def read_pages(rank_result: dict[str, Any], event: str = "store_read") -> int:
    return int(rank_result["kvconn"]["total"].get(event, {}).get("pages", 0))


STRIPED_TWINS = [("gqa-duplicated-striped", "gqa-duplicated"), ("mla-striped", "mla-layer-first")]


@pytest.mark.parametrize(("name", "twin"), STRIPED_TWINS)
def test_with_stripe_reads_the_group_reads_each_shared_page_once(runs, name, twin):
    """Both ranks hold every page: unstriped, each reads all of them; striped, the two
    together read each once and pass the other half over kvconn's group."""
    unstriped = [read_pages(r) for r in runs[twin]]
    assert unstriped == [PAGES, PAGES]
    striped = [read_pages(r) for r in runs[name]]
    assert sum(striped) == PAGES and all(n > 0 for n in striped), striped
    for r in runs[name]:
        assert read_pages(r) + read_pages(r, "group_received") == PAGES
        assert r["rounds"] == {"striped": 1, "handed_back": 0}


def test_a_rank_that_skips_a_striped_load_leaves_the_other_reading_alone_not_hanging(runs):
    rank0, rank1 = runs["mla-striped-rank-1-skips"]
    # rank 1 never called batch_get_v1; rank 0 read every page itself, all verified
    assert rank1["rounds"] == {"striped": 0, "handed_back": 0} and read_pages(rank1) == 0
    assert rank0["rounds"] == {"striped": 0, "handed_back": 1}
    assert read_pages(rank0) == PAGES and read_pages(rank0, "loaded") == PAGES
    # SGLang's MIN over ranks: the terminated rank completed nothing, so neither did
    for r in (rank0, rank1):
        assert r["loaded_tokens"] == 0


def test_a_page_evicted_between_exists_and_get_is_a_failed_load_on_every_rank(runs):
    rank0, rank1 = runs["evicted-after-lookup"]
    for r in (rank0, rank1):
        assert r["hit_tokens"] == PAGES * 4  # the lookup saw every page
        assert r["loaded_tokens"] == 3 * 4  # SGLang's MIN over ranks: blocks 0-2
        assert r["pages_equal"] == [True] * 3
    # rank 1 read the missing page: it reports block 3 and after as failed, unwritten
    assert rank1["kvconn"]["total"]["failed"]["pages"] == PAGES - 3
    assert rank1["failed_pages_untouched"] == [True] * (PAGES - 3)
    for r in (rank0, rank1):  # asked again, the lookup now stops where the page is gone
        assert r["hit_tokens_after"] == 3 * 4


@pytest.mark.parametrize("name", ["mha-layer-first", "mha-page-first", "mla-layer-first"])
def test_a_stored_page_is_sglangs_own_flat_page_of_that_layout(runs, name):
    for r in runs[name]:
        want = expected_flat_kv_page(Case(**r["case"]), r["rank"], 0)
        # a stored value is the page, then its checksum trailer (kvconn.integrity)
        key = r["first_page_keys"][0]
        value = stored_value(runs, name, key)
        checksum = PageChecksum()
        assert value[: -checksum.size] == bytes(want.numpy())
        assert checksum.verify([memoryview(value)], [key]) == [True]


# ------------------------------------------------ DeepSeek-V3.2: MLA + indexer, v2 calls
DSA_LOADED = ["dsa-layer-first", "dsa-page-first", "pp-dsa-page-first"]


@pytest.mark.parametrize("name", DSA_LOADED)
def test_deepseek_v32_latent_and_indexer_load_byte_for_byte_on_both_ranks(runs, name):
    for r in runs[name]:
        assert r["storage_class"] == "KvconnHiCacheStorage"
        assert r["cold_hit_tokens"] == 0
        assert r["hit_tokens"] == PAGES * DSA_PAGE
        # batch_exists_v2 reports both pools at the one hit, agreed by SGLang's MIN
        assert r["pool_hit_pages"] == {"kv": PAGES, "indexer": PAGES}
        assert r["loaded_tokens"] == PAGES * DSA_PAGE
        assert r["pages_equal"] == [True] * PAGES, f"rank {r['rank']} latent"
        assert r["indexer_pages_equal"] == [True] * PAGES, f"rank {r['rank']} indexer"


@pytest.mark.parametrize("name", DSA_LOADED[:2])
def test_deepseek_v32_stores_one_latent_and_one_indexer_page_per_block_for_the_group(runs, name):
    # one page per pool and block for the whole group (rank 0 alone saves MLA models)
    assert stored_pages_by_group(runs, name) == {
        ("replicated", "lg0"): PAGES,
        ("replicated", "lg1"): PAGES,
    }
    rank0, rank1 = runs[name]
    assert rank1["backup_completed_tokens"] == 0
    assert written(rank1) == 0
    by_role = rank0["kvconn"]["by_role"]["written"]
    assert {role: n["pages"] for role, n in by_role.items()} == {
        "latent": PAGES,
        "index_k": PAGES,
    }


@pytest.mark.parametrize("name", DSA_LOADED[:2])
def test_a_stored_indexer_page_is_sglangs_own_flat_indexer_page(runs, name):
    for r in runs[name]:
        case = Case(**r["case"])
        # DSAIndexerPoolHost.get_data_page(flat=True): every layer's packed row of
        # 64 tokens x (128 fp8 keys + one 4-byte scale)
        numel = case.layers * DSA_PAGE * 132
        want = expected_page(case, 0, 0, numel, torch.uint8, "indexer")
        key = r["first_page_keys"][1]
        assert "/replicated/lg1/" in key
        value = stored_value(runs, name, key)
        checksum = PageChecksum()
        assert value[: -checksum.size] == bytes(want.numpy())


def test_an_indexer_page_evicted_after_the_hit_query_fails_that_block_and_later_on_both_ranks(
    runs,
):
    """Both ranks read the one indexer page of a block: each fails block 3 of the
    indexer's batch_get_v2, SGLang clamps the load to the pools' shorter prefix and its
    MIN over ranks agrees; the latent loaded by batch_get_v1 cannot make up for it."""
    for r in runs["dsa-indexer-evicted"]:
        assert r["hit_tokens"] == PAGES * DSA_PAGE  # the lookup saw every page
        assert r["loaded_tokens"] == 3 * DSA_PAGE
        assert r["indexer_pages_equal"] == [True] * 3
        assert r["pages_equal"] == [True] * 3
        # the indexer slots of the failed blocks are left as they were
        assert r["indexer_failed_pages_untouched"] == [True] * (PAGES - 3)
        # and the next lookup, over both pools, stops at the missing indexer page
        assert r["hit_tokens_after"] == 3 * DSA_PAGE


def test_a_side_pool_registered_once_the_store_has_answered_is_refused(runs):
    # a pool arriving after the storage has answered SGLang: the store's layout, hence
    # every key, was fixed then
    for r in runs["dsa-layer-first"]:
        assert r["late_registration"].startswith("ConfigError")
        assert "'indexer' pool was registered after" in r["late_registration"]


# ------------------------------------------------ MiniMax-M3: GQA K/V + sparse index keys
MINIMAX = ["minimax-layer-first", "minimax-page-first", "minimax-page-first-direct"]


@pytest.mark.parametrize("name", MINIMAX)
def test_minimax_m3_kv_and_index_keys_load_byte_for_byte_on_both_ranks(runs, name):
    for r in runs[name]:
        assert r["storage_class"] == "KvconnHiCacheStorage"
        assert r["cold_hit_tokens"] == 0
        assert r["hit_tokens"] == PAGES * 4
        # batch_exists_v2 reports both pools at the one hit, agreed by SGLang's MIN
        assert r["pool_hit_pages"] == {"kv": PAGES, "indexer": PAGES}
        assert r["loaded_tokens"] == PAGES * 4
        assert r["pages_equal"] == [True] * PAGES, f"rank {r['rank']} K/V"
        assert r["indexer_pages_equal"] == [True] * PAGES, f"rank {r['rank']} index keys"


@pytest.mark.parametrize("name", MINIMAX)
def test_minimax_m3_stores_its_index_keys_once_per_block_and_its_kv_per_rank(runs, name):
    """Every rank saves (an MHA model) and holds the same index keys: kvconn writes one
    index-key page per block for the group, its writes spread over the ranks, where
    keyed per rank it would store one per rank."""
    assert stored_pages_by_group(runs, name) == {
        (f"w{WORLD}r0", "lg0"): PAGES,
        (f"w{WORLD}r1", "lg0"): PAGES,
        ("replicated", "lg1"): PAGES,
    }
    index_writes = [
        r["kvconn"]["by_role"]["written"].get("index_k", {}).get("pages", 0) for r in runs[name]
    ]
    assert sum(index_writes) == PAGES
    assert all(n > 0 for n in index_writes), index_writes  # both ranks took a share
    for r in runs[name]:
        assert r["backup_completed_tokens"] == PAGES * 4
        assert r["kvconn"]["by_role"]["written"]["k"]["pages"] == PAGES  # its own K/V


@pytest.mark.parametrize("name", ["minimax-layer-first", "minimax-page-first-direct"])
def test_a_stored_index_key_page_is_sglangs_own_flat_index_key_page(runs, name):
    for r in runs[name]:
        case = Case(**r["case"])
        # MHATokenToKOnlyPoolHost.get_data_page(flat=True): the page's 4 tokens of one
        # 16-element bfloat16 key for each of the 2 sparse layers, in the layout's order
        numel = (MINIMAX_LAYERS - 1) * 4 * 16
        want = expected_page(case, 0, 0, numel, torch.bfloat16, "indexer")
        (key,) = [k for k in r["first_page_keys"] if "/replicated/lg1/" in k]
        value = stored_value(runs, name, key)
        checksum = PageChecksum()
        assert value[: -checksum.size] == bytes(want.numpy())


def test_a_minimax_index_key_page_evicted_after_the_hit_query_ends_the_load_on_both_ranks(
    runs,
):
    for r in runs["minimax-indexer-evicted"]:
        assert r["hit_tokens"] == PAGES * 4  # the lookup saw every page
        assert r["loaded_tokens"] == 3 * 4
        assert r["indexer_pages_equal"] == [True] * 3
        assert r["indexer_failed_pages_untouched"] == [True] * (PAGES - 3)
        assert r["hit_tokens_after"] == 3 * 4


NVFP4 = ["minimax-nvfp4-layer-first", "minimax-nvfp4-page-first"]


@pytest.mark.parametrize("name", [*NVFP4, "minimax-nvfp4-gqa-duplicated"])
def test_minimax_m31_nvfp4_rows_load_byte_for_byte_on_both_ranks(runs, name):
    for r in runs[name]:
        assert r["cold_hit_tokens"] == 0
        assert r["hit_tokens"] == r["loaded_tokens"] == PAGES * MSA_PAGE
        assert r["pool_hit_pages"] == {"kv": PAGES, "indexer": PAGES}
        assert r["pages_equal"] == [True] * PAGES, f"rank {r['rank']} K/V rows"
        assert r["indexer_pages_equal"] == [True] * PAGES, f"rank {r['rank']} index rows"


@pytest.mark.parametrize("name", NVFP4)
def test_minimax_m31_nvfp4_stores_k_v_rows_per_rank_and_index_rows_once(runs, name):
    assert stored_pages_by_group(runs, name) == {
        (f"w{WORLD}r0", "lg0"): PAGES,
        (f"w{WORLD}r1", "lg0"): PAGES,
        ("replicated", "lg1"): PAGES,
    }
    for r in runs[name]:
        # SGLang's flat page of each pool: every layer's row, in layer order
        kv_key, index_key = r["first_page_keys"]
        value = stored_value(runs, name, index_key)
        numel = 2 * 128 * 72  # 2 layers x one 9,216-byte row (64-byte keys, 8 scales)
        want = expected_page(Case(**r["case"]), 0, 0, numel, torch.uint8, "indexer")
        assert value[: -PageChecksum().size] == bytes(want.numpy())
        assert f"/w{WORLD}r{r['rank']}/lg0/" in kv_key


def test_minimax_m31_nvfp4_k_v_rows_duplicated_on_both_ranks_are_stored_once(runs):
    name = "minimax-nvfp4-gqa-duplicated"
    assert stored_pages_by_group(runs, name) == {
        ("replicated", "lg0"): PAGES,
        ("replicated", "lg1"): PAGES,
    }
    kv_writes = [
        r["kvconn"]["by_role"]["written"].get("kv", {}).get("pages", 0) for r in runs[name]
    ]
    assert sum(kv_writes) == PAGES and all(n > 0 for n in kv_writes), kv_writes


# ------------------------------------------------ pipeline parallelism (TP=1, 2 stages)
PIPELINES = ["pp-mha-layer-first", "pp-mha-page-first", "pp-mla-page-first"]


@pytest.mark.parametrize("name", PIPELINES)
def test_each_pipeline_stage_stores_its_own_layers_under_keys_of_its_own(runs, name):
    """The two stages' host pools have one shape (2 layers each): keyed by the pool's
    own layer numbers, stage 1 would find stage 0's pages and load them as its own.
    Keyed by the model's layers, each stage writes and loads its own pages (the bytes
    check in ``test_a_cold_prompt_misses_and_its_second_pass_loads_identical_bytes``)."""
    stage0, stage1 = runs[name]
    assert stage0["storage_class"] == stage1["storage_class"] == "KvconnHiCacheStorage"
    assert stage0["first_page_keys"] != stage1["first_page_keys"]
    assert [written(r) for r in runs[name]] == [PAGES, PAGES]
    component = "w1r0" if name.startswith("pp-mha") else "replicated"
    assert stored_pages(runs, name) == {component: 2 * PAGES}


def test_a_page_one_stage_lacks_ends_the_hit_and_the_load_on_every_stage(runs):
    """SGLang agrees on a hit and on what was loaded with MIN over the pipeline's group:
    stage 1 cannot read block 3, so stage 0, which read all its pages, keeps blocks 0-2
    too, and the next lookup stops there on both stages."""
    stage0, stage1 = runs["pp-stage-1-evicted"]
    for r in (stage0, stage1):
        assert r["hit_tokens"] == PAGES * 4  # both stages saw every page at the lookup
        assert r["loaded_tokens"] == 3 * 4
        assert r["pages_equal"] == [True] * 3
        assert r["hit_tokens_after"] == 3 * 4
    assert read_pages(stage0) == PAGES and "failed" not in stage0["kvconn"]["total"]
    assert stage1["kvconn"]["total"]["failed"]["pages"] == PAGES - 3
    assert stage1["failed_pages_untouched"] == [True] * (PAGES - 3)


def test_deepseek_v32_pipeline_stages_each_store_their_own_latent_and_indexer_pages(runs):
    """Both pools of a stage are numbered from its first layer: each stage writes one
    latent and one indexer page per block, keyed apart from the other stage's."""
    name = "pp-dsa-page-first"
    assert stored_pages_by_group(runs, name) == {
        ("replicated", "lg0"): 2 * PAGES,
        ("replicated", "lg1"): 2 * PAGES,
    }
    stage0, stage1 = runs[name]
    assert [written(r) for r in runs[name]] == [2 * PAGES, 2 * PAGES]
    assert set(stage0["first_page_keys"]).isdisjoint(stage1["first_page_keys"])


# ------------------------------------------------ hybrid sliding-window models (SWAKVPool)
SWA_CASES = ["swa-layer-first", "swa-page-first"]
SWA_WINDOW = 2


@pytest.mark.parametrize("name", SWA_CASES)
def test_a_hybrid_swa_model_loads_every_kv_page_and_the_window_that_ends_the_hit(runs, name):
    """SGLang's hybrid controller asks with a window of placeholder keys, loads the KV
    pages of the hit, then the SWA pages of its last two blocks, into SWA host slots of
    their own."""
    for r in runs[name]:
        assert r["cold_hit_tokens"] == 0
        assert r["hit_tokens"] == r["loaded_tokens"] == PAGES * 4
        assert r["pool_hit_pages"] == {"kv": PAGES, "swa": PAGES}
        assert r["pages_equal"] == [True] * PAGES
        assert r["swa_window_pages"] == [PAGES - 2, PAGES - 1]
        assert r["swa_pages_equal"] == [True, True]
        assert r["swa_loaded_pages"] == SWA_WINDOW
        assert r["hit_tokens_after"] == PAGES * 4
    # every KV page of each rank's heads, and the SWA pages of the window only
    assert stored_pages_by_group(runs, name) == {
        ("w2r0", "lg0"): PAGES,
        ("w2r1", "lg0"): PAGES,
        ("w2r0", "lg1"): SWA_WINDOW,
        ("w2r1", "lg1"): SWA_WINDOW,
    }


def test_the_hit_is_the_longest_prefix_whose_window_is_stored_not_the_kv_prefix(runs):
    """Every KV page is stored, the SWA pages of blocks 2, 3 and 5 only: a hit of 6
    needs blocks 4-5, of 5 blocks 3-4, so the hit is 4 blocks, and the load takes the
    SWA pages of blocks 2-3."""
    for r in runs["swa-window-holes"]:
        assert r["hit_tokens"] == r["loaded_tokens"] == 4 * 4
        assert r["pages_equal"] == [True] * 4
        assert r["swa_window_pages"] == [2, 3]
        assert r["swa_pages_equal"] == [True, True]
        assert r["hit_tokens_after"] == 4 * 4


def test_an_swa_page_lost_after_the_lookup_fails_its_load_and_the_next_lookup_misses(runs):
    """Rank 1's SWA page of block 5 is gone at the load: its SWA load stops there and
    leaves that slot untouched, SGLang's MIN tells both ranks one SWA page arrived, and
    with the window of 6 blocks broken (and none of 5 stored) the next lookup misses."""
    rank0, rank1 = runs["swa-window-page-evicted"]
    for r in (rank0, rank1):
        assert r["loaded_tokens"] == PAGES * 4 and r["pages_equal"] == [True] * PAGES
        assert r["swa_loaded_pages"] == 1
        assert r["hit_tokens_after"] == 0
    assert rank0["swa_pages_equal"] == [True, True]
    assert rank1["swa_pages_equal"] == [True, False]
    assert rank1["swa_pages_zero"] == [False, True]


def test_swa_heads_duplicated_on_both_ranks_are_stored_once_like_the_kv_heads(runs):
    """One KV head at TP=2 in both pools (SGLang's SWA head count is the model's, with
    no ``swa_num_key_value_heads``): the two ranks hold the same bytes, stored once."""
    name = "swa-gqa-duplicated"
    assert stored_pages_by_group(runs, name) == {
        ("replicated", "lg0"): PAGES,
        ("replicated", "lg1"): SWA_WINDOW,
    }
    for r in runs[name]:
        assert r["pages_equal"] == [True] * PAGES
        assert r["swa_pages_equal"] == [True, True]


# ------------------------------------------------ hybrid linear attention (MambaPoolHost)
MAMBA_CASES = ["mamba-layer-first", "mamba-page-first"]


@pytest.mark.parametrize("name", MAMBA_CASES)
def test_a_hybrid_mamba_model_loads_every_kv_page_and_the_state_at_the_hits_end(runs, name):
    """SGLang asks with one placeholder key for the Mamba pool, loads the KV pages of the
    hit, then the state of its last page into a state slot of its own."""
    for r in runs[name]:
        assert r["hit_tokens"] == r["loaded_tokens"] == PAGES * 4
        assert r["pool_hit_pages"] == {"kv": PAGES, "mamba": PAGES}
        assert r["mamba_window_pages"] == [PAGES - 1]
        assert r["mamba_pages_equal"] == [True]
        assert r["mamba_loaded_pages"] == 1
    # the state is split by heads over the ranks: one page per rank, at the last page
    assert stored_pages_by_group(runs, name) == {
        ("w2r0", "lg0"): PAGES,
        ("w2r1", "lg0"): PAGES,
        ("w2r0", "lg1"): 1,
        ("w2r1", "lg1"): 1,
    }


def test_a_stored_mamba_state_is_sglangs_own_flat_state_page(runs):
    """The value is ``MambaPoolHost.get_data_page``: the temporal state, then each conv
    state, every layer of the slot, then kvconn's checksum trailer."""
    name = "mamba-page-first"
    backend = load_backend("lmdb", {"path": str(runs["_root"] / name)})
    try:
        keys = {k.split("/")[2]: k for k, _ in backend.list_keys("") if "/lg1/" in k}
    finally:
        backend.close()
    checksum = PageChecksum()
    for r in runs[name]:
        case = Case(**r["case"])
        key = keys[f"w{WORLD}r{r['rank']}"]
        value = stored_value(runs, name, key)
        size = len(value) - checksum.size
        want = expected_page(case, case.shard_of(r["rank"]), PAGES - 1, size, torch.uint8, "mamba")
        assert value[:size] == bytes(want.numpy())
        assert checksum.verify([memoryview(value)], [key]) == [True]


def test_the_hit_ends_at_the_last_checkpoint_whose_state_is_stored(runs):
    """Every KV page is stored, states at pages 2 and 4 only: the hit is 5 pages (the
    state of page 4), not 6, and the state loaded is page 4's."""
    for r in runs["mamba-checkpoints"]:
        assert r["hit_tokens"] == r["loaded_tokens"] == 5 * 4
        assert r["pages_equal"] == [True] * 5
        assert r["mamba_window_pages"] == [4]
        assert r["mamba_pages_equal"] == [True]


def test_a_state_lost_after_the_lookup_fails_its_load_and_the_next_lookup_misses(runs):
    rank0, rank1 = runs["mamba-state-evicted"]
    for r in (rank0, rank1):
        assert r["pages_equal"] == [True] * PAGES
        assert r["mamba_loaded_pages"] == 0  # SGLang's MIN: rank 1 has no state
        assert r["hit_tokens_after"] == 0
    assert rank0["mamba_pages_equal"] == [True]
    assert rank1["mamba_pages_equal"] == [False] and rank1["mamba_pages_zero"] == [True]


# ------------------------------------------------ speculative decoding: draft KV pools
@pytest.mark.parametrize("name", ["draft-mha-page-first", "draft-mla-layer-first"])
def test_a_draft_pool_registered_after_start_up_is_stored_and_loaded_with_the_kv(runs, name):
    """SGLang registers the draft model's pool once its draft worker is up, after the
    storage started: the store's layout takes it in (the connector starts again, before
    any request), the backup writes its pages with the KV pool's, and the hit loads both
    byte for byte into the KV pool's host slots."""
    for r in runs[name]:
        assert r["pool_groups"] == {"kv": 0, "draft": 1}
        assert r["pool_hit_pages"] == {"kv": PAGES, "draft": PAGES}
        assert r["draft_pages_equal"] == [True] * PAGES, f"rank {r['rank']}"
    if name.startswith("draft-mha"):  # each rank its own heads of both models
        assert stored_pages_by_group(runs, name) == {
            (f"w{WORLD}r{rank}", group): PAGES for rank in range(WORLD) for group in ("lg0", "lg1")
        }
    else:  # the MLA latent and the MTP draft's latent: once, by rank 0
        assert stored_pages_by_group(runs, name) == {
            ("replicated", "lg0"): PAGES,
            ("replicated", "lg1"): PAGES,
        }
        assert [written(r) for r in runs[name]] == [2 * PAGES, 0]


def test_a_draft_head_duplicated_on_every_rank_is_stored_once_and_loaded_by_both(runs):
    """The draft model's config (``speculative_draft_model_path``) says 1 KV head at
    TP=2: both ranks hold the same head, so its pages are keyed once for the group
    (written by one rank or the other, spread by block hash), beside each rank's own
    target K/V; both ranks load the draft page byte for byte."""
    name = "draft-head-duplicated"
    for r in runs[name]:
        assert r["pool_hit_pages"] == {"kv": PAGES, "draft": PAGES}
        assert r["draft_pages_equal"] == [True] * PAGES, f"rank {r['rank']}"
    assert stored_pages_by_group(runs, name) == {
        **{(f"w{WORLD}r{rank}", "lg0"): PAGES for rank in range(WORLD)},
        ("replicated", "lg1"): PAGES,
    }
    assert sum(written(r) for r in runs[name]) == WORLD * PAGES + PAGES


def test_a_draft_page_lost_after_the_lookup_ends_the_load_there_on_both_ranks(runs):
    for r in runs["draft-page-evicted"]:
        assert r["hit_tokens"] == PAGES * 4
        assert r["loaded_tokens"] == 3 * 4
        assert r["pages_equal"] == [True] * 3 and r["draft_pages_equal"] == [True] * 3
        assert r["hit_tokens_after"] == 3 * 4
    rank1 = runs["draft-page-evicted"][1]
    assert rank1["draft_failed_pages_untouched"] == [True] * (PAGES - 3)
