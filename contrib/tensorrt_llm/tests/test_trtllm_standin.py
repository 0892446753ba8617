"""The TensorRT-LLM adapter in a TP group of two processes, against the stand-in API.

The stand-in (standin/, standin_executor.py) is written from TensorRT-LLM 1.2's
documented connector signatures, not taken from the engine: these tests show that the
adapter keeps kvconn's rules under that call order, not that TensorRT-LLM calls it so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from standin_executor import Scenario, run, stored_components

P = tuple(range(1000, 1022))  # 22 tokens: 5 full blocks of 4 and a partial one
SHARED = P[:16] + tuple(range(5000, 5006))  # the first 4 blocks of P, then its own
EXACT = tuple(range(7000, 7020))  # exactly 5 blocks


def config(tmp: Path, name: str, extra: str = "") -> dict[str, str]:
    path = tmp / f"{name}.toml"
    path.write_text(f'backend = "lmdb"\n[options]\npath = "{tmp / name}"\n{extra}')
    return {"KVCONN_CONFIG": str(path)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, served in turn by one TP group of two processes."""
    tmp = tmp_path_factory.mktemp("trtllm")
    scenarios = {
        "mha": Scenario((P, P, SHARED, EXACT, EXACT), env=config(tmp, "mha")),
        "gqa": Scenario(
            (P, P), heads=1, kv_heads=1, env=config(tmp, "gqa", "[tensorrt_llm]\nkv_heads = 1\n")
        ),
        "mla": Scenario((P, P), kv_factor=1, env=config(tmp, "mla")),
        "evict": Scenario((P, P), evict=(1, 2, "w2r1"), env=config(tmp, "evict")),
        "lora": Scenario((P, P, P), loras=(None, 7, 7), env=config(tmp, "lora")),
    }
    results = dict(zip(scenarios, run(list(scenarios.values()))))
    for name, ranks in results.items():
        for r in ranks:
            assert "error" not in r, f"{name}, rank {r['rank']}:\n{r['error']}"
    return results, tmp


def written(rank: dict) -> int:
    return rank["kvconn"]["total"].get("written", {}).get("pages", 0)


def test_a_repeated_prompt_loads_identical_bytes_on_every_rank(runs):
    for r in runs[0]["mha"]:
        first, second = r["requests"][:2]
        assert first["matched_tokens"] == 0
        assert second["matched_tokens"] == 20
        assert second["loaded_equal"] == [True] * 5
        assert "load_error" not in second


def test_a_prompt_sharing_a_prefix_loads_only_the_shared_blocks(runs):
    for r in runs[0]["mha"]:
        shared = r["requests"][2]
        assert shared["matched_tokens"] == 16
        assert shared["loaded_equal"] == [True] * 4


def test_a_fully_stored_prompt_still_computes_its_last_block(runs):
    # 20 tokens = 5 full blocks, all stored: the engine must compute at least one token
    assert [r["requests"][4]["matched_tokens"] for r in runs[0]["mha"]] == [16, 16]


def test_each_ranks_distinct_heads_are_stored_as_its_own_pages(runs):
    results, tmp = runs
    # P: 5 blocks, SHARED: 1 new full block, EXACT: 5 blocks — per rank
    assert stored_components(str(tmp / "mha")) == {"w2r0": 11, "w2r1": 11}
    assert [written(r) for r in results["mha"]] == [11, 11]


def test_loads_and_saves_finish_within_the_step(runs):
    for r in runs[0]["mha"]:
        for entry in r["requests"]:
            assert entry["is_async"] is False
            assert entry["finished"] == ([], [])


def test_a_gqa_head_duplicated_on_both_ranks_is_stored_once_with_writes_spread(runs):
    results, tmp = runs
    assert stored_components(str(tmp / "gqa")) == {"replicated": 5}
    assert sum(written(r) for r in results["gqa"]) == 5
    assert all(written(r) > 0 for r in results["gqa"])
    for r in results["gqa"]:
        assert r["requests"][1]["loaded_equal"] == [True] * 5


def test_mla_latent_pages_are_stored_once_for_the_group(runs):
    results, tmp = runs
    assert stored_components(str(tmp / "mla")) == {"replicated": 5}
    assert sum(written(r) for r in results["mla"]) == 5
    for r in results["mla"]:
        assert r["requests"][1]["loaded_equal"] == [True] * 5


def test_a_page_evicted_after_lookup_fails_the_load_loudly_leaving_slots_untouched(runs):
    rank0, rank1 = (r["requests"][1] for r in runs[0]["evict"])
    assert rank0["matched_tokens"] == rank1["matched_tokens"] == 20
    assert "load_error" not in rank0
    assert "KvconnLoadError" in rank1["load_error"]
    assert "request 1: blocks 2.." in rank1["load_error"]
    assert rank1["loaded_equal"][:2] == [True, True]
    assert rank1["untouched"][2:] == [True, True, True]


def test_the_same_prompt_under_another_lora_adapter_misses(runs):
    for r in runs[0]["lora"]:
        assert [e["matched_tokens"] for e in r["requests"]] == [0, 0, 20]
        assert r["requests"][2]["loaded_equal"] == [True] * 5
