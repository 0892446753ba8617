"""The connector's rules over an in-memory store (core logic only; backends have their own)."""

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvconn.backend as backend_module
from kvconn.backend import VettedKeys
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import (
    ArgumentError,
    BackendUnavailable,
    ConfigError,
    InvalidKeyError,
    KvconnError,
    LayoutError,
)
from kvconn.hashing import ReuseScope, block_hashes
from kvconn.integrity import PageChecksum
from kvconn.keys import LAYOUT, parse_key, parse_manifest_key
from kvconn.layout import NO_SLOT, Chunked, KvLayout, LayerGroup, Region, Role
from kvconn.manifest import PageManifest
from kvconn.plan import WriterPolicy, share_key
from kvconn.tools.models import RoleSpec, interleaved_layout, minimax_m3
from tests.fakes import DictBackend
from tests.helpers import slot_bytes, tp_group

N = 6
TRAILER = PageChecksum().size  # the default scheme's, after every stored page
HASHES = block_hashes(list(range(32 * N)), 32)
SLOTS = [5, 1, 9, 3, 7, 11]


@pytest.fixture
def store():
    return DictBackend()


def save_all(group, hashes=HASHES, slots=SLOTS):
    return [c.save(hashes, slots) for c in group]


def page_values(store):
    """The stored pages, without the layout manifests (metadata, not page bytes)."""
    return {k: v for k, v in store.data.items() if parse_manifest_key(k) is None}


def payload_bytes(store):
    """Bytes of the stored pages, less each value's checksum trailer."""
    return sum(len(v) - TRAILER for v in page_values(store).values())


def manifest_values(store):
    return {k: v for k, v in store.data.items() if parse_manifest_key(k) is not None}


class RecordingStore(DictBackend):
    """Records the keys of every put; can fail or refuse the layout manifests' puts."""

    def __init__(self) -> None:
        super().__init__()
        self.put_batches: list[list[str]] = []
        self.manifests_fail: str | None = None  # "raise" (backend down) or "refuse"

    def _put(self, keys, values):
        self.put_batches.append(list(keys))
        if self.manifests_fail and any(f"/{LAYOUT}/" in k for k in keys):
            self.calls.append(("put", len(keys)))
            if self.manifests_fail == "raise":
                raise BackendUnavailable("dict store is down")
            return [False] * len(keys)
        return super()._put(keys, values)

    def manifest_batches(self) -> list[list[str]]:
        return [b for b in self.put_batches if any(f"/{LAYOUT}/" in k for k in b)]


