"""kvconn behind SGLang's real HiCache controller on real store servers: Redis and
Mooncake Store, started on loopback ports by these tests (``kvconn.tools.devserver``).

These run in ``nox -s sglang_stores``, an environment with the stores' clients
(``contrib/requirements-stores.txt``); ``nox -s sglang`` leaves them out, and this module
with them (the ``stores`` marker). Both backends declare their clients safe to share, so
the controller's threads (backup, prefetch, prefetch I/O) call them concurrently, over
the network, in a TP group of two real processes; the cases are those of
``test_hicache_tp_group.py`` that differ in what each rank writes and reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from harness import WORLD, Case, expected_flat_kv_page, run_cases, written

from kvconn.integrity import PageChecksum
from kvconn.registry import load_backend
from kvconn.testing.suite import require_or_skip

pytestmark = [pytest.mark.stores, pytest.mark.slow]

#: More pages than test_hicache_tp_group's, so a batch carries several keys per thread.
PAGES = 24
DSA_PAGE = 64  # SGLang's DSA pool takes 64-token pages only
DSA_PAGES = 6


def extra_config(name: str, store: str, options: dict[str, Any]) -> dict[str, Any]:
    kvconn = {"model": "test/model@rev", "namespace": name, "backend": store, "options": options}
    return {
        "backend_name": "kvconn",
        "module_path": "kvconn_sglang",
        "class_name": "KvconnHiCacheStorage",
        "interface_v1": 1,
        "kvconn": kvconn,
    }


#: name -> (store, Case keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "redis-mha-layer-first": ("redis", {}),
    "mooncake-mha-layer-first": ("mooncake", {}),
    "mooncake-mha-page-first": ("mooncake", {"layout": "page_first"}),
    # one KV head for the model at TP=2: both ranks hold it, the writes are spread
    "mooncake-gqa-duplicated": ("mooncake", {"heads": 1, "kv_heads": 1}),
    # the MLA latent and DeepSeek-V3.2's indexer: rank 0 saves, both ranks load
    "mooncake-dsa-layer-first": ("mooncake", {"model": "dsa", "page_size": DSA_PAGE}),
    # MiniMax-M3's sparse attention: each rank's K/V, the index keys once for both
    "mooncake-minimax-page-first": (
        "mooncake",
        {"model": "minimax", "layers": 3, "layout": "page_first"},
    ),
    # MiniMax-M3.1's NVFP4 page rows: K/V rows per rank, index rows once
    "redis-minimax-nvfp4-layer-first": (
        "redis",
        {"model": "minimax-nvfp4", "page_size": 128, "head_dim": 128},
    ),
    # a hybrid sliding-window model: the KV pages and the SWA pages of a 2-page window
    "mooncake-swa-page-first": ("mooncake", {"model": "swa", "layout": "page_first"}),
    # a hybrid linear-attention model: the KV pages and the state of the last page
    "redis-mamba-layer-first": ("redis", {"model": "mamba"}),
    # a draft model's pool registered after the storage started: the connector (and
    # its Mooncake client) starts again with it
    "mooncake-eagle-draft": ("mooncake", {"draft": True, "layout": "page_first"}),
}


def pages_of(name: str) -> int:
    return DSA_PAGES if CASES[name][1].get("model") == "dsa" else PAGES


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    from kvconn.tools.devserver.mooncake import MooncakeCluster
    from kvconn.tools.devserver.redis import RedisServer

    require_or_skip(RedisServer.available())
    require_or_skip(MooncakeCluster.available())
    with contextlib.ExitStack() as stack:
        # Mooncake's transfer engines (the ranks', this process's) would advertise a
        # non-loopback address without it
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        redis = stack.enter_context(RedisServer())
        mooncake = stack.enter_context(MooncakeCluster(segment_size=256 * 2**20))
        yield {"redis": redis, "mooncake": mooncake}


@pytest.fixture(scope="module")
def runs(servers: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    cases = [
        Case(
            name,
            pages=pages_of(name),
            extra_config=extra_config(name, store, servers[store].options),
            **kwargs,
        )
        for name, (store, kwargs) in CASES.items()
    ]
    results = run_cases(cases)
    out = dict(zip(CASES, results))
    for name, ranks in out.items():
        for r in ranks:
            assert "error" not in r, f"{name} failed on rank {r['rank']}:\n{r['error']}"
    return out


def stored_value(servers: dict[str, Any], name: str, key: str, size: int) -> bytes:
    """The value under ``key`` in the case's server, read by a client of this process."""
    store = CASES[name][0]
    backend = load_backend(store, dict(servers[store].options))
    try:
        buffer = bytearray(size)
        assert backend.get([key], [memoryview(buffer)]) == [True], key
        return bytes(buffer)
    finally:
        backend.close()


