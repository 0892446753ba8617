"""Defects an adversarial review found, each pinned by the rule it broke.

Pools that are views into a larger allocation, one-slot regions longer than their
stride, configuration holes, and keys too long for the backend: all fixed, kept here so
they stay fixed.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import kvconn.calls as calls_module
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.errors import ArgumentError, BackendUnavailable, ConfigError, LayoutError
from kvconn.hashing import ReuseScope, block_hashes
from kvconn.layout import KvLayout, LayerGroup, Region, Role
from kvconn.movement import PageMover, flat_bytes
from kvconn.tools.models import minimax_m3
from tests.fakes import DictBackend
from tests.helpers import slot_bytes, tp_group

# --------------------------------------------------------------------------- layout


def test_layout_rejects_overlapping_single_slot_regions_whose_size_exceeds_their_stride():
    """A one-slot region's stride is free (Region allows stride < size when num_slots == 1).

    Bytes 50..60 belong to both regions, yet the equal-stride shortcut in
    ``_strided_overlap`` only tries k in [k0-1, k0+2] (here -6..-3) while the only
    existing slot pair is k == 0, so the overlap is never examined.
    """
    roles = (Role("k", 1, "bf16"), Role("v", 1, "bf16"))
    group = LayerGroup(
        0,
        1,
        (
            Region("k", 0, base=0, size=100, stride=10, num_slots=1),
            Region("v", 0, base=50, size=10, stride=10, num_slots=1),
        ),
    )
    with pytest.raises(LayoutError, match="overlaps"):
        KvLayout(1, 16, roles, (group,), (256,))


def test_layout_rejects_a_single_slot_region_that_covers_slots_of_another_group():
    """Group 0 (1 slot, bytes 0..100) swallows slots 0..2 of group 1 (bytes 50..80)."""
    roles = (Role("k", 1, "bf16"), Role("v", 1, "bf16"))
    g0 = LayerGroup(0, 1, (Region("k", 0, base=0, size=100, stride=10, num_slots=1),))
    g1 = LayerGroup(1, 3, (Region("v", 1, base=50, size=10, stride=10, num_slots=3),))
    with pytest.raises(LayoutError, match="overlaps"):
        KvLayout(1, 16, roles, (g0, g1), (256,))


# --------------------------------------------------------------------------- movement


@pytest.mark.parametrize("offset", [8, 3], ids=["aligned-offset", "odd-offset"])
def test_gather_reads_the_addressed_slot_of_a_pool_that_is_a_view_with_storage_offset(offset):
    """Pools that are slices of a larger allocation (one arena, per-layer views) must work:
    region bases are relative to the pool, but ``as_strided``'s storage_offset is absolute."""
    arena = torch.arange(128, dtype=torch.uint8)
    pool = arena[offset : offset + 64]
    region = Region("k", 0, base=0, size=4, stride=8, num_slots=8)
    mover = PageMover([region], [flat_bytes(pool)], 8)
    out = torch.empty(1, 4, dtype=torch.uint8)
    mover.gather(torch.tensor([1]), out)
    assert out[0].tolist() == pool[8:12].tolist()


@pytest.mark.parametrize("offset", [8, 3], ids=["aligned-offset", "odd-offset"])
def test_scatter_writes_only_the_addressed_slot_inside_a_pool_view_with_storage_offset(offset):
    arena = torch.zeros(128, dtype=torch.uint8)
    pool = arena[offset : offset + 64]
    region = Region("k", 0, base=0, size=4, stride=8, num_slots=8)
    mover = PageMover([region], [flat_bytes(pool)], 8)
    mover.scatter(torch.tensor([2]), torch.full((1, 4), 7, dtype=torch.uint8))
    written = arena.nonzero().flatten().tolist()
    assert written == [offset + 16 + i for i in range(4)]


