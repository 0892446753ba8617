"""What engine adapters need from the core: lookup without tensors, engine block hashes,
and saves whose writer the engine picks (core logic over an in-memory store)."""

import json

import pytest
import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import ConfigError
from kvconn.hashing import adopt_hashes
from kvconn.layout import KvLayout
from kvconn.tools.models import RoleSpec, interleaved_layout, minimax_m3
from tests.fakes import DictBackend
from tests.helpers import fill_pool, slot_bytes, tp_group

VLLM_HASHES = [bytes([i]) * 32 for i in range(4)]
SLOTS = [3, 0, 7, 5]


def test_a_connector_without_pools_answers_lookups_from_a_layout_dict():
    layout = minimax_m3(tp_size=8, layers=2, num_slots=16)
    store = DictBackend()
    hashes = adopt_hashes("vllm:sha256", VLLM_HASHES)
    for conn in tp_group(layout, store):
        conn.save(hashes[:3], SLOTS[:3])
    shipped = json.loads(json.dumps(layout.to_dict()))  # what a worker sends its scheduler
    scheduler = Connector(
        ConnectorConfig(model="test-model", backend="dict"),
        KvLayout.from_dict(shipped),
        backend=store,
    )
    assert scheduler.pools == []
    hit = scheduler.lookup(hashes)
    assert (hit.blocks, hit.tokens) == (3, 96)
    with pytest.raises(ConfigError, match="no KV pools"):
        scheduler.load(hashes[:1], [0])


def test_engine_hashes_adopted_by_two_schemes_store_separate_pages():
    layout = minimax_m3(tp_size=2, layers=1, num_slots=8)
    store = DictBackend()
    group = tp_group(layout, store)
    for conn in group:
        conn.save(adopt_hashes("vllm:sha256", VLLM_HASHES), SLOTS)
    other = adopt_hashes("trtllm:sha256", VLLM_HASHES)  # the same bytes, another engine
    assert group[0].lookup(other).blocks == 0
    assert group[0].lookup(adopt_hashes("vllm:sha256", VLLM_HASHES)).blocks == 4


def test_a_rank_saving_under_the_all_policy_writes_every_page_it_holds():
    # All-replicated bytes (an MLA latent) at TP=4: the engine saves from rank 0 only.
    layout = interleaved_layout(
        (RoleSpec("latent", 64, 1, "bf16"),), tp_size=4, layers=2, num_slots=8, tokens_per_block=4
    )
    store = DictBackend()
    group = tp_group(layout, store)
    hashes = adopt_hashes("e", VLLM_HASHES)
    spread = group[0].save(hashes, SLOTS)
    assert spread.written < 4  # under spread rank 0 owns only some blocks
    store.data.clear()
    first = group[0].save(hashes, SLOTS, writer_policy="all")
    assert (first.written, first.skipped) == (4, 0)
    again = group[0].save(hashes, SLOTS, writer_policy="all")
    assert (again.written, again.skipped) == (0, 4)  # what is stored is still skipped
    reader_pools = [torch.zeros(s, dtype=torch.uint8) for s in layout.pool_sizes]
    reader = Connector(group[0].config, layout, rank=3, pools=reader_pools, backend=store)
    assert reader.load(hashes, [1, 2, 4, 6]).loaded == 4
    assert slot_bytes(layout, reader_pools, 2) == slot_bytes(layout, group[0].pools, SLOTS[1])


def test_the_all_policy_can_be_configured_and_an_unknown_override_is_refused():
    config = ConnectorConfig.from_dict({"model": "m", "backend": "dict", "writer_policy": "all"})
    layout = minimax_m3(tp_size=2, layers=1, num_slots=4)
    pools = [torch.zeros(s, dtype=torch.uint8) for s in layout.pool_sizes]
    fill_pool(layout, 1, pools)
    conn = Connector(config, layout, rank=1, pools=pools, backend=DictBackend())
    hashes = adopt_hashes("e", VLLM_HASHES[:2])
    assert conn.save(hashes, [0, 1]).written == 2 * len(conn.shares)
    with pytest.raises(ConfigError, match="unknown writer_policy 'rank0'"):
        conn.save(hashes, [0, 1], writer_policy="rank0")