def test_only_the_designated_writer_writes_the_replicated_page(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    save_all(group)
    replicated = [c.stats.by_class[("written", "replicated")].pages for c in group]
    assert sum(replicated) == N  # one writer per block, no copies
    replicated_keys = [k for k in store.data if "/replicated/" in k]
    assert len(replicated_keys) == N
    for conn in group:
        share = conn.shares[-1]
        expected = sum(1 for h in HASHES if int.from_bytes(h[:8], "little") % 8 == conn.rank)
        assert share.plan.shard_class.replicated
        assert conn.stats.by_class[("written", "replicated")].pages == expected


def test_every_rank_writes_its_own_shard_page_of_every_block(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    save_all(group)
    for rank in range(8):
        assert sum(f"/w8r{rank}/" in k for k in store.data) == N


def test_a_prefix_hit_needs_the_replicated_page(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    save_all(group)
    assert group[0].lookup(HASHES).blocks == N
    evicted = next(k for k in store.data if "/replicated/" in k and k.endswith(HASHES[2].hex()))
    del store.data[evicted]
    assert {c.lookup(HASHES).blocks for c in group} == {2}  # every rank reads the miss


def test_a_prefix_hit_needs_every_shards_page(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    save_all(group)
    del store.data[next(k for k in store.data if "/w8r5/" in k and k.endswith(HASHES[1].hex()))]
    assert [c.lookup(HASHES).blocks for c in group] == [1] * 8
    assert group[0].lookup(HASHES).tokens == 32


def test_lookup_is_one_batched_exists_call_for_the_whole_group(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    save_all(group)
    store.calls.clear()
    group[3].lookup(HASHES)
    assert store.calls == [("exists", N * (8 + 1))]


def test_loaded_pages_restore_every_ranks_bytes_into_other_slots(store):
    layout = minimax_m3(tp_size=8)
    writers = tp_group(layout, store)
    save_all(writers)
    readers = tp_group(layout, store, fill=False)
    target = [20, 21, 22, 40, 41, 63]
    for w, r in zip(writers, readers):
        result = r.load(HASHES, target)
        assert result.loaded == N and result.ok
        for src, dst in zip(SLOTS, target):
            assert slot_bytes(layout, r.pools, dst) == slot_bytes(layout, w.pools, src)


def test_a_failed_page_fails_its_block_and_every_later_block(store):
    layout = minimax_m3(tp_size=8)
    writers = tp_group(layout, store)
    save_all(writers)
    readers = tp_group(layout, store, fill=False)
    assert readers[0].lookup(HASHES).blocks == N
    del store.data[
        next(k for k in store.data if "/replicated/" in k and k.endswith(HASHES[3].hex()))
    ]
    result = readers[6].load(HASHES, SLOTS)
    assert result.loaded == 3 and result.failed == (3, 4, 5)
    for slot in SLOTS[3:]:  # the slots of failed blocks were not written at all
        assert set(slot_bytes(layout, readers[6].pools, slot)) == {0}
    for slot, src in zip(SLOTS[:3], SLOTS[:3]):
        assert slot_bytes(layout, readers[6].pools, slot) == slot_bytes(
            layout, writers[6].pools, src
        )
    assert readers[6].stats.pages("failed") == 3 * 2


class _ScribblingStore(DictBackend):
    """Uses its licence under ``get(scratch=True)``: every buffer is scribbled on first."""

    def _get(self, keys, buffers, *, scratch):  # type: ignore[no-untyped-def]
        if scratch:
            for buffer in buffers:
                buffer[:] = b"\xee" * buffer.nbytes
        return super()._get(keys, buffers, scratch=scratch)


def test_bytes_a_failed_scratch_get_leaves_in_staging_never_reach_a_slot():
    store = _ScribblingStore()
    layout = minimax_m3(tp_size=8)
    writers = tp_group(layout, store)
    save_all(writers)
    del store.data[next(k for k in store.data if "/w8r2/" in k and k.endswith(HASHES[2].hex()))]
    reader = tp_group(layout, store, fill=False)[2]
    result = reader.load(HASHES, SLOTS)
    assert result.loaded == 2 and result.failed == (2, 3, 4, 5)
    for slot in SLOTS[2:]:
        assert set(slot_bytes(layout, reader.pools, slot)) == {0}
    for slot in SLOTS[:2]:
        assert slot_bytes(layout, reader.pools, slot) == slot_bytes(layout, writers[2].pools, slot)


def test_a_stored_page_of_the_wrong_size_is_a_failed_load(store):
    layout = minimax_m3(tp_size=8)
    writers = tp_group(layout, store)
    save_all(writers)
    key = next(k for k in store.data if "/w8r0/" in k and k.endswith(HASHES[0].hex()))
    store.data[key] = store.data[key][:-1]
    reader = tp_group(layout, store, fill=False)[0]
    assert reader.load(HASHES, SLOTS).failed == tuple(range(N))


def test_an_unreachable_backend_gives_misses_and_dropped_saves_not_exceptions(store, caplog):
    layout = minimax_m3(tp_size=8)
    group = tp_group(layout, store)
    save_all(group[:1])
    store.down = True
    with caplog.at_level(logging.WARNING, logger="kvconn"):
        hit = group[0].lookup(HASHES)
        saved = group[1].save(HASHES, SLOTS)
        loaded = group[0].load(HASHES, SLOTS)
    assert (hit.blocks, hit.available) == (0, False)
    assert saved.written == 0 and saved.dropped > 0
    assert group[1].stats.pages("dropped") == saved.dropped
    assert loaded.loaded == 0 and loaded.failed == tuple(range(N))
    assert "serving without the cache" in caplog.text
    store.down = False  # the same connectors recover without being rebuilt
    save_all(group)
    assert group[0].lookup(HASHES).blocks == N


def test_after_a_backend_error_calls_back_off_instead_of_waiting_on_a_dead_server(store):
    layout = minimax_m3(tp_size=8)
    config = ConnectorConfig(model="m", backend="dict", retry_interval_s=60)
    conn = Connector(config, layout, rank=0, backend=store)
    store.down = True
    assert conn.lookup(HASHES).blocks == 0
    store.calls.clear()
    store.down = False
    assert conn.lookup(HASHES).available is False  # still in the back-off window
    assert store.calls == []


def test_saving_again_skips_pages_already_stored_without_putting(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    save_all(group)
    store.calls.clear()
    result = group[2].save(HASHES, SLOTS)
    assert result.written == 0 and result.skipped > 0
    assert store.ops("put") == 0 and store.ops("exists") == 1


def test_spread_writers_balance_bytes_written_across_ranks(store):
    layout = minimax_m3(tp_size=8, layers=1, num_slots=64)
    group = tp_group(layout, store, fill=False)
    hashes = block_hashes(list(range(32 * 1200)), 32)
    for start in range(0, len(hashes), 60):
        part = hashes[start : start + 60]
        for c in group:
            c.save(part, list(range(len(part))))
    written = [c.stats.bytes("written") for c in group]
    assert max(written) / (sum(written) / 8) <= 1.05


def test_first_policy_writes_every_replicated_page_from_rank_zero(store):
    layout = minimax_m3(tp_size=8, layers=1)
    group = tp_group(layout, store, policy="first", fill=False)
    save_all(group)
    written = [c.stats.bytes("written") for c in group]
    assert written[0] == N * 32 * 768 and all(w == N * 32 * 512 for w in written[1:])
    assert max(written) / (sum(written) / 8) == pytest.approx(768 / 544)


def test_with_4_kv_heads_at_tp8_bytes_stored_halve(store):
    layout = interleaved_layout(
        (RoleSpec("k", 256, 4, "bf16"), RoleSpec("v", 256, 4, "bf16")),
        tp_size=8,
        layers=2,
        num_slots=16,
    )
    group = tp_group(layout, store)
    save_all(group)
    pages = page_values(store)  # the layout manifest (one, ~270 B) is metadata, not pages
    stored = payload_bytes(store)
    per_rank_keying = 8 * N * 2 * 2 * 256 * 32
    assert stored * 2 == per_rank_keying
    assert sorted({k.split("/")[2] for k in pages}) == ["w4r0", "w4r1", "w4r2", "w4r3"]
    # each pair of ranks shares its pages: one writer each
    assert sum(c.stats.pages("written") for c in group) == 4 * N


def test_minimax_m3_stores_29_2_percent_fewer_bytes_than_per_rank_keying(store):
    group = tp_group(minimax_m3(tp_size=8, layers=2), store)
    save_all(group)
    stored = payload_bytes(store)
    naive = 8 * N * 2 * 768 * 32
    assert 1 - stored / naive == pytest.approx(1 - (8 * 512 + 256) / (8 * 768))


def test_different_salts_never_share_blocks(store):
    group = tp_group(minimax_m3(tp_size=8), store)
    tokens = list(range(32 * N))
    a = block_hashes(tokens, 32, ReuseScope(cache_salt="a"))
    save_all(group, a)
    assert group[0].lookup(a).blocks == N
    assert group[0].lookup(block_hashes(tokens, 32, ReuseScope(cache_salt="b"))).blocks == 0


def test_a_reader_with_another_layout_misses_instead_of_reading_wrong_bytes(store):
    save_all(tp_group(minimax_m3(tp_size=8, layers=4), store))
    other = Connector(
        ConnectorConfig(model="test-model", backend="dict"),
        minimax_m3(tp_size=8, layers=3),
        backend=store,
    )
    assert other.lookup(HASHES).blocks == 0
    other_model = Connector(
        ConnectorConfig(model="other", backend="dict"),
        minimax_m3(tp_size=8, layers=4),
        backend=store,
    )
    assert other_model.lookup(HASHES).blocks == 0


def test_small_staging_moves_large_requests_in_chunks(store):
    layout = minimax_m3(tp_size=2, layers=2)
    config = ConnectorConfig(
        model="m", backend="dict", staging_bytes=40_000, writer_policy=WriterPolicy.FIRST
    )
    pools = [torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)]
    writer = Connector(config, layout, rank=0, pools=pools, backend=store)
    assert writer.save(HASHES, SLOTS).written == 2 * N
    assert store.ops("put") > 2
    reader = Connector(config, layout, rank=0, pools=[torch.zeros_like(pools[0])], backend=store)
    assert reader.load(HASHES, SLOTS).loaded == N
    for s in SLOTS:
        assert slot_bytes(layout, reader.pools, s) == slot_bytes(layout, writer.pools, s)


def test_layer_groups_have_their_own_block_tables(store):
    roles = (Role("k", 2, "bf16"), Role("index_k", 1, "bf16"))
    layout = KvLayout(
        2,
        32,
        roles,
        (
            LayerGroup(0, 8, (Region("k", 0, 0, 64, 128, 8), Region("index_k", 0, 64, 64, 128, 8))),
            LayerGroup(1, 4, (Region("k", 1, 1024, 64, 64, 4),)),
        ),
        (1280,),
    )
    pools = [torch.randint(0, 256, (1280,), dtype=torch.uint8)]
    conn = Connector(
        ConnectorConfig(model="m", backend="dict"), layout, rank=0, pools=pools, backend=store
    )
    slots = {0: [7, 2], 1: [3, 0]}
    hashes = HASHES[:2]
    conn.save(hashes, slots)
    conn.save(hashes, slots)
    peer = Connector(
        ConnectorConfig(model="m", backend="dict"),
        layout,
        rank=1,
        pools=[torch.zeros(1280, dtype=torch.uint8)],
        backend=store,
    )
    peer.save(hashes, slots)
    assert conn.lookup(hashes).blocks == 2
    fresh = Connector(
        ConnectorConfig(model="m", backend="dict"),
        layout,
        rank=0,
        pools=[torch.zeros(1280, dtype=torch.uint8)],
        backend=store,
    )
    assert fresh.load(hashes, {0: [0, 1], 1: [1, 2]}).loaded == 2
    assert torch.equal(fresh.pools[0][1024 + 64 : 1024 + 128], pools[0][1024 + 192 : 1024 + 256])
    with pytest.raises(ValueError, match=r"missing for layer group\(s\) \[1\]"):
        conn.save(hashes, {0: [0, 1]})


def sliding_layout(tp=2, window=2):
    """A full-attention group and a sliding-window group laid over the same pool bytes,
    each over its own pool index, as vLLM's hybrid allocator lays its groups: a slot
    belongs to one group at a time."""
    roles = (Role("kv", 2, "bf16"),)
    groups = (
        LayerGroup(0, 8, (Region("kv", 1, 0, 64, 64, 8),), "full"),
        LayerGroup(1, 8, (Region("kv", 0, 0, 64, 64, 8, pool=1),), "sliding", window=window),
    )
    return KvLayout(tp, 32, roles, groups, (512, 512))


def hybrid_pair(store, layout=None):
    """Rank 0 and rank 1 of a TP=2 group sharing one pool tensor between both groups."""
    layout = layout or sliding_layout()
    config = ConnectorConfig(model="m", backend="dict", retry_interval_s=0)
    group = []
    for rank in range(layout.tp_size):
        pool = torch.randint(0, 256, (512,), dtype=torch.uint8)
        group.append(Connector(config, layout, rank=rank, pools=[pool, pool], backend=store))
    return group


def sliding_reader(store, **settings):
    """A fresh rank-0 connector over ``sliding_layout`` with a zeroed pool (both groups
    in one tensor), to load what ``hybrid_pair`` saved."""
    pool = torch.zeros(512, dtype=torch.uint8)
    config = ConnectorConfig(**{"model": "m", "backend": "dict", **settings})
    return Connector(config, sliding_layout(), pools=[pool, pool], backend=store), pool


FULL_SLOTS = [1, 2, 3, 4]
SLIDING_SLOTS = [5, 6, 7, 0]


def test_a_hit_with_a_sliding_group_needs_its_pages_only_inside_the_window(store):
    group = hybrid_pair(store)
    for conn in group:
        conn.save(HASHES[:4], {0: FULL_SLOTS, 1: SLIDING_SLOTS})
    assert group[0].lookup(HASHES[:4]).blocks == 4
    for block in (0, 1):  # outside the window of a 4-block hit
        for key in [k for k in store.data if "/lg1/" in k and k.endswith(HASHES[block].hex())]:
            del store.data[key]
    assert [c.lookup(HASHES[:4]).blocks for c in group] == [4, 4]
    assert group[0].lookup(HASHES[:3]).blocks == 0  # blocks 1-2 are its window: 1 is gone
    del store.data[next(k for k in store.data if "/lg0/" in k and k.endswith(HASHES[2].hex()))]
    assert group[0].lookup(HASHES[:4]).blocks == 0  # full attention needs every block


def test_a_chunked_group_needs_its_pages_only_in_the_chunk_the_hit_ends_in(store):
    """Chunked local attention of 2-block chunks (Llama 4's layers): a 4-block hit ends
    a chunk and needs none of that group's pages; a 3-block hit needs block 2's."""
    group = hybrid_pair(store, sliding_layout(window=Chunked(2)))
    for conn in group:
        conn.save(HASHES[:4], {0: FULL_SLOTS, 1: SLIDING_SLOTS})
    for block in (0, 1, 3):
        for key in [k for k in store.data if "/lg1/" in k and k.endswith(HASHES[block].hex())]:
            del store.data[key]
    assert [c.lookup(HASHES[:4]).blocks for c in group] == [4, 4]
    assert group[0].lookup(HASHES[:3]).blocks == 3
    assert group[0].lookup(HASHES[:4]).restorable == (2, 3, 4)
    for key in [k for k in store.data if "/lg1/" in k and k.endswith(HASHES[2].hex())]:
        del store.data[key]
    assert group[0].lookup(HASHES[:3]).blocks == 2


def test_a_group_with_no_slot_for_a_block_neither_saves_nor_loads_its_page(store):
    """vLLM hands null blocks (no slot) for sliding-window blocks outside the window: a
    load of a 4-block hit fills the window's two blocks of that group and all four of
    the full group, and the blocks count as loaded."""
    writer, peer = hybrid_pair(store)
    no_slot = {0: FULL_SLOTS, 1: [NO_SLOT, NO_SLOT, 7, 0]}
    assert writer.save(HASHES[:4], no_slot).written + peer.save(HASHES[:4], no_slot).written == (
        4 * 2 + 2 * 2  # both ranks' shards of 4 full pages, of 2 sliding pages
    )
    assert sum("/lg1/" in k for k in page_values(store)) == 4
    assert writer.lookup(HASHES[:4]).blocks == 4
    reader, pool = sliding_reader(store)
    result = reader.load(HASHES[:4], {0: [4, 5, 6, 7], 1: [NO_SLOT, NO_SLOT, 2, 3]})
    assert result.loaded == 4 and result.ok
    source = writer.pools[0]
    for src, dst in zip([1, 2, 3, 4, 7, 0], [4, 5, 6, 7, 2, 3]):
        assert torch.equal(pool[dst * 64 : dst * 64 + 64], source[src * 64 : src * 64 + 64])
    assert torch.count_nonzero(pool[:128]) == 0  # slots 0 and 1: no group's page went there
    assert reader.stats.snapshot()["total"]["loaded"]["pages"] == 4 + 2


def test_a_missing_page_outside_the_window_does_not_fail_a_load_that_does_not_ask_for_it(store):
    writer, peer = hybrid_pair(store)
    for conn in (writer, peer):
        conn.save(HASHES[:3], {0: FULL_SLOTS[:3], 1: SLIDING_SLOTS[:3]})
    for key in [k for k in store.data if "/lg1/" in k and k.endswith(HASHES[0].hex())]:
        del store.data[key]
    reader, _ = sliding_reader(store)
    assert reader.load(HASHES[:3], {0: [4, 5, 6], 1: [NO_SLOT, 2, 3]}).loaded == 3
    # asked for it, the missing page fails its block and every later one
    assert reader.load(HASHES[:3], {0: [4, 5, 6], 1: [1, 2, 3]}).failed == (0, 1, 2)


def test_a_failed_load_counts_failed_pages_only_where_its_blocks_had_slots(store):
    """A failed block fails the pages it asked for: none of a group it has no slot in."""
    writer, peer = hybrid_pair(store)
    for conn in (writer, peer):
        conn.save(HASHES[:2], {0: FULL_SLOTS[:2], 1: SLIDING_SLOTS[:2]})
    reader, _ = sliding_reader(store)
    # blocks 2 and 3 were never stored; the sliding group has a slot only for block 3
    result = reader.load(HASHES[:4], {0: [4, 5, 6, 7], 1: [NO_SLOT, NO_SLOT, NO_SLOT, 3]})
    assert result.loaded == 2 and result.failed == (2, 3)
    assert reader.stats.pages("failed") == 2 + 1  # the full group's two, block 3's sliding


def test_a_load_from_lent_values_with_no_slot_in_a_whole_group_loads_the_other_groups(
    tmp_path,
):
    """A backend that lends its values (LMDB) has each page kind's pages scattered
    straight from them; a kind with no page in the load (its group has NO_SLOT for every
    block, as in SGLang's per-pool calls) scatters nothing: the load succeeds and the
    backend is not taken for broken."""
    from kvconn.registry import load_backend

    lmdb = load_backend("lmdb", {"path": str(tmp_path)})
    try:
        writer, peer = hybrid_pair(lmdb)
        for conn in (writer, peer):
            conn.save(HASHES[:4], {0: FULL_SLOTS, 1: SLIDING_SLOTS})
        reader, pool = sliding_reader(lmdb, backend="lmdb", retry_interval_s=0)
        assert lmdb.capabilities.borrowed_reads
        result = reader.load(HASHES[:4], {0: [4, 5, 6, 7], 1: [NO_SLOT] * 4})
        assert result.loaded == 4 and result.ok
        for src, dst in zip(FULL_SLOTS, [4, 5, 6, 7]):
            assert torch.equal(
                pool[dst * 64 : dst * 64 + 64], writer.pools[0][src * 64 : src * 64 + 64]
            )
        assert reader.stats.backend_errors == 0
    finally:
        lmdb.close()


def test_no_slot_may_repeat_but_other_negative_slots_are_refused(store):
    conn = hybrid_pair(store)[0]
    assert conn.save(HASHES[:3], {0: [1, 2, 3], 1: [NO_SLOT, NO_SLOT, NO_SLOT]}).written == 3
    with pytest.raises(ArgumentError, match=r"slot out of range \[0, 8\) \(or NO_SLOT, -1\)"):
        conn.load(HASHES[:2], {0: [1, 2], 1: [-2, 3]})


def test_bad_requests_fail_with_clear_errors_and_store_nothing(store):
    layout = minimax_m3(tp_size=8)
    conn = tp_group(layout, store)[0]
    with pytest.raises(ValueError, match="6 slots for 2 blocks"):
        conn.save(HASHES[:2], SLOTS)
    with pytest.raises(ValueError, match="slot out of range"):
        conn.save(HASHES[:1], [64])
    with pytest.raises(ValueError, match="16-byte digests"):
        conn.lookup([b"short"])
    assert store.data == {}
    no_pools = Connector(ConnectorConfig(model="m", backend="dict"), layout, backend=store)
    with pytest.raises(ConfigError, match="no KV pools"):
        no_pools.load(HASHES, SLOTS)


def test_one_slot_named_for_two_blocks_is_refused_for_load_and_save(store):
    """``load(hashes, [5, 5])`` reported 2 blocks loaded while slot 5 held only the
    second; a save would store slot 5's bytes under both blocks' keys, serving wrong
    bytes to every later request with the first block's prefix."""
    layout = minimax_m3(tp_size=8)
    group = tp_group(layout, store)
    save_all(group)
    stored = dict(store.data)
    conn = group[0]
    for call in (conn.load, conn.save):
        with pytest.raises(ArgumentError, match="slot 5 is given for two different blocks"):
            call(HASHES[:2], [5, 5])
        with pytest.raises(ValueError, match="block 0 and block 2"):  # still a ValueError
            call(HASHES[:3], {0: [4, 6, 4]})
    assert store.data == stored and conn.stats.snapshot()["total"].get("loaded") is None
    # the same block twice in one slot is consistent, and allowed
    assert conn.load([HASHES[0], HASHES[0]], [2, 2]).loaded == 2


@pytest.mark.parametrize(
    "slots",
    [None, "ab", 5, [[1], [2]], [1, None], {1, 2}, [2**70, 1], {0: [1, 2], 7: [1, 2]}],
    ids=["none", "str", "scalar", "2-d", "none-inside", "set", "overflow", "unknown-group"],
)
def test_slots_of_the_wrong_shape_or_type_are_argument_errors(store, slots):
    conn = tp_group(minimax_m3(tp_size=2, layers=1, num_slots=4), store)[0]
    for call in (conn.load, conn.save):
        with pytest.raises(ArgumentError, match=r"slots|layer group"):
            call(HASHES[:2], slots)
    assert store.data == {}


@pytest.mark.parametrize(
    "hashes",
    [None, 5, b"x" * 16, [None], ["ab" * 8]],
    ids=["none", "int", "bytes", "none-in", "str"],
)
def test_block_hashes_that_are_not_a_list_of_digests_are_argument_errors(store, hashes):
    conn = tp_group(minimax_m3(tp_size=2, layers=1, num_slots=4), store)[0]
    with pytest.raises(ArgumentError, match="16-byte digests"):
        conn.lookup(hashes)
    with pytest.raises(ArgumentError, match="16-byte digests"):
        conn.load(hashes, [0])


def test_argument_errors_are_still_the_value_and_type_errors_callers_catch():
    """They used to be plain ValueError (slot counts) or TypeError (wrong types)."""
    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, TypeError)
    assert issubclass(ArgumentError, KvconnError)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"layout": None}, LayoutError, "layout must be a KvLayout, got None"),
        ({"config": None}, ConfigError, "a configuration must be a table/dict"),
        ({"backend": 5}, ConfigError, "backend must be a kvconn Backend instance, got 5"),
        ({"pools": 5}, LayoutError, "pools must be a list of tensors"),
        ({"pools": torch.zeros(4096, dtype=torch.uint8)}, LayoutError, r"\(e.g. \[pool\]\)"),
        ({"pools": [None]}, LayoutError, "pool 0 must be a torch tensor, got None"),
        ({"rank": "0"}, LayoutError, "rank must be an int, got '0'"),
    ],
    ids=["layout", "config", "backend", "pools-int", "pools-tensor", "pools-none", "rank"],
)
def test_constructor_arguments_of_the_wrong_type_name_themselves(store, kwargs, error, message):
    args = {
        "config": ConnectorConfig(model="m", backend="dict"),
        "layout": minimax_m3(tp_size=2, layers=1, num_slots=4),
        "backend": store,
        **kwargs,
    }
    config, layout = args.pop("config"), args.pop("layout")
    with pytest.raises(error, match=message):
        Connector(config, layout, **args)