def test_connector_round_trips_pages_between_pools_that_are_slices_of_one_allocation():
    """End to end through register_pools: save from a sliced pool, load into another
    sliced pool; the loaded slots must equal the saved ones and the arena outside the
    pool must stay untouched (no writes into a neighbouring layer's memory)."""
    roles = (Role("k", 1, "bf16"), Role("v", 1, "bf16"))
    regions = (
        Region("k", 0, base=0, size=8, stride=16, num_slots=4),
        Region("v", 0, base=8, size=8, stride=16, num_slots=4),
    )
    layout = KvLayout(1, 4, roles, (LayerGroup(0, 4, regions),), (64,))
    config = ConnectorConfig(model="m", backend="dict", retry_interval_s=0)
    backend = DictBackend()
    hashes = block_hashes(list(range(8)), 4)  # 2 full blocks

    src_arena = torch.randint(0, 256, (256,), dtype=torch.uint8)
    src_pool = src_arena[64:128]
    saver = Connector(config, layout, pools=[src_pool], backend=backend)
    assert saver.save(hashes, [1, 2]).written == 2

    dst_arena = torch.zeros(256, dtype=torch.uint8)
    dst_pool = dst_arena[64:128]
    loader = Connector(config, layout, pools=[dst_pool], backend=backend)
    assert loader.load(hashes, [1, 2]).ok
    assert torch.equal(dst_pool[16:48], src_pool[16:48])
    assert int(dst_arena[:64].count_nonzero()) == 0
    assert int(dst_arena[128:].count_nonzero()) == 0


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "var",
    [
        "KVCONN_DEV_REQUIRE_SERVERS",
        "KVCONN_DEV_MOONCAKE_MASTER",
        "KVCONN_DEV_MOONCAKE_CLIENT",
        "KVCONN_SKIP_ENGINES",
    ],
)
def test_config_from_env_tolerates_kvconn_own_non_config_variables(var):
    """kvconn's tools read these (testing/suite.py, tools/devserver/mooncake.py,
    scripts/test.sh); a process that has them set (any CI job running the suite, and
    ``KVCONN_SKIP_ENGINES=1 bash scripts/test.sh``, whose TensorRT-LLM stand-in ranks
    read the environment) must still be configurable from env."""
    config = ConnectorConfig.from_env({"KVCONN_MODEL": "m", var: "1"})
    assert config.model == "m"


def test_config_from_env_reports_non_table_options_in_the_config_file_as_a_config_error(
    tmp_path,
):
    path = tmp_path / "kvconn.toml"
    path.write_text('model = "m"\noptions = "oops"\n')
    with pytest.raises(ConfigError):
        ConnectorConfig.from_env({"KVCONN_CONFIG": str(path)})


def test_config_rejects_a_nan_retry_interval():
    """``nan`` passes ``< 0``; with it ``now < nan`` is always false, so back-off is
    silently disabled and a dead server costs a timeout on every request."""
    with pytest.raises(ConfigError):
        ConnectorConfig(model="m", retry_interval_s=math.nan)
    with pytest.raises(ConfigError):
        ConnectorConfig.from_env({"KVCONN_MODEL": "m", "KVCONN_RETRY_INTERVAL_S": "nan"})


# --------------------------------------------------------------------------- connector


def test_a_model_name_that_makes_keys_too_long_fails_fast_instead_of_reading_as_an_outage():
    """Rule 6: bad configuration fails fast. Today every lookup/save raises
    InvalidKeyError inside ``_call``, which is logged and counted as *backend down*:
    the cache silently never works and the log blames the store."""
    roles = (Role("k", 1, "bf16"),)
    layout = KvLayout(1, 4, roles, (LayerGroup(0, 4, (Region("k", 0, 0, 16, 16, 4),)),), (64,))
    config = ConnectorConfig(model="Org/" + "M" * 200, backend="dict")
    with pytest.raises(ConfigError):
        Connector(config, layout, pools=[torch.zeros(64, dtype=torch.uint8)], backend=DictBackend())


# ------------------------------------------------ second review (2026-11-30)


def test_loading_one_block_whose_first_page_kind_has_a_size_not_a_multiple_of_8_fills_cpu_slots():
    """Rule 5: a load never raises into the serving loop and never half-writes a slot.

    K (fp8 + f32 scale, 132 B/token, sharded) in pool 0 and a replicated index-K
    (128 B/token) in a pool of its own, one token per block (SGLang's page size). In the
    load's staging the replicated page starts at ``n * 132`` bytes, 4 mod 8 for one
    block, while the index-K run moves 8-byte words: ``part.contiguous()`` is a no-op on
    an already contiguous slice, so ``view(torch.int64)`` raises after the K page was
    already scattered into the slot.
    """
    slots = 4
    roles = (Role("k", 2, "fp8e4m3+f32scale"), Role("index_k", 1, "bf16"))
    regions = (
        Region("k", 0, base=0, size=132, stride=132, num_slots=slots, pool=0),
        Region("index_k", 0, base=0, size=128, stride=128, num_slots=slots, pool=1),
    )
    layout = KvLayout(2, 1, roles, (LayerGroup(0, slots, regions),), (132 * slots, 128 * slots))
    store = DictBackend()
    hashes = block_hashes([7, 8, 9], 1)
    writers = tp_group(layout, store)
    for w in writers:
        assert w.save(hashes, [0, 1, 2]).dropped == 0
    reader = tp_group(layout, store, fill=False)[1]
    assert reader.lookup(hashes[:1]).blocks == 1
    result = reader.load(hashes[:1], [3])
    assert result.ok and result.loaded == 1
    assert slot_bytes(layout, reader.pools, 3) == slot_bytes(layout, writers[1].pools, 0)


