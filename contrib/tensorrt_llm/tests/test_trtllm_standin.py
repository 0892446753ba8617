"""The TensorRT-LLM adapter in a TP group of two processes, against the stand-in API.

The stand-in (standin/, standin_executor.py) reproduces the calls TensorRT-LLM 1.2's
executor makes, as read from the engine's source (docs/engines/tensorrt-llm.md): these
tests show that the adapter keeps kvconn's rules under that call order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from standin_executor import Scenario, run, stored_components

P = tuple(range(1000, 1022))  # 22 tokens: 5 full blocks of 4 and a partial one
SHARED = P[:16] + tuple(range(5000, 5006))  # the first 4 blocks of P, then its own
EXACT = tuple(range(7000, 7020))  # exactly 5 blocks
LONG = tuple(range(3000, 3040))  # 10 blocks
LONG_SHARED = LONG[:16] + tuple(range(6000, 6024))  # 4 blocks of LONG, then 6 of its own
# a prompt with an image: 8 text tokens (blocks 0-1), 8 placeholder tokens (blocks 2-3),
# then 6 text tokens; which image the placeholders stand for is only in its hash
V = tuple(range(1000, 1008)) + (32000,) * 8 + tuple(range(1016, 1022))
IMAGE_A = ((1, 2, 3, 4, 5, 6, 7, -5), 8, 8)  # words are int32: negative ones occur
IMAGE_B = ((9, 10, 11, 12, 13, 14, 15, 16), 8, 8)


def config(tmp: Path, name: str, extra: str = "", top: str = "") -> dict[str, str]:
    """A kvconn config file: ``top`` settings, LMDB in ``tmp/name``, then ``extra`` tables."""
    path = tmp / f"{name}.toml"
    path.write_text(f'backend = "lmdb"\n{top}[options]\npath = "{tmp / name}"\n{extra}')
    return {"KVCONN_CONFIG": str(path)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, served in turn by one TP group of two processes.

    The eviction scenario comes last: before the adapter failed loads inside the forward,
    it stopped a rank's executor, which leaves the group unable to serve anything after.
    """
    tmp = tmp_path_factory.mktemp("trtllm")
    scenarios = {
        "mha": Scenario((P, P, SHARED, EXACT, EXACT), env=config(tmp, "mha")),
        "gqa": Scenario(
            (P, P), heads=1, kv_heads=1, env=config(tmp, "gqa", "[tensorrt_llm]\nkv_heads = 1\n")
        ),
        "mla": Scenario((P, P), kv_factor=1, env=config(tmp, "mla")),
        "lora": Scenario((P, P, P), loras=(None, 7, 7), env=config(tmp, "lora")),
        "salt": Scenario((P, P, P, P), salts=(None, 11, 12, 11), env=config(tmp, "salt")),
        "vlm": Scenario(
            (V, V, V, V),
            images=((IMAGE_A,), (IMAGE_A,), (IMAGE_B,), (IMAGE_B,)),
            env=config(tmp, "vlm"),
        ),
        "unhashed": Scenario(
            (V, V),
            images=((IMAGE_A,), (IMAGE_A,)),
            unhashed_images=True,
            env=config(tmp, "unhashed"),
        ),
        "chunked": Scenario(
            (LONG, LONG_SHARED, LONG), chunk=8, max_tokens=3, env=config(tmp, "chunked")
        ),
        "slow": Scenario((P, P, SHARED), slow_put_s=0.3, env=config(tmp, "slow")),
        # K/V on both ranks, read once for the pair over a gloo group built from MPI
        "striped": Scenario(
            (P, P),
            heads=1,
            kv_heads=1,
            env=config(tmp, "striped", "[tensorrt_llm]\nkv_heads = 1\n", "stripe_reads = true\n"),
        ),
        "evict": Scenario((P, P, P), evict=(1, 2, "w2r1"), env=config(tmp, "evict")),
    }
    results = dict(zip(scenarios, run(list(scenarios.values()))))
    return results, tmp


def served(runs, name: str) -> list[dict]:
    """The scenario's report of each rank; a rank that failed outside the engine fails."""
    ranks = runs[0][name]
    for r in ranks:
        assert "error" not in r, f"{name}, rank {r['rank']}:\n{r['error']}"
    return ranks