def test_pools_must_match_the_layout(store):
    layout = minimax_m3(tp_size=8)
    config = ConnectorConfig(model="m", backend="dict")
    with pytest.raises(ConfigError, match="declares 1 pools, got 2"):
        Connector(config, layout, pools=[torch.zeros(8), torch.zeros(8)], backend=store)
    with pytest.raises(ConfigError, match="has 8 bytes"):
        Connector(config, layout, pools=[torch.zeros(8, dtype=torch.uint8)], backend=store)


def test_counters_split_by_role_and_class(store):
    group = tp_group(minimax_m3(tp_size=8, layers=2), store, policy="first")
    save_all(group)
    snap = group[0].stats.snapshot()
    assert snap["by_role"]["written"]["index_k"]["bytes"] == N * 2 * 256 * 32
    assert snap["by_role"]["written"]["k"]["bytes"] == N * 2 * 256 * 32
    assert snap["by_class"]["written"]["replicated"]["pages"] == N
    assert snap["total"]["written"]["pages"] == 2 * N


def test_share_keys_match_the_lookup_keys(store):
    conn = tp_group(minimax_m3(tp_size=8), store)[4]
    assert share_key(conn.prefix, conn.shares[0], HASHES[0]).split("/")[2] == "w8r4"


# ---------------------------------------------------------------- layout manifests
def test_each_connector_puts_every_layout_manifest_once_in_one_batch_after_its_pages():
    store = RecordingStore()
    group = tp_group(minimax_m3(tp_size=8), store)
    first = group[0].save(HASHES, SLOTS)
    assert first.written > 0
    # the page puts of the save come first; the manifests are the save's last put
    assert sorted(store.put_batches[-1]) == sorted(manifest_values(store))
    assert all(f"/{LAYOUT}/" not in k for b in store.put_batches[:-1] for k in b)
    save_all(group)
    save_all(group, block_hashes(list(range(1000, 1000 + 32 * N)), 32))
    batches = store.manifest_batches()
    assert len(batches) == 8  # once per connector, not once per save
    assert all(sorted(b) == sorted(manifest_values(store)) for b in batches)
    assert len(manifest_values(store)) == 2  # one per page kind: lg0/w8 and lg0/replicated
    # a connector whose first save only finds its pages stored still writes them once
    late = tp_group(minimax_m3(tp_size=8), store)[5]
    store.calls.clear()
    assert late.save(HASHES, SLOTS).written == 0
    assert store.calls == [("exists", store.calls[0][1]), ("put", 2)]
    late.save(HASHES, SLOTS)
    assert store.ops("put") == 1