def test_a_backend_call_that_fails_after_a_timeout_longer_than_the_retry_interval_backs_off(
    monkeypatch,
):
    """Rule 6 / config: a dead server costs the serving loop one timeout, not one per call.

    The back-off window is measured from when the call *started*, so a call that times
    out after longer than ``retry_interval_s`` leaves no window at all: the next lookup
    waits on the dead server again.
    """
    clock = SimpleNamespace(t=1000.0)
    monkeypatch.setattr(calls_module, "time", SimpleNamespace(monotonic=lambda: clock.t))

    class TimingOut(DictBackend):
        def _exists(self, keys):  # type: ignore[no-untyped-def]
            self.calls.append(("exists", len(keys)))
            clock.t += 5.0  # the client's socket timeout
            raise BackendUnavailable("timed out")

    store = TimingOut()
    layout = minimax_m3(tp_size=2, layers=1, num_slots=4)
    config = ConnectorConfig(model="m", backend="dict", retry_interval_s=1.0)
    conn = Connector(config, layout, rank=0, backend=store)
    hashes = block_hashes(list(range(64)), 32)
    assert conn.lookup(hashes).available is False
    clock.t += 0.01  # the very next request
    assert conn.lookup(hashes).available is False
    assert store.ops("exists") == 1  # skipped inside the window, not a second timeout


def test_a_rank_that_is_not_an_int_is_refused_instead_of_writing_keys_no_lookup_asks_for():
    """Rule 6: bad configuration fails fast with a clear message.

    ``rank=1.0`` passes the range check; ``shard_index = 1.0 // 1`` is ``1.0`` and the
    rank writes its K/V pages under ``w2r1.0`` while every lookup asks for ``w2r1``: the
    group's cache silently never hits.
    """
    layout = minimax_m3(tp_size=2, layers=1, num_slots=4)
    config = ConnectorConfig(model="m", backend="dict", retry_interval_s=0)
    with pytest.raises(ConfigError):
        Connector(config, layout, rank=1.0, backend=DictBackend())  # type: ignore[arg-type]


def test_pages_that_start_off_the_pools_word_boundary_scatter_correctly():
    """The mover reads staging pages as the pool's words; a page starting 4 bytes past
    an 8-byte boundary cannot be viewed so, and ``contiguous()`` would not move it."""
    pool = torch.zeros(4, 16, dtype=torch.int64)  # 128 B per slot, moved as 8-byte words
    region = Region("k", 0, base=0, size=128, stride=128, num_slots=4, pool=0)
    mover = PageMover([region], [flat_bytes(pool)], 4)
    staging = torch.randint(0, 256, (4 + 2 * 128,), dtype=torch.uint8)
    pages = staging[4:].view(2, 128)  # contiguous, misaligned
    mover.scatter(torch.tensor([1, 3]), pages)
    stored = flat_bytes(pool)
    assert torch.equal(stored[128:256], pages[0]) and torch.equal(stored[384:512], pages[1])
    assert not stored[:128].any() and not stored[256:384].any()


def test_staging_bytes_may_be_given_with_a_unit_in_files_and_the_environment():
    from_env = ConnectorConfig.from_env({"KVCONN_MODEL": "m", "KVCONN_STAGING_BYTES": "64MiB"})
    assert from_env.staging_bytes == 64 * 2**20
    assert ConnectorConfig.from_dict({"model": "m", "staging_bytes": "1g"}).staging_bytes == 2**30
    with pytest.raises(ConfigError, match="staging_bytes must be a size"):
        ConnectorConfig.from_dict({"model": "m", "staging_bytes": "lots"})