def written(rank: dict) -> int:
    return rank["kvconn"]["total"].get("written", {}).get("pages", 0)


def test_a_repeated_prompt_loads_identical_bytes_on_every_rank(runs):
    for r in served(runs, "mha"):
        first, second = r["requests"][:2]
        assert first["matched_tokens"] == 0
        assert second["matched_tokens"] == 20
        assert second["loaded_equal"] == [True] * 5
        assert "error" not in second


def test_a_prompt_sharing_a_prefix_loads_only_the_shared_blocks(runs):
    for r in served(runs, "mha"):
        shared = r["requests"][2]
        assert shared["matched_tokens"] == 16
        assert shared["loaded_equal"] == [True] * 4


def test_a_block_completed_in_the_step_after_an_asynchronous_load_is_saved_in_that_step(runs):
    # SHARED loads 16 tokens (out of the batch for a step), then computes 6: its 5th
    # block is done after that one step, and the request finishes in it.
    for r in served(runs, "mha"):
        shared = r["requests"][2]
        assert shared["handed_over_by_step"] == [1]
        assert shared["steps"] >= 2  # at least one step out of the batch, loading


def test_a_fully_stored_prompt_still_computes_its_last_block(runs):
    # 20 tokens = 5 full blocks, all stored: the engine must compute at least one token
    assert [r["requests"][4]["matched_tokens"] for r in served(runs, "mha")] == [16, 16]


def test_each_ranks_distinct_heads_are_stored_as_its_own_pages(runs):
    _, tmp = runs
    # P: 5 blocks, SHARED: 1 new full block, EXACT: 5 blocks — per rank
    assert stored_components(str(tmp / "mha")) == {"w2r0": 11, "w2r1": 11}
    assert [written(r) for r in served(runs, "mha")] == [11, 11]


def test_loads_and_finished_saves_are_reported_through_get_finished(runs):
    for r in served(runs, "mha"):
        for i, entry in enumerate(r["requests"]):
            saved = i in {e for _, (s, _) in entry["finished_log"] for e in s}
            loaded = i in {e for _, (_, ld) in entry["finished_log"] for e in ld}
            assert entry["saving_async"] == [saved]  # held only while it had saves
            assert loaded == (entry["matched_tokens"] > 0)


def test_blocks_reused_as_soon_as_get_finished_releases_them_never_reach_the_store(runs):
    """A slow store: every save is still being stored when its request finishes, and the
    executor overwrites the whole pool the moment blocks are released. What the store
    ends up holding is still each block's own bytes: later requests load them intact."""
    for r in served(runs, "slow"):
        first, again, shared = r["requests"]
        assert first["saving_async"] == [True]
        assert again["matched_tokens"] == 20 and again["loaded_equal"] == [True] * 5
        assert shared["matched_tokens"] == 16 and shared["loaded_equal"] == [True] * 4


def test_a_gqa_head_duplicated_on_both_ranks_is_stored_once_with_writes_spread(runs):
    _, tmp = runs
    assert stored_components(str(tmp / "gqa")) == {"replicated": 5}
    assert sum(written(r) for r in served(runs, "gqa")) == 5
    assert all(written(r) > 0 for r in served(runs, "gqa"))
    for r in served(runs, "gqa"):
        assert r["requests"][1]["loaded_equal"] == [True] * 5


def test_mla_latent_pages_are_stored_once_for_the_group(runs):
    _, tmp = runs
    assert stored_components(str(tmp / "mla")) == {"replicated": 5}
    assert sum(written(r) for r in served(runs, "mla")) == 5
    for r in served(runs, "mla"):
        assert r["requests"][1]["loaded_equal"] == [True] * 5


def counted(rank: dict, event: str) -> int:
    return rank["kvconn"]["total"].get(event, {}).get("pages", 0)


def test_with_stripe_reads_the_pair_reads_each_shared_page_once_and_loads_identical_bytes(
    runs,
):
    striped, alone = served(runs, "striped"), served(runs, "gqa")  # the same shape
    for r in striped:
        assert r["requests"][1]["loaded_equal"] == [True] * 5
    assert sum(counted(r, "store_read") for r in alone) == 10  # both ranks read all five
    assert sum(counted(r, "store_read") for r in striped) == 5  # once for the pair
    assert sum(counted(r, "group_received") for r in striped) == 5
    assert all(counted(r, "loaded") == 5 for r in striped)