@pytest.mark.parametrize("failure", ["raise", "refuse"])
def test_a_failed_manifest_write_neither_raises_nor_counts_as_dropped_and_is_retried(failure):
    store = RecordingStore()
    conn = tp_group(minimax_m3(tp_size=8), store)[0]  # retry_interval_s=0
    store.manifests_fail = failure
    result = conn.save(HASHES, SLOTS)
    assert result.dropped == 0 and result.written > 0
    assert conn.stats.pages("dropped") == 0
    assert conn.stats.backend_errors == (1 if failure == "raise" else 0)
    assert manifest_values(store) == {}
    assert conn.lookup(HASHES[:1]).available  # the pages' store still serves
    store.manifests_fail = None
    again = conn.save(HASHES, SLOTS)  # everything is stored: only the manifests are put
    assert (again.written, again.dropped) == (0, 0)
    assert len(manifest_values(store)) == 2
    assert len(store.manifest_batches()) == 2  # the failed attempt and the retry
    store.calls.clear()
    conn.save(HASHES, SLOTS)
    assert store.ops("put") == 0  # written: never again


def test_a_save_given_up_with_the_backend_down_does_not_write_the_manifests():
    store = RecordingStore()
    conn = tp_group(minimax_m3(tp_size=8), store)[0]
    store.down = True
    assert conn.save(HASHES, SLOTS).dropped > 0
    assert store.put_batches == []  # the save did not reach the store: no manifest put
    store.down = False
    conn.save(HASHES, SLOTS)
    assert len(manifest_values(store)) == 2