@pytest.mark.parametrize("slots", [[1.9, 2.0], [True, False]], ids=["floats", "bools"])
def test_slots_that_are_not_integers_are_refused_instead_of_truncated(slots):
    layout = minimax_m3(tp_size=2, layers=1, num_slots=4)
    conn = tp_group(layout, DictBackend())[0]
    hashes = block_hashes(list(range(64)), 32)
    with pytest.raises(ValueError, match="slots must be integers"):
        conn.load(hashes, slots)
    with pytest.raises(ValueError, match="slots must be integers"):
        conn.save(hashes, slots)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Role(7, 1, "bf16"), "role name 7"),  # type: ignore[arg-type]
        (lambda: Role("k", 1, 16), "dtype 16"),  # type: ignore[arg-type]
        (
            lambda: KvLayout(1, 1, ("k",), (), ()),  # type: ignore[arg-type]
            "roles must be Role objects, got 'k'",
        ),
    ],
    ids=["name", "dtype", "not-a-role"],
)
def test_roles_of_the_wrong_type_are_a_layout_error_naming_them(make, match):
    with pytest.raises(LayoutError, match=match):
        make()


# ------------------------------------------------ issue 11: inputs from the outside


def test_a_lone_string_of_multimodal_digests_is_refused_not_read_as_one_per_character():
    """``ReuseScope(mm_digests='abc')`` used to be three digests 'a', 'b', 'c'."""
    with pytest.raises(ArgumentError, match="mm_digests must be a tuple of digests"):
        ReuseScope(mm_digests="abc")  # type: ignore[arg-type]
    as_list = ReuseScope(mm_digests=[b"img"])  # type: ignore[arg-type]
    assert as_list.mm_digests == (b"img",)
    assert as_list.seed() == ReuseScope(mm_digests=(b"img",)).seed()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ReuseScope(cache_salt=None), "cache_salt must be a str, got None"),  # type: ignore[arg-type]
        (lambda: ReuseScope(lora_id=3), r"lora_id must be a str or None \(e.g. str\(lora_int_id"),  # type: ignore[arg-type]
        (lambda: ReuseScope(mm_digests=[1]), "each of mm_digests must be bytes or str, got 1"),  # type: ignore[arg-type]
        (lambda: block_hashes(None, 32), "tokens must be a sequence of token ids, got None"),  # type: ignore[arg-type]
        (lambda: block_hashes(b"\0" * 256, 32), "tokens must be a sequence of token ids"),
        (lambda: block_hashes([1.5] * 32, 32), "tokens must be integer ids .* block 0 holds"),  # type: ignore[list-item]
        (lambda: block_hashes([1] * 32 + [2**64] * 32, 32), "fit 64 bits; block 1 holds"),  # type: ignore[arg-type]
        (lambda: block_hashes([1] * 32, 2.0), "tokens_per_block must be an int >= 1, got 2.0"),  # type: ignore[arg-type]
        (lambda: block_hashes([1] * 32, 0), "tokens_per_block must be an int >= 1, got 0"),  # type: ignore[arg-type]
        (lambda: block_hashes([1] * 32, 32, "salt"), "scope must be a ReuseScope or None"),  # type: ignore[arg-type]
        (lambda: block_hashes([1] * 64, 32, extras=[b""]), "extras has 1 entries for 2 full"),  # type: ignore[arg-type]
        (lambda: block_hashes([1] * 32, 32, extras=[None]), r"extras\[0\] must be bytes, got None"),  # type: ignore[list-item]
    ],
)
def test_bad_tokens_and_scopes_are_argument_errors_naming_the_input(make, message):
    with pytest.raises(ArgumentError, match=message):
        make()


def test_tokens_as_tensors_or_ranges_hash_like_lists():
    tokens = list(range(64))
    expected = block_hashes(tokens, 32)
    assert block_hashes(torch.tensor(tokens), 32) == expected  # type: ignore[arg-type]
    assert block_hashes(range(64), 32) == expected
    assert block_hashes(tuple(tokens), 32, extras=[bytearray(), b""]) == expected  # type: ignore[list-item]


def test_a_salt_read_under_a_c_locale_hashes_as_the_text_that_was_typed():
    """argv and the environment carry non-ASCII bytes as surrogate escapes under a C
    locale; ``.encode()`` raised UnicodeEncodeError on them (a traceback in ``kvconn
    simulate --salt``). The escapes turn back into the typed bytes instead."""
    typed = "caf\u00e9"
    escaped = typed.encode().decode("ascii", "surrogateescape")
    assert ReuseScope(cache_salt=escaped).seed() == ReuseScope(cache_salt=typed).seed()
    assert ReuseScope(mm_digests=(escaped,)).seed() == ReuseScope(mm_digests=(typed,)).seed()
    with pytest.raises(ArgumentError, match="is not encodable text"):
        ReuseScope(lora_id="\ud800")