def test_with_stripe_reads_the_pair_compares_its_shared_k_v_from_the_first_save_and_agrees(
    runs,
):
    """The group stripe_reads builds also carries replica checks (verify_replicas_every,
    default 1000): the first save's blocks are compared on both ranks, found equal."""
    for r in served(runs, "striped"):
        assert r["kvconn"]["replicas_verified"] > 0
        assert r["kvconn"]["replica_mismatch"] == 0 and r["kvconn"]["per_rank"] == []
    for r in served(runs, "gqa"):  # no group: nothing compared
        assert r["kvconn"]["replicas_verified"] == 0


def test_the_same_prompt_under_another_lora_adapter_misses(runs):
    for r in served(runs, "lora"):
        assert [e["matched_tokens"] for e in r["requests"]] == [0, 0, 20]
        assert r["requests"][2]["loaded_equal"] == [True] * 5


def test_the_same_prompt_under_another_cache_salt_misses_and_under_its_own_hits(runs):
    # TensorRT-LLM's cache_salt_id keeps tenants apart in its own block reuse; kvconn's
    # store must not join what the engine keeps apart
    for r in served(runs, "salt"):
        assert [e["matched_tokens"] for e in r["requests"]] == [0, 0, 0, 20]
        assert r["requests"][3]["loaded_equal"] == [True] * 5


def test_a_prompt_with_another_image_shares_only_the_text_blocks_before_it(runs):
    _, tmp = runs
    for r in served(runs, "vlm"):
        same, other, other_again = r["requests"][1:]
        assert same["matched_tokens"] == 20 and same["loaded_equal"] == [True] * 5
        # blocks 0-1 are text before the image: shared; block 2 holds image B, not A
        assert other["matched_tokens"] == 8 and other["loaded_equal"] == [True] * 2
        assert other_again["matched_tokens"] == 20 and other_again["loaded_equal"] == [True] * 5
    # blocks 0-1 once, blocks 2-4 under each image: per rank
    assert stored_components(str(tmp / "vlm")) == {"w2r0": 8, "w2r1": 8}


def test_images_without_hashes_are_neither_looked_up_nor_saved(runs):
    _, tmp = runs
    for r in served(runs, "unhashed"):
        assert [e["matched_tokens"] for e in r["requests"]] == [0, 0]
        assert written(r) == 0
    assert stored_components(str(tmp / "unhashed")) == {}


def test_chunked_prefill_saves_each_chunks_blocks_in_its_own_step(runs):
    _, tmp = runs
    for r in served(runs, "chunked"):
        long, shared, again = r["requests"]
        # LONG: chunks of 8 tokens, then two generated tokens; no block saved twice
        assert long["handed_over_by_step"] == [2, 2, 2, 2, 2, 0, 0]
        # 16 tokens loaded, then chunks 16-24, 24-32, 32-40
        assert shared["matched_tokens"] == 16
        assert shared["loaded_equal"] == [True] * 4
        assert shared["handed_over_by_step"] == [2, 2, 2, 0, 0]
        # all 10 blocks stored; the engine still computes the prompt's last token
        assert again["matched_tokens"] == 36
        assert again["loaded_equal"] == [True] * 9
    assert stored_components(str(tmp / "chunked")) == {"w2r0": 16, "w2r1": 16}


def test_a_page_evicted_after_lookup_fails_the_request_on_every_rank_and_serving_goes_on(runs):
    _, tmp = runs
    ranks = served(runs, "evict")
    assert not any(r.get("stopped") for r in ranks)
    for r in ranks:
        failed = r["requests"][1]
        assert "fatal" not in failed
        assert "KvconnLoadError" in failed["error"]
        assert "request(s) [1]" in failed["error"]
        assert failed["handed_over_by_step"] == []  # nothing computed from stale KV is saved
    loaded = ranks[1]["requests"][1]
    assert loaded["loaded_equal"][:2] == [True, True]
    assert loaded["untouched"][2:] == [True, True, True]
    for r in ranks:  # the next request loads what is left and stores the rest again
        after = r["requests"][2]
        assert after["matched_tokens"] == 8
        assert after["loaded_equal"] == [True, True]
        assert "error" not in after
    assert stored_components(str(tmp / "evict")) == {"w2r0": 5, "w2r1": 5}