def test_the_stored_manifest_hashes_to_the_fingerprint_in_its_page_keys(store):
    layout = minimax_m3(tp_size=8, layers=2)
    group = tp_group(layout, store)
    save_all(group)
    pages: dict[tuple[int, str, str], set[int]] = {}
    for key, value in page_values(store).items():
        page = parse_key(key)
        assert page is not None
        pages.setdefault((page.group, page.fingerprint, page.shard_class), set()).add(len(value))
    manifests = {}
    for key, value in manifest_values(store).items():
        mkey = parse_manifest_key(key)
        assert mkey is not None
        manifest = PageManifest.from_json(value)
        assert manifest.fingerprint == mkey.fingerprint  # the content names its own key
        assert manifest.to_json() == value  # stored in canonical form
        manifests[(mkey.group, mkey.fingerprint, manifest.shard_class)] = manifest
    assert set(manifests) == set(pages)  # one manifest per page kind, none for nothing
    for ident, manifest in manifests.items():
        assert pages[ident] == {manifest.value_size} == {manifest.page_size + TRAILER}
    roles = {m.shard_class: m.document()["roles"] for m in manifests.values()}
    per_page = 2 * 256 * 32  # 2 layers x 256 B/token x 32 tokens
    assert roles == {
        "w8": {
            "k": {"units": 8, "dtype": "bf16", "bytes_per_page": per_page},
            "v": {"units": 8, "dtype": "bf16", "bytes_per_page": per_page},
        },
        "replicated": {"index_k": {"units": 1, "dtype": "bf16", "bytes_per_page": per_page}},
    }
    assert {p.manifest for p in group[0].plans} == set(manifests.values())


