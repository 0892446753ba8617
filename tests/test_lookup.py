"""The public key and hit planner, torch-free lookups, and lookups within a deadline."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from kvconn.backend import Capabilities
from kvconn.config import ConnectorConfig
from kvconn.errors import ArgumentError, BackendUnavailable, LayoutError
from kvconn.hashing import block_hashes
from kvconn.keys import parse_key
from kvconn.layout import KvLayout
from kvconn.lookup import DeadlineLookup, Lookup, PageKeys
from kvconn.tools.models import QWEN3_235B_PRESET, minimax_m3
from tests.fakes import DictBackend, GatedBackend
from tests.helpers import tp_group

N = 4
HASHES = block_hashes(list(range(32 * N)), 32)
SLOTS = [3, 1, 4, 0]
CONFIG = ConnectorConfig(model="test-model", backend="dict", retry_interval_s=0)


@pytest.mark.parametrize(
    "layout", [minimax_m3(tp_size=8), QWEN3_235B_PRESET.layout(8, 2, 16)], ids=["minimax", "qwen3"]
)
def test_a_lookup_checks_every_key_any_rank_loads_and_nothing_else(layout):
    keys = PageKeys(CONFIG, layout)
    for h in HASHES:
        every_rank = {k for rank in range(layout.tp_size) for k in keys.rank_keys(rank, h)}
        assert set(keys.block_keys(h)) == every_rank
        assert len(keys.block_keys(h)) == len(every_rank)  # no key twice


def test_the_planner_names_the_keys_the_ranks_store():
    layout = minimax_m3(tp_size=8)
    store = GatedBackend()
    for conn in tp_group(layout, store):
        conn.save(HASHES, SLOTS)
    keys = PageKeys(CONFIG, layout)
    stored = {k for k in store.data if parse_key(k) is not None}
    assert stored == {k for h in HASHES for k in keys.block_keys(h)}
    assert keys.lookup_keys(HASHES) == [keys.block_keys(h) for h in HASHES]


def test_a_scheduler_lookup_answers_from_a_real_store_without_importing_torch(tmp_path):
    """The scheduler side of an engine never imports torch nor allocates staging."""
    layout = minimax_m3(tp_size=2)
    config = {"model": "m", "backend": "lmdb", "options": {"path": str(tmp_path / "s")}}
    import torch

    from kvconn.connector import Connector
    from tests.helpers import fill_pool

    for rank in range(2):
        pools = [torch.zeros(size, dtype=torch.uint8) for size in layout.pool_sizes]
        fill_pool(layout, rank, pools)
        with Connector(config, layout, rank=rank, pools=pools) as conn:
            conn.save(HASHES[:3], SLOTS[:3])
    script = textwrap.dedent(
        f"""
        import json, sys
        from kvconn.layout import KvLayout
        from kvconn.lookup import Lookup
        layout = KvLayout.from_dict(json.loads(sys.argv[1]))
        hashes = [bytes.fromhex(h) for h in json.loads(sys.argv[2])]
        with Lookup({config!r}, layout) as lookup:
            hit = lookup.lookup(hashes)
        print(json.dumps([hit.blocks, hit.tokens, "torch" in sys.modules]))
        """
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            json.dumps(layout.to_dict()),
            json.dumps([h.hex() for h in HASHES]),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == [3, 96, False]


def test_a_deadline_lookup_answers_at_once_when_the_store_is_quick():
    layout = minimax_m3(tp_size=2)
    store = GatedBackend()
    for conn in tp_group(layout, store):
        conn.save(HASHES, SLOTS)
    lookup = Lookup(CONFIG, layout, backend=store)
    asker = DeadlineLookup(lookup, wait_s=5.0, timeout_s=10.0)
    try:
        answer = asker.ask("r1", HASHES)
        assert answer is not None and answer.blocks == N
    finally:
        asker.close()


@contextlib.contextmanager
def stalled_store(
    *, saved: bool = False, **deadlines: Any
) -> Iterator[tuple[GatedBackend, DeadlineLookup]]:
    """A store whose ``exists`` hangs until released (holding ``HASHES`` if ``saved``),
    and a lookup of it within ``deadlines`` (``DeadlineLookup``'s arguments); released
    and closed afterwards."""
    layout = minimax_m3(tp_size=2)
    store = GatedBackend()
    if saved:
        for conn in tp_group(layout, store):
            conn.save(HASHES, SLOTS)
    asker = DeadlineLookup(Lookup(CONFIG, layout, backend=store), **deadlines)
    store.hold("exists")
    try:
        yield store, asker
    finally:
        store.release("exists")
        asker.close()


def test_a_stalled_store_gets_ask_again_later_then_a_miss_never_a_waiting_scheduler():
    with stalled_store(wait_s=0.005, timeout_s=0.2) as (_, asker):
        slowest = 0.0
        answers = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            start = time.monotonic()
            answer = asker.ask("r1", HASHES)
            slowest = max(slowest, time.monotonic() - start)
            answers.append(answer)
            if answer is not None:
                break
            time.sleep(0.01)
        assert answers[0] is None  # ask again later
        assert answers[-1] is not None and answers[-1].blocks == 0
        assert not answers[-1].available
        assert slowest < 0.1  # each ask waited about wait_s, not for the store
        assert asker.timed_out == 1


def test_a_stalled_store_does_not_queue_lookups_without_bound():
    with stalled_store(wait_s=0.0, timeout_s=60.0, max_pending=3) as (_, asker):
        assert [asker.ask(i, HASHES) for i in range(3)] == [None] * 3
        fourth = asker.ask(3, HASHES)
        assert fourth is not None and fourth.blocks == 0 and not fourth.available


def test_a_miss_served_late_is_logged_once_an_interval_with_how_long_the_store_took(caplog):
    """A hit that became a recompute because the store was late must not be silent."""
    with stalled_store(wait_s=0.0, timeout_s=0.05, max_pending=1) as (store, asker):
        with caplog.at_level("WARNING", logger="kvconn"):
            assert asker.ask("r1", HASHES) is None
            time.sleep(0.06)
            late = asker.ask("r1", HASHES)
            assert late is not None and not late.available
            r2 = asker.ask("r2", HASHES)  # a miss at once: r1 is still unanswered
            assert r2 is not None and not r2.available  # late again, within the interval
            store.release("exists")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and "answered after" not in caplog.text:
                time.sleep(0.01)
        lines = [r.getMessage() for r in caplog.records]
        late_lines = [m for m in lines if "slow to answer lookups" in m]
        assert late_lines == [
            "kvconn: backend 'dict' is slow to answer lookups: a lookup got no answer "
            "within lookup_timeout_s (50 ms), so it was served as a miss "
            "(1 such misses so far)"
        ]
        answered = [m for m in lines if "answered after" in m]
        assert len(answered) == 1  # only the logged one says when it came
        took_ms = float(answered[0].split("after ")[1].split(" ms")[0])
        assert took_ms >= 50
        assert asker.timed_out == 2


def test_after_a_lookup_times_out_new_ones_are_misses_at_once_until_the_store_answers():
    """TensorRT-LLM's scheduler waits for each new request up to the timeout: on a
    silent store only the first request may wait, not every one."""
    with stalled_store(saved=True, wait_s=0.1, timeout_s=0.1) as (store, asker):
        asked_before = store.ops("exists")
        start = time.monotonic()
        first = asker.ask("r0", HASHES)
        assert first is not None and not first.available
        assert time.monotonic() - start >= 0.1  # waited for the store, up to the timeout
        start = time.monotonic()
        later = [asker.ask(f"r{i}", HASHES) for i in range(1, 21)]
        assert time.monotonic() - start < 0.1  # 20 requests, none waiting for the store
        assert all(a is not None and not a.available for a in later)
        assert asker.timed_out == 21
        assert store.ops("exists") == asked_before  # r0's is at the gate, no other came
        store.release("exists")
        deadline = time.monotonic() + 5
        answer = None
        while time.monotonic() < deadline and (answer is None or not answer.available):
            answer = asker.ask(f"after-{time.monotonic()}", HASHES)
        assert answer is not None and answer.blocks == N  # it answers again: hits again


def test_a_lookup_that_times_out_or_is_forgotten_before_a_thread_took_it_never_runs():
    layout = minimax_m3(tp_size=2)
    store = GatedBackend()
    asker = DeadlineLookup(
        Lookup(CONFIG, layout, backend=store), wait_s=0.0, timeout_s=0.05, threads=1
    )
    store.hold("exists")
    try:
        assert asker.ask("stuck", HASHES) is None
        assert store.wait_entered("exists")  # the one thread is held by "stuck"
        assert asker.ask("queued", HASHES) is None
        assert asker.ask("gone", HASHES) is None
        asker.forget("gone")
        time.sleep(0.06)
        queued = asker.ask("queued", HASHES)
        assert queued is not None and not queued.available
        stuck = asker.ask("stuck", HASHES)
        assert stuck is not None and not stuck.available
        store.release("exists")
        deadline = time.monotonic() + 5
        answer = None
        while time.monotonic() < deadline and (answer is None or not answer.available):
            answer = asker.ask("next", HASHES)  # a miss at once until "stuck" is answered
            time.sleep(0.01)
        assert answer is not None and answer.available
        time.sleep(0.05)
        # "stuck" and "next" asked the store; "queued" and "gone" were cancelled
        assert store.ops("exists") == 2
    finally:
        store.release("exists")
        asker.close()


def test_a_forgotten_lookup_the_store_hangs_on_makes_new_ones_misses_after_the_timeout():
    """A request that went away while its lookup hangs in the store leaves the same
    evidence as one that timed out: later requests must not wait for the store too."""
    with stalled_store(saved=True, wait_s=0.0, timeout_s=0.1) as (store, asker):
        asked_before = store.ops("exists")
        assert asker.ask("gone", HASHES) is None
        assert store.wait_entered("exists")  # a thread runs it: forget cannot cancel it
        asker.forget("gone")
        fresh = asker.ask("early", HASHES)  # within the timeout: the store is not late yet
        assert fresh is None
        asker.forget("early")
        time.sleep(0.12)
        start = time.monotonic()
        later = asker.ask("later", HASHES)
        assert time.monotonic() - start < 0.05
        assert later is not None and not later.available  # at once, no thread asked
        assert asker.timed_out == 1
        store.release("exists")
        deadline = time.monotonic() + 5
        answer = None
        while time.monotonic() < deadline and (answer is None or not answer.available):
            answer = asker.ask("again", HASHES)  # misses until "gone" is answered
            time.sleep(0.01)
        assert answer is not None and answer.blocks == N
        # "gone", "early" (its thread had started too) and "again" asked; "later" did not
        assert store.ops("exists") - asked_before <= 3


class SilentServerBackend(DictBackend):
    """A store whose client gives up on each call after ``hang_s`` (a server that
    accepts connections and never answers, behind a client socket timeout)."""

    def __init__(self, hang_s: float) -> None:
        super().__init__()
        self.hang_s = hang_s
        self.silent = True

    def _guard(self, op: str, n: int) -> None:
        if self.silent:
            time.sleep(self.hang_s)
            raise BackendUnavailable(f"{op}: no answer within {self.hang_s}s")
        super()._guard(op, n)


def test_on_a_silent_server_only_the_first_request_waits_not_one_per_client_timeout():
    """A scheduler that cannot ask again later (TensorRT-LLM's) waits up to the timeout
    for each new lookup. Each late lookup against a silent server ends in the client's
    timeout, then the back-off; the lookup after it must not make a request wait again."""
    layout = minimax_m3(tp_size=2)
    store = SilentServerBackend(hang_s=0.15)
    store.silent = False
    for conn in tp_group(layout, store):
        conn.save(HASHES, SLOTS)
    store.silent = True
    config = ConnectorConfig(model="test-model", backend="dict", retry_interval_s=0.05)
    asker = DeadlineLookup(Lookup(config, layout, backend=store), wait_s=0.1, timeout_s=0.1)
    waits: list[float] = []
    try:
        end = time.monotonic() + 1.5  # about six timeouts and back-offs of the client
        while time.monotonic() < end:
            start = time.monotonic()
            answer = None
            while answer is None:  # as TensorRT-LLM's scheduler: until an answer
                answer = asker.ask(f"r{len(waits)}", HASHES)
            waits.append(time.monotonic() - start)
            assert not answer.available
            time.sleep(0.01)
        assert len(waits) > 20
        assert sum(w >= 0.09 for w in waits) == 1  # the first request alone waited
        store.silent = False  # the server answers again: a probe finds it, hits return
        deadline = time.monotonic() + 5
        answer = None
        while time.monotonic() < deadline and (answer is None or not answer.available):
            answer = asker.ask(f"after-{time.monotonic()}", HASHES)
            time.sleep(0.01)
        assert answer is not None and answer.blocks == N
    finally:
        asker.close()


def test_lookups_refused_for_a_stalled_store_are_logged_with_the_count(caplog):
    deadlines: dict[str, Any] = {"wait_s": 0.0, "timeout_s": 60.0, "max_pending": 2}
    with stalled_store(**deadlines, log_interval_s=0.0) as (_, asker):
        with caplog.at_level("WARNING", logger="kvconn"):
            assert [asker.ask(i, HASHES) for i in range(2)] == [None] * 2
            asker.ask(2, HASHES)
            asker.ask(3, HASHES)
        assert [r.getMessage() for r in caplog.records if "slow to answer" in r.getMessage()] == [
            "kvconn: backend 'dict' is slow to answer lookups: 2 lookups are still "
            f"unanswered, so it was served as a miss ({n} such misses so far)"
            for n in (1, 2)
        ]


def test_an_answer_that_arrives_late_is_returned_when_asked_again():
    layout = minimax_m3(tp_size=2)
    store = GatedBackend()
    group = tp_group(layout, store)
    for conn in group:
        conn.save(HASHES, SLOTS)
    lookup = Lookup(CONFIG, layout, backend=store)
    asker = DeadlineLookup(lookup, wait_s=0.0, timeout_s=60.0)
    store.hold("exists")
    try:
        assert asker.ask("r1", HASHES) is None
        assert store.wait_entered("exists")
        store.release("exists")
        deadline = time.monotonic() + 5
        answer = None
        while answer is None and time.monotonic() < deadline:
            answer = asker.ask("r1", HASHES)
        assert answer is not None and answer.blocks == N
    finally:
        asker.close()


class LocalBackend(GatedBackend):
    """A store that answers from this host, ``delay_s`` per ``exists``; notes the
    threads its lookups ran on."""

    capabilities = Capabilities(delete=True, thread_safe=True, local=True)

    def __init__(self) -> None:
        super().__init__()
        self.delay_s = 0.0
        self.threads: list[int] = []

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)
        return super()._exists(keys)


def test_a_local_store_is_asked_on_the_callers_thread_without_a_hand_off():
    layout = minimax_m3(tp_size=2)
    store = LocalBackend()
    for conn in tp_group(layout, store):
        conn.save(HASHES, SLOTS)
    asker = DeadlineLookup(Lookup(CONFIG, layout, backend=store), wait_s=0.5, timeout_s=5.0)
    try:
        answers = [asker.ask(i, HASHES[: i + 1]) for i in range(N)]
        assert [a.blocks if a else None for a in answers] == [1, 2, 3, 4]
        assert set(store.threads) == {threading.get_ident()}
        assert asker.inline
    finally:
        asker.close()


def test_lmdb_is_asked_inline_and_redis_is_not(tmp_path):
    from kvconn_lmdb import LmdbBackend
    from kvconn_redis import RedisBackend

    layout = minimax_m3(tp_size=2)
    with LmdbBackend(str(tmp_path / "s")) as lmdb:
        asker = DeadlineLookup(Lookup(CONFIG, layout, backend=lmdb))
        assert asker.inline
        answer = asker.ask("r", HASHES)
        assert answer is not None and answer.blocks == 0 and answer.available
        asker.close()
    assert not RedisBackend.capabilities.local  # a round trip: under the deadline


def test_lookup_inline_false_asks_even_a_local_store_through_the_thread():
    layout = minimax_m3(tp_size=2)
    store = LocalBackend()
    config = replace(CONFIG, lookup_inline=False)
    asker = DeadlineLookup(Lookup(config, layout, backend=store), wait_s=5.0, timeout_s=10.0)
    try:
        answer = asker.ask("r", HASHES)
        assert answer is not None and not asker.inline
        assert store.threads and threading.get_ident() not in store.threads
    finally:
        asker.close()


def test_lookup_inline_is_read_from_the_environment_as_a_bool():
    config = ConnectorConfig.from_env({"KVCONN_MODEL": "m", "KVCONN_LOOKUP_INLINE": "false"})
    assert config.lookup_inline is False


def test_a_local_store_that_stays_slow_is_asked_on_a_thread_under_the_deadline():
    layout = minimax_m3(tp_size=2)
    store = LocalBackend()
    store.delay_s = DeadlineLookup.SLOW_INLINE_S + 0.01
    asker = DeadlineLookup(Lookup(CONFIG, layout, backend=store), wait_s=0.01, timeout_s=5.0)
    me = threading.get_ident()
    try:
        for i in range(DeadlineLookup.SLOW_INLINE_ANSWERS):
            answer = asker.ask(i, HASHES)  # slow, but answered where it was asked
            assert answer is not None and answer.blocks == 0
        assert store.threads == [me] * DeadlineLookup.SLOW_INLINE_ANSWERS
        assert not asker.inline
        start = time.monotonic()
        assert asker.ask("later", HASHES) is None  # ask again later, as from any store
        assert time.monotonic() - start < DeadlineLookup.SLOW_INLINE_S
        deadline = time.monotonic() + 5
        answer = None
        while answer is None and time.monotonic() < deadline:
            answer = asker.ask("later", HASHES)
        assert answer is not None and store.threads[-1] != me
    finally:
        asker.close()


def test_slow_answers_of_a_busy_cpu_or_two_of_a_slow_disk_keep_lookups_inline():
    layout = minimax_m3(tp_size=2)
    store = LocalBackend()
    asker = DeadlineLookup(Lookup(CONFIG, layout, backend=store), wait_s=0.01, timeout_s=5.0)
    try:
        slow = DeadlineLookup.SLOW_INLINE_S + 0.01
        # 20 ms: over wait_s, but what a busy CPU makes of a lookup, not a stalled disk
        for i, delay in enumerate([slow, slow, 0.0, 0.02, 0.02, 0.02, slow, slow, 0.0]):
            store.delay_s = delay
            assert asker.ask(i, HASHES) is not None
        assert asker.inline
        assert set(store.threads) == {threading.get_ident()}
    finally:
        asker.close()


def test_a_lookup_on_a_closed_lookup_is_an_error():
    from kvconn.errors import ConnectorClosed

    lookup = Lookup(CONFIG, minimax_m3(tp_size=2), backend=GatedBackend())
    lookup.close()
    with pytest.raises(ConnectorClosed):
        lookup.lookup(HASHES)


# ------------------------------------------------------------------ pipeline stages
def _stage(layout: KvLayout, first_layer: int) -> KvLayout:
    """``layout``'s pools holding the model's layers from ``first_layer`` on: another
    pipeline stage's, of the same shape."""
    groups = tuple(
        replace(g, regions=tuple(replace(r, layer=r.layer + first_layer) for r in g.regions))
        for g in layout.groups
    )
    return replace(layout, groups=groups)


STAGE0 = minimax_m3(tp_size=2)
STAGE1 = _stage(STAGE0, 100)


def test_a_pipeline_lookup_is_a_hit_only_where_every_stage_holds_its_pages():
    store = DictBackend()
    for conn in tp_group(STAGE0, store):  # stage 0 saved every block
        conn.save(HASHES, SLOTS)
    for conn in tp_group(STAGE1, store):  # stage 1 only the first two
        conn.save(HASHES[:2], SLOTS[:2])
    assert Lookup(CONFIG, STAGE0, backend=store).lookup(HASHES).blocks == N
    assert Lookup(CONFIG, STAGE1, backend=store).lookup(HASHES).blocks == 2
    store.calls.clear()
    both = Lookup(CONFIG, STAGE0, backend=store, stages=[STAGE1])
    assert both.lookup(HASHES).blocks == 2
    assert Lookup(CONFIG, STAGE1, backend=store, stages=[STAGE0]).lookup(HASHES).blocks == 2
    # one exists for both stages' pages (and the markers of their shared kinds)
    assert [op for op, _ in store.calls] == ["exists", "exists"]


def test_each_stage_keys_its_pages_apart():
    zero, one = PageKeys(CONFIG, STAGE0), PageKeys(CONFIG, STAGE1)
    assert set(zero.block_keys(HASHES[0])).isdisjoint(one.block_keys(HASHES[0]))


def test_stages_that_disagree_on_the_block_size_are_refused():
    other = replace(STAGE1, tokens_per_block=16)
    with pytest.raises(LayoutError, match="32 and 16 tokens per block"):
        Lookup(CONFIG, STAGE0, backend=DictBackend(), stages=[other])


def test_a_marker_on_one_stage_keys_only_that_stage_per_rank():
    store = DictBackend()
    lookup = Lookup(CONFIG, STAGE0, backend=store, stages=[STAGE1])
    kind, marker = next(iter(lookup.stages[0].markers.items()))
    assert store.put([marker], [memoryview(b"{}")]) == [True]
    assert lookup.lookup(HASHES).blocks == 0
    assert lookup.stages[0].per_rank == {kind}
    assert lookup.keys.per_rank == frozenset()


# ------------------------------------------------------------------ windows per lookup
def _hybrid(window: int | None = None) -> KvLayout:
    """A full-attention group and a sliding-window group, each over a pool of its own."""
    from kvconn.layout import LayerGroup, Region, Role

    roles = (Role("k", 2, "bf16"), Role("swa_k", 2, "bf16"))
    groups = (
        LayerGroup(0, 4, (Region("k", 0, 0, 64, 64, 4, pool=0),), "full"),
        LayerGroup(1, 4, (Region("swa_k", 0, 0, 64, 64, 4, pool=1),), "swa", window=window),
    )
    return KvLayout(2, 32, roles, groups, (256, 256))


def _store_windowed(store: DictBackend, layout: KvLayout, missing_swa: Sequence[int]) -> None:
    """Every block's full pages, and its sliding-window pages but for ``missing_swa``."""
    keys = PageKeys(CONFIG, layout)
    full = [k for h in HASHES for k in keys.block_keys(h) if "/lg0/" in k]
    swa = [
        k
        for i, h in enumerate(HASHES)
        if i not in missing_swa
        for k in keys.block_keys(h)
        if "/lg1/" in k
    ]
    store.put(full + swa, [memoryview(b"x")] * len(full + swa))


def test_a_window_given_per_lookup_makes_a_later_prefix_a_hit_past_a_hole():
    layout = _hybrid()
    store = DictBackend()
    _store_windowed(store, layout, missing_swa=[1])
    lookup = Lookup(CONFIG, layout, backend=store, follow_markers=False)
    assert lookup.lookup(HASHES).blocks == 1  # the layout needs every sliding page
    hit = lookup.lookup(HASHES, windows={1: 2})
    assert (hit.blocks, hit.tokens, hit.restorable) == (4, 128, (1, 4))
    assert hit.prefixes() == (1, 4)
    assert lookup.lookup(HASHES).prefixes() == (1,)


def test_a_group_whose_window_is_zero_is_not_asked_for():
    layout = _hybrid()
    store = DictBackend()
    _store_windowed(store, layout, missing_swa=[0, 1, 2, 3])
    lookup = Lookup(CONFIG, layout, backend=store, follow_markers=False)
    store.calls.clear()
    hit = lookup.lookup(HASHES, windows={1: 0})
    assert (hit.blocks, hit.restorable) == (N, None)
    full_keys = [k for k in PageKeys(CONFIG, layout).block_keys(HASHES[0]) if "/lg0/" in k]
    assert store.calls == [("exists", N * len(full_keys))]


def test_windows_override_the_layouts_window_for_one_lookup_only():
    layout = _hybrid(window=1)
    store = DictBackend()
    _store_windowed(store, layout, missing_swa=[2])
    lookup = Lookup(CONFIG, layout, backend=store, follow_markers=False)
    assert lookup.lookup(HASHES).prefixes() == (1, 2, 4)
    assert lookup.lookup(HASHES, windows={1: None}).prefixes() == (1, 2)
    assert lookup.lookup(HASHES, windows={1: 3}).prefixes() == (1, 2)


@pytest.mark.parametrize(
    ("windows", "message"),
    [
        ({2: 1}, "names layer group 2; the layout's groups are \\[0, 1\\]"),
        ({1: -1}, "window of layer group 1 must be None"),
        ({1: True}, "window of layer group 1 must be None"),
        ({0: 0, 1: 0}, "leave no layer group"),
    ],
)
def test_windows_that_name_no_group_or_no_window_are_refused(windows, message):
    lookup = Lookup(CONFIG, _hybrid(), backend=DictBackend())
    with pytest.raises(ArgumentError, match=message):
        lookup.lookup(HASHES, windows=windows)


def test_pipeline_stages_agree_on_the_prefixes_every_stage_can_restore():
    zero = _hybrid()
    one = _stage(zero, 100)
    store = DictBackend()
    _store_windowed(store, zero, missing_swa=[1])
    _store_windowed(store, one, missing_swa=[2])
    lookup = Lookup(CONFIG, zero, backend=store, stages=[one], follow_markers=False)
    # window 1: stage 0 restores 1, 3, 4 and stage 1 restores 1, 2, 4
    assert lookup.lookup(HASHES, windows={1: 1}).prefixes() == (1, 4)
