"""Which Mamba states the scheduler side hands the workers to save or load (no engine).

vLLM's ``mamba_cache_mode="align"`` names each committed state's block in the step's
``kv_connector_block_state.boundary_state_offloads``; its Mamba block table is not
positional. The connector here is the scheduler's, built from vLLM's own spec objects
(Qwen3-Next: group 0 the Gated DeltaNet state, group 1 full attention, 256-token
blocks); the scheduler's outputs are stand-ins with the fields the connector reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from test_vllm_specs import connector, mamba_config, qwen3_next_groups

from kvconn.layout import NO_SLOT
from kvconn_vllm.connector import KvconnConnector, KvconnMetadata

BLOCK = 256


def request(blocks: int, req_id: str = "r") -> Any:
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[bytes([i]) * 32 for i in range(blocks)],
        num_tokens=blocks * BLOCK + 60,
    )


def step(
    conn: KvconnConnector,
    scheduled: dict[str, tuple[int, int]],
    offloads: dict[str, list[tuple[int, int, int]]] | None = None,
    new_ids: dict[str, tuple[list[int], list[int]]] | None = None,
) -> KvconnMetadata:
    """One step: ``scheduled`` {request: (computed before, tokens scheduled)} of running
    requests, the states vLLM names, the blocks it added."""
    ids = list(scheduled)
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=ids,
            new_block_ids=[(new_ids or {}).get(r) for r in ids],
            resumed_req_ids=set(),
            num_computed_tokens=[scheduled[r][0] for r in ids],
        ),
        num_scheduled_tokens={r: n for r, (_, n) in scheduled.items()},
        total_num_scheduled_tokens=sum(n for _, n in scheduled.values()),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offloads or {}),
    )
    meta = conn.build_connector_meta(output)  # type: ignore[arg-type]
    assert isinstance(meta, KvconnMetadata)
    return meta


def saves(
    conn: KvconnConnector, req: Any, meta: KvconnMetadata
) -> list[tuple[list[int], dict[int, list[int]]]]:
    """Each save's block positions in the request, and its slots per group."""
    position = {digest: i for i, digest in enumerate(conn._hashes(req))}
    return [([position[h] for h in s.hashes], s.slots) for s in meta.saves]


def allocated(
    conn: KvconnConnector, req: Any, ids: tuple[list[int], list[int]], external: int
) -> None:
    conn.update_state_after_alloc(
        req,
        SimpleNamespace(get_block_ids=lambda: ids),
        external,  # type: ignore[arg-type]
    )


def admitted(
    tiny_model: Callable[[str], Path], ids: tuple[list[int], list[int]], hit: int = 0
) -> tuple[KvconnConnector, Any]:
    """A scheduler-side connector and a 2-block request vLLM admitted with blocks ``ids``
    (per group), after a kvconn hit of ``hit`` blocks (else a lookup before any layout
    came from the workers: a miss)."""
    conn = connector(mamba_config(tiny_model("qwen3-next")), qwen3_next_groups())
    req = request(2)
    if hit:
        conn._hits["r"] = (0, hit)  # what get_num_new_matched_tokens found in the store
    else:
        conn.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    allocated(conn, req, ids, hit * BLOCK)
    return conn, req


def test_a_state_is_saved_from_the_block_vllm_names_not_from_its_table_position(
    tiny_model: Callable[[str], Path],
) -> None:
    """As vLLM runs a 700-token prompt in one-block steps: the first step fills block 0
    and names no state; the second names block 3 for the state after 512 tokens, while
    position 1 of the table holds block 3 and position 0 a running state (block 1)."""
    conn, req = admitted(tiny_model, ([1], [2]))
    assert saves(conn, req, step(conn, {"r": (0, 256)})) == [([0], {0: [NO_SLOT], 1: [2]})]
    meta = step(conn, {"r": (256, 256)}, {"r": [(0, 3, 512)]}, {"r": ([3], [4])})
    assert saves(conn, req, meta) == [([1], {0: [3], 1: [4]})]


def test_states_ending_mid_block_or_in_a_group_kvconn_does_not_store_are_not_saved(
    tiny_model: Callable[[str], Path],
) -> None:
    conn, req = admitted(tiny_model, ([1, 3], [2, 4]))
    meta = step(conn, {"r": (0, 512)}, {"r": [(0, 3, 300), (1, 4, 512), (0, 1, 256)]})
    assert saves(conn, req, meta) == [([0, 1], {0: [1, NO_SLOT], 1: [2, 4]})]


def test_a_state_named_before_its_blocks_attention_pages_are_saved_is_saved_on_its_own(
    tiny_model: Callable[[str], Path],
) -> None:
    conn, req = admitted(tiny_model, ([1, 3], [2, 4]))
    meta = step(conn, {"r": (0, 256)}, {"r": [(0, 3, 512)]})
    assert saves(conn, req, meta) == [([1], {0: [3], 1: [NO_SLOT]}), ([0], {0: [NO_SLOT], 1: [2]})]


def test_a_state_named_after_its_blocks_were_saved_is_saved_on_its_own(
    tiny_model: Callable[[str], Path],
) -> None:
    conn, req = admitted(tiny_model, ([1, 3], [2, 4]))
    step(conn, {"r": (0, 512)})
    meta = step(conn, {"r": (512, 1)}, {"r": [(0, 3, 512)]})
    assert saves(conn, req, meta) == [([1], {0: [3], 1: [NO_SLOT]})]


def test_the_state_a_hit_brought_is_not_saved_again(tiny_model: Callable[[str], Path]) -> None:
    """vLLM names the loaded state once the load is done and caches it; kvconn has it."""
    conn, _ = admitted(tiny_model, ([0, 5], [2, 4]), hit=2)
    assert step(conn, {"r": (512, 60)}, {"r": [(0, 5, 512)]}).saves == []


def test_a_hits_load_puts_the_state_in_the_block_allocated_at_its_end(
    tiny_model: Callable[[str], Path],
) -> None:
    conn, _ = admitted(tiny_model, ([0, 5], [2, 4]), hit=2)
    (load,) = step(conn, {}).loads
    assert load.slots == {0: [NO_SLOT, 5], 1: [2, 4]}