# ---------------------------------------------------------------- vetted key batches
class _KeyRecorder(DictBackend):
    """Records the type of every key batch the public methods receive."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[type] = []
        self.scratch: list[bool] = []

    def exists(self, keys):  # type: ignore[no-untyped-def]
        self.batches.append(type(keys))
        return super().exists(keys)

    def put(self, keys, values):  # type: ignore[no-untyped-def]
        self.batches.append(type(keys))
        return super().put(keys, values)

    def read(self, keys, buffers, *, scratch=False):  # type: ignore[no-untyped-def]
        self.batches.append(type(keys))
        self.scratch.append(scratch)
        return super().read(keys, buffers, scratch=scratch)


def test_the_connector_hands_backends_key_batches_it_has_already_vetted():
    store = _KeyRecorder()
    group = tp_group(minimax_m3(tp_size=2, layers=2, num_slots=16), store)
    save_all(group)
    assert group[0].lookup(HASHES).blocks == len(HASHES)
    assert group[1].load(HASHES, SLOTS).ok
    assert store.batches and set(store.batches) == {VettedKeys}
    assert store.scratch == [True]  # loads land in staging; only good pages are scattered


def test_a_vetted_batch_skips_the_per_call_key_check(monkeypatch):
    store = DictBackend()
    keys = VettedKeys(["a/1", "a/2"], store.max_key_length)

    def must_not_run(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("a vetted batch was checked again")

    monkeypatch.setattr(backend_module, "_keys_look_valid", must_not_run)
    monkeypatch.setattr(backend_module, "check_key", must_not_run)
    assert store.exists(keys) == [False, False]


def test_making_a_vetted_batch_checks_every_key():
    with pytest.raises(InvalidKeyError, match="printable ASCII without spaces"):
        VettedKeys(["good", "bad key"], 250)
    with pytest.raises(InvalidKeyError, match="exceeds the limit of 10"):
        VettedKeys(["x" * 11], 10)


def test_a_batch_vetted_for_a_longer_limit_is_checked_against_the_backends_own():
    store = DictBackend()
    long_key = "k" * (store.max_key_length + 1)
    keys = VettedKeys.unchecked([long_key], store.max_key_length + 100)
    with pytest.raises(InvalidKeyError, match="exceeds the limit"):
        store.exists(keys)


_ANSWER = st.one_of(st.booleans(), st.integers(-2, 300), st.none(), st.floats(allow_nan=False))


@given(st.lists(_ANSWER, min_size=1, max_size=8))
def test_whatever_a_backend_answers_per_key_reaches_the_caller_as_bools(answers):
    class Answering(DictBackend):
        def _exists(self, keys):  # type: ignore[no-untyped-def]
            return answers

    got = Answering().exists([f"k/{i}" for i in range(len(answers))])
    assert got == [bool(a) for a in answers]
    assert all(type(flag) is bool for flag in got)


class HolderDied(DictBackend):
    """Reports pages under ``lost`` as stored but unreachable, as Mooncake does for a
    value whose storage process died (``-800``), and others by their real state."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: set[str] = set()

    def _read_status(self, keys, buffers, *, scratch):
        from kvconn.backend import ReadStatus

        out = []
        for key, ok in zip(keys, self._get(keys, buffers, scratch=scratch)):
            if key in self.lost:
                out.append(ReadStatus.UNREACHABLE)
            elif ok:
                out.append(ReadStatus.LOADED)
            elif key not in self.data:
                out.append(ReadStatus.MISSING)
            else:
                out.append(ReadStatus.WRONG_SIZE)
        return out