@pytest.mark.parametrize("name", list(CASES))
def test_a_cold_prompt_misses_and_its_second_pass_loads_identical_bytes_from_the_server(
    runs: dict[str, Any], name: str
) -> None:
    pages = pages_of(name)
    for r in runs[name]:
        case = Case(**r["case"])
        assert r["storage_class"] == "KvconnHiCacheStorage"
        assert r["cold_hit_tokens"] == 0
        assert r["hit_tokens"] == pages * case.page_size
        assert r["loaded_tokens"] == pages * case.page_size
        assert r["pages_equal"] == [True] * pages, f"rank {r['rank']}"
        if case.indexer:
            assert r["indexer_pages_equal"] == [True] * pages, f"rank {r['rank']} indexer"
        if case.model == "swa":  # the window that ends the hit, from its own host slots
            assert r["swa_window_pages"] == [pages - 2, pages - 1]
            assert r["swa_pages_equal"] == [True, True], f"rank {r['rank']} swa"
        if case.draft:  # the draft's pages, loaded with the KV into the KV pool's slots
            assert r["pool_groups"] == {"kv": 0, "draft": 1}
            assert r["draft_pages_equal"] == [True] * pages, f"rank {r['rank']} draft"
        if case.model == "mamba":  # the state at the hit's end, from its own state slot
            assert r["mamba_window_pages"] == [pages - 1]
            assert r["mamba_pages_equal"] == [True], f"rank {r['rank']} mamba"


@pytest.mark.parametrize("name", [n for n in CASES if "mha" in n])
def test_distinct_heads_on_each_rank_are_written_once_per_rank(
    runs: dict[str, Any], name: str
) -> None:
    assert [written(r) for r in runs[name]] == [PAGES] * WORLD


def test_a_sliding_window_models_ranks_each_write_their_kv_and_their_window(
    runs: dict[str, Any],
) -> None:
    ranks = runs["mooncake-swa-page-first"]
    assert [written(r) for r in ranks] == [PAGES + 2] * WORLD
    for r in ranks:
        by_role = r["kvconn"]["by_role"]["written"]
        assert {role: n["pages"] for role, n in by_role.items()} == {
            "k": PAGES,
            "v": PAGES,
            "swa_k": 2,
            "swa_v": 2,
        }


def test_minimax_m3s_index_keys_are_written_once_for_both_ranks_with_the_writes_spread(
    runs: dict[str, Any],
) -> None:
    for name in ("mooncake-minimax-page-first", "redis-minimax-nvfp4-layer-first"):
        written_by_role = [r["kvconn"]["by_role"]["written"] for r in runs[name]]
        for by_role in written_by_role:
            roles = ("kv",) if "nvfp4" in name else ("k", "v")  # packed rows: one role
            assert [by_role[role]["pages"] for role in roles] == [PAGES] * len(roles)
        index = [by_role.get("index_k", {}).get("pages", 0) for by_role in written_by_role]
        assert sum(index) == PAGES and all(n > 0 for n in index), (name, index)


def test_a_head_duplicated_on_both_ranks_is_written_once_with_the_writes_spread(
    runs: dict[str, Any],
) -> None:
    per_rank = [written(r) for r in runs["mooncake-gqa-duplicated"]]
    assert sum(per_rank) == PAGES
    assert all(n > 0 for n in per_rank), per_rank


def test_deepseek_v32_latent_and_indexer_are_written_once_by_rank_0(
    runs: dict[str, Any],
) -> None:
    rank0, rank1 = runs["mooncake-dsa-layer-first"]
    assert written(rank1) == 0
    by_role = rank0["kvconn"]["by_role"]["written"]
    assert {role: n["pages"] for role, n in by_role.items()} == {
        "latent": DSA_PAGES,
        "index_k": DSA_PAGES,
    }


@pytest.mark.parametrize("name", [n for n in CASES if "layer-first" in n and "mha" in n])
def test_the_server_holds_sglangs_own_flat_page_with_its_checksum(
    runs: dict[str, Any], servers: dict[str, Any], name: str
) -> None:
    for r in runs[name]:
        want = bytes(expected_flat_kv_page(Case(**r["case"]), r["rank"], 0).numpy())
        key = r["first_page_keys"][0]
        assert key.startswith(f"{name}/")  # under the case's namespace
        checksum = PageChecksum()
        value = stored_value(servers, name, key, len(want) + checksum.size)
        assert value[: -checksum.size] == want
        assert checksum.verify([memoryview(value)], [key]) == [True]