def test_a_page_that_is_only_unreachable_is_a_miss_and_is_kept_for_a_later_load():
    store = HolderDied()
    layout = minimax_m3(tp_size=2)
    for conn in tp_group(layout, store):
        conn.save(HASHES, SLOTS)
    (reader, _) = tp_group(layout, store, fill=False)
    lost = next(k for k in store.data if "/w2r0/" in k and k.endswith(HASHES[2].hex()))
    store.lost.add(lost)
    result = reader.load(HASHES, SLOTS)
    assert result.loaded == 2
    assert lost in store.data  # not deleted: its holder may come back
    assert reader.stats.pages("unreachable") == 1
    assert reader.stats.pages("corrupt") == 0 and reader.stats.pages("repaired") == 0
    store.lost.clear()  # the segment is served again
    assert reader.load(HASHES, SLOTS).loaded == N


def test_a_page_the_backend_reports_of_the_wrong_size_is_repaired_without_asking_exists():
    store = HolderDied()
    layout = minimax_m3(tp_size=1)
    (writer,) = tp_group(layout, store)
    writer.save(HASHES, SLOTS)
    bad = next(k for k in store.data if "/replicated/" in k and k.endswith(HASHES[1].hex()))
    store.data[bad] = store.data[bad][:-1]
    (reader,) = tp_group(layout, store, fill=False)
    store.calls.clear()
    assert reader.load(HASHES, SLOTS).loaded == 1
    assert bad not in store.data
    assert [op for op, _ in store.calls] == ["get"]  # the status said why: no exists
    assert reader.stats.pages("repaired") == 1
