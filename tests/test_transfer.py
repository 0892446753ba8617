"""The asynchronous transfer service's rules, over in-memory stores (core logic only).

On real stores the same service runs inside the engines' tests: vLLM end to end
(contrib/vllm/tests, on LMDB, and on Redis and Mooncake servers in ``nox -s
vllm_stores``), SGLang's HiCache controller (contrib/sglang/tests, ``sglang_stores``) and
the TensorRT-LLM stand-in (contrib/tensorrt_llm/tests, on LMDB), and beside Mooncake's
memory registration in tests/test_mooncake_backend.py.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest
import torch

from kvconn.backend import Capabilities
from kvconn.connector import Connector
from kvconn.cpus import connecting_on
from kvconn.errors import ArgumentError, BackendUnavailable, ConfigError, ConnectorClosed
from kvconn.hashing import block_hashes
from kvconn.integrity import PageChecksum
from kvconn.keys import parse_manifest_key
from kvconn.results import LoadResult, Outcome, SaveResult
from kvconn.slots import slot_map
from kvconn.tools.models import minimax_m3
from kvconn.transfer import LoadRequest, SaveRequest, Transfer, TransferService
from tests.fakes import DictBackend, GatedBackend
from tests.helpers import slot_bytes, tp_group

N = 6
HASHES = block_hashes(list(range(32 * N)), 32)
OTHER = block_hashes(list(range(1000, 1000 + 32 * N)), 32)
SLOTS = [5, 1, 9, 3, 7, 11]
TRAILER = PageChecksum().size


def pages(store):
    return {k: v for k, v in store.data.items() if parse_manifest_key(k) is None}


def finished_within(service, count, timeout=10.0):
    """Poll ``finished()`` as an engine does each step, until ``count`` transfers end."""
    out: list[Transfer] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        out.extend(service.finished())
        time.sleep(0.002)
    return out


@pytest.fixture
def services():
    made: list[TransferService] = []
    yield made
    for s in made:
        s.close(timeout_s=2)


def service_for(conn, services, **kw):
    s = TransferService(conn, **kw)
    services.append(s)
    return s


def test_an_async_save_stores_exactly_what_a_synchronous_save_stores(services):
    layout = minimax_m3(tp_size=2)
    sync_store, async_store = DictBackend(), GatedBackend()
    for a, b in zip(tp_group(layout, sync_store), tp_group(layout, async_store)):
        a.save(HASHES, SLOTS)
        transfer = service_for(b, services).save(HASHES, SLOTS, tag="r1")
        assert transfer.wait(10)
        assert isinstance(transfer.result, SaveResult) and transfer.result.ok
    assert async_store.data == sync_store.data


def test_every_block_of_a_save_reports_written_or_skipped():
    store = GatedBackend()
    (conn,) = tp_group(minimax_m3(tp_size=1), store)
    service = TransferService(conn)
    try:
        first = service.save(HASHES[:3], SLOTS[:3])
        assert first.wait(10)
        assert first.outcomes == (Outcome.WRITTEN,) * 3
        again = service.save(HASHES, SLOTS)
        assert again.wait(10)
        assert again.outcomes == (Outcome.SKIPPED,) * 3 + (Outcome.WRITTEN,) * 3
        assert finished_within(service, 2) == [first, again]
    finally:
        service.close()


def test_a_steps_saves_reach_the_store_as_one_exists_and_one_put(services):
    store = GatedBackend()
    (conn,) = tp_group(minimax_m3(tp_size=1), store)
    service = service_for(conn, services)
    store.calls.clear()
    requests = [
        SaveRequest(HASHES[i : i + 2], SLOTS[i : i + 2], tag=f"req{i}") for i in range(0, N, 2)
    ]
    transfers = service.save_many(requests)
    assert all(t.wait(10) for t in transfers)
    page_calls = [c for c in store.calls if c[1] != len(conn.keys.manifests)]
    assert page_calls == [("exists", N * 2), ("put", N * 2)]  # K/V shard + replicated page
    assert [t.tag for t in transfers] == ["req0", "req2", "req4"]


def test_a_block_reused_right_after_its_save_was_handed_over_stores_its_old_bytes(services):
    """The engine may free or reuse a block as soon as the save is submitted: its pages
    were captured into staging, so the store never sees the next request's bytes."""
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    reference_store = DictBackend()
    (reference,) = tp_group(layout, reference_store)
    reference.save(HASHES, SLOTS)
    service = service_for(conn, services)
    store.hold("exists")  # the store has not even been asked yet
    transfer = service.save(HASHES, SLOTS)
    assert store.wait_entered("exists")
    for pool in conn.pools:
        pool.fill_(0xAB)  # every block reused by another request and overwritten
    store.release("exists")
    assert transfer.wait(10) and transfer.result.ok
    assert pages(store) == pages(reference_store)


def test_at_the_staging_ceiling_new_saves_are_dropped_and_counted(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    one_save = conn.capture_bytes(
        conn.owned_pages(HASHES[:2], slot_map(layout, SLOTS[:2], HASHES[:2]))
    )
    service = service_for(conn, services, inflight_bytes=one_save)
    store.hold("exists")
    first = service.save(HASHES[:2], SLOTS[:2], tag="fits")
    assert store.wait_entered("exists")
    second = service.save(HASHES[2:4], SLOTS[2:4], tag="no room")
    assert second.done()  # decided at once: the engine is never made to wait
    assert second.outcomes == (Outcome.DROPPED,) * 2
    assert conn.stats.staging_full == 1
    assert conn.stats.pages("dropped") == 4
    store.release("exists")
    assert first.wait(10) and first.result.ok
    third = service.save(HASHES[2:4], SLOTS[2:4])  # room again once the first is stored
    assert third.wait(10) and third.outcomes == (Outcome.WRITTEN,) * 2


def test_a_save_larger_than_staging_is_stored_in_parts_with_one_outcome_per_block(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    per_page = max(p.value_size for p in conn.plans)
    conn.config = conn.config.__class__(  # staging fits about one page
        **{**conn.config.__dict__, "staging_bytes": per_page + 64}
    )
    service = service_for(conn, services)
    transfer = service.save(HASHES, SLOTS)
    assert transfer.wait(10)
    assert transfer.outcomes == (Outcome.WRITTEN,) * N
    assert transfer.result.written == 2 * N
    assert conn.lookup(HASHES).blocks == N


def test_an_async_load_fills_the_slots_and_reports_every_block_loaded(services):
    layout = minimax_m3(tp_size=2)
    store = GatedBackend()
    writers = tp_group(layout, store)
    for w in writers:
        w.save(HASHES, SLOTS)
    readers = tp_group(layout, store, fill=False)
    target = [20, 21, 22, 40, 41, 63]
    for w, r in zip(writers, readers):
        service = service_for(r, services)
        transfer = service.load(HASHES, target, tag="hit")
        assert finished_within(service, 1) == [transfer]
        assert transfer.result == LoadResult(N)
        assert transfer.outcomes == (Outcome.LOADED,) * N
        for src, dst in zip(SLOTS, target):
            assert slot_bytes(layout, r.pools, dst) == slot_bytes(layout, w.pools, src)


def test_a_steps_loads_handed_over_together_each_fill_their_own_slots(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (writer,) = tp_group(layout, store)
    writer.save(HASHES, SLOTS)
    (reader,) = tp_group(layout, store, fill=False)
    service = service_for(reader, services)
    targets = [[20, 21], [40, 41, 42], []]
    transfers = service.load_many(
        [LoadRequest(HASHES[: len(t)], t, tag=i) for i, t in enumerate(targets)]
    )
    assert all(t.wait(10) for t in transfers)
    assert [(t.tag, t.result.loaded) for t in transfers] == [(0, 2), (1, 3), (2, 0)]
    for target in targets:
        for src, dst in zip(SLOTS, target):
            assert slot_bytes(layout, reader.pools, dst) == slot_bytes(layout, writer.pools, src)


def test_an_async_load_of_evicted_pages_fails_those_blocks_and_leaves_their_slots(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (writer,) = tp_group(layout, store)
    writer.save(HASHES, SLOTS)
    for key in [k for k in store.data if k.endswith(HASHES[3].hex())]:
        del store.data[key]
    (reader,) = tp_group(layout, store, fill=False)
    transfer = service_for(reader, services).load(HASHES, SLOTS)
    assert transfer.wait(10)
    assert transfer.result == LoadResult(3, (3, 4, 5))
    assert all(
        slot_bytes(layout, reader.pools, s) == bytes(len(slot_bytes(layout, reader.pools, s)))
        for s in SLOTS[3:]
    )


def stalled_reader(services):
    """A store holding every block of HASHES whose reads hang until released, and a
    reader over it whose service fails loads 50 ms after they were submitted."""
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (writer,) = tp_group(layout, store)
    writer.save(HASHES, SLOTS)
    (reader,) = tp_group(layout, store, fill=False)
    service = service_for(reader, services)
    service.load_timeout_s = 0.05
    store.hold("get")
    return store, reader, service


def test_a_load_stalled_past_its_timeout_fails_and_its_late_bytes_never_reach_the_slots(
    services,
):
    store, reader, service = stalled_reader(services)
    transfer = service.load(HASHES, SLOTS)
    assert store.wait_entered("get")
    assert finished_within(service, 1, timeout=5) == [transfer]
    assert transfer.result == LoadResult(0, tuple(range(N)))
    before = [t.clone() for t in reader.pools]
    store.release("get")  # the store answers after all
    time.sleep(0.2)
    assert all(torch.equal(a, b) for a, b in zip(before, reader.pools))


def test_loads_failed_for_being_late_are_all_counted_but_logged_once_an_interval(services, caplog):
    store, reader, service = stalled_reader(services)
    with caplog.at_level("WARNING", logger="kvconn"):
        for step in range(3):  # a stalled store fails the loads of step after step
            loads = service.load_many(
                [LoadRequest(HASHES[i : i + 1], SLOTS[i : i + 1], tag=(step, i)) for i in range(N)]
            )
            assert sorted(map(id, finished_within(service, N))) == sorted(map(id, loads))
    store.release("get")
    assert reader.stats.late_loads == 3 * N
    assert reader.stats.snapshot()["late_loads"] == 3 * N
    late = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(late) == 1, late
    assert f"{N} load(s)" in late[0] and f"({N} late loads so far)" in late[0]


def test_a_backend_that_fails_mid_flight_gives_failed_and_dropped_blocks_not_exceptions(
    services,
):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    conn.save(HASHES[:3], SLOTS[:3])
    service = service_for(conn, services)
    store.down = True
    save = service.save(HASHES[3:], SLOTS[3:])
    load = service.load(HASHES[:3], [30, 31, 32])
    assert save.wait(10) and load.wait(10)
    assert save.outcomes == (Outcome.DROPPED,) * 3
    assert load.outcomes == (Outcome.FAILED,) * 3
    assert conn.stats.backend_errors >= 1


def test_loads_wait_for_staging_room_instead_of_failing(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    conn.save(HASHES[:2], SLOTS[:2])
    room = max(
        conn.load_bytes(2),
        conn.capture_bytes(conn.owned_pages(OTHER[:2], slot_map(layout, [40, 41], OTHER[:2]))),
    )
    service = service_for(conn, services, inflight_bytes=room)
    store.hold("exists")
    save = service.save(OTHER[:2], [40, 41])  # holds all the room while the store stalls
    assert store.wait_entered("exists")
    load = service.load(HASHES[:2], [50, 51])
    time.sleep(0.1)
    assert not load.done()  # waiting for room, not failed
    store.release("exists")
    assert save.wait(10) and load.wait(10)
    assert load.result == LoadResult(2)


def test_a_load_is_not_held_behind_a_stalled_put_on_a_thread_safe_backend(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()  # declares thread_safe
    (conn,) = tp_group(layout, store)
    conn.save(HASHES[:2], SLOTS[:2])
    service = service_for(conn, services)
    store.hold("put")
    save = service.save(OTHER, SLOTS)
    assert store.wait_entered("put")
    load = service.load(HASHES[:2], [50, 51])
    assert load.wait(10) and load.result.ok  # while the put is still stalled
    assert not save.done()
    store.release("put")
    assert save.wait(10)


def test_close_ends_in_flight_work_within_its_deadline_on_a_stalled_store():
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    conn.save(HASHES[:2], SLOTS[:2])
    service = TransferService(conn)
    store.hold("get")
    store.hold("put")
    save = service.save(OTHER, SLOTS)
    load = service.load(HASHES[:2], [50, 51])
    assert store.wait_entered("get") and store.wait_entered("put")
    start = time.monotonic()
    clean = service.close(timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    assert not clean  # threads are still inside the stalled calls
    assert load.done() and load.outcomes == (Outcome.FAILED,) * 2
    assert save.done() and all(o is Outcome.DROPPED for o in save.outcomes)
    store.release("get")
    store.release("put")


def test_transfers_after_close_are_errors_not_silent_misses():
    (conn,) = tp_group(minimax_m3(tp_size=1), DictBackend())
    service = TransferService(conn)
    service.close()
    with pytest.raises(ConnectorClosed):
        service.save(HASHES, SLOTS)
    with pytest.raises(ConnectorClosed):
        service.load(HASHES, SLOTS)
    conn.close()
    with pytest.raises(ConnectorClosed):
        conn.lookup(HASHES)
    with pytest.raises(ConnectorClosed):
        conn.save(HASHES, SLOTS)


def test_bad_arguments_are_refused_on_the_submitting_thread_before_anything_is_captured(
    services,
):
    store = GatedBackend()
    (conn,) = tp_group(minimax_m3(tp_size=1), store)
    service = service_for(conn, services)
    with pytest.raises(ArgumentError):
        service.save_many([SaveRequest(HASHES, SLOTS), SaveRequest(HASHES, SLOTS[:2])])
    with pytest.raises(ArgumentError):
        service.load(HASHES, [1, 1, 2, 3, 4, 5])
    # a step's loads are checked together: one bad request queues none of them
    with pytest.raises(ArgumentError):
        service.load_many([LoadRequest(HASHES, SLOTS), LoadRequest(HASHES, SLOTS[:2])])
    assert service.in_flight == 0 and not pages(store)


def test_a_serialized_backend_still_works_from_the_service_threads(services):
    class Serial(DictBackend):
        capabilities = Capabilities(delete=True)  # not thread-safe: calls are serialized

    layout = minimax_m3(tp_size=2)
    store = Serial()
    group = tp_group(layout, store)
    svcs = [service_for(c, services) for c in group]
    saves = [s.save(HASHES, SLOTS) for s in svcs]
    assert all(t.wait(10) and t.result.ok for t in saves)
    readers = tp_group(layout, store, fill=False)
    loads = [service_for(r, services).load(HASHES, SLOTS) for r in readers]
    assert all(t.wait(10) and t.result == LoadResult(N) for t in loads)


def test_many_concurrent_requests_each_get_their_own_outcomes(services):
    layout = minimax_m3(tp_size=1)
    store = GatedBackend()
    (conn,) = tp_group(layout, store)
    service = service_for(conn, services)
    prompts = [block_hashes(list(range(r * 10_000, r * 10_000 + 64)), 32) for r in range(8)]
    saves = [service.save(h, [2 * r, 2 * r + 1], tag=r) for r, h in enumerate(prompts)]
    assert all(t.wait(10) and t.outcomes == (Outcome.WRITTEN,) * 2 for t in saves)
    (reader,) = tp_group(layout, store, fill=False)
    rservice = service_for(reader, services)
    loads = [rservice.load(h, [20 + 2 * r, 21 + 2 * r], tag=r) for r, h in enumerate(prompts)]
    done = finished_within(rservice, 8)
    assert sorted(t.tag for t in done) == list(range(8))
    for r in range(8):
        for src, dst in ((2 * r, 20 + 2 * r), (2 * r + 1, 21 + 2 * r)):
            assert slot_bytes(layout, reader.pools, dst) == slot_bytes(layout, conn.pools, src)
    assert all(t.result.ok for t in loads)


def test_a_backend_that_raises_while_the_service_stores_does_not_kill_its_thread(services):
    class Flaky(GatedBackend):
        def __init__(self) -> None:
            super().__init__()
            self.fail_next = threading.Event()

        def _exists(self, keys):
            if self.fail_next.is_set():
                self.fail_next.clear()
                raise BackendUnavailable("one bad answer")
            return super()._exists(keys)

    layout = minimax_m3(tp_size=1)
    store = Flaky()
    (conn,) = tp_group(layout, store)
    conn.config = conn.config.__class__(**{**conn.config.__dict__, "retry_interval_s": 0})
    conn.calls.retry_interval_s = 0
    service = service_for(conn, services)
    store.fail_next.set()
    first = service.save(HASHES[:2], SLOTS[:2])
    assert first.wait(10) and first.outcomes == (Outcome.DROPPED,) * 2
    second = service.save(HASHES[2:4], SLOTS[2:4])
    assert second.wait(10) and second.outcomes == (Outcome.WRITTEN,) * 2


def test_a_transfer_its_waiter_sees_finished_is_already_in_the_services_finished_list():
    """An adapter that waits on a handle and then collects what finished must find it."""
    transfer = Transfer("load", "t", 1)
    order: list[str] = []
    transfer._on_done = lambda t: order.append(f"recorded, waiters woken: {t.done()}")
    assert transfer.cancel()
    assert order == ["recorded, waiters woken: False"]
    assert transfer.done()


def test_a_shut_scatter_gate_lets_nothing_more_through_and_counts_what_passed():
    from kvconn.gate import ScatterGate

    gate = ScatterGate()
    with gate(2) as allowed:
        assert allowed
    with gate.lock:
        assert gate.close() == 2
    with gate(3) as allowed:
        assert not allowed
    assert gate.passed == 2


def test_transfer_threads_run_on_the_cpus_the_engine_keeps_for_them(services):
    """An engine that binds its step to a core names other cores for transfers (vLLM's
    CPU backend keeps one per NUMA node): the store and load threads move there, and the
    thread that submits keeps its own."""
    own = os.sched_getaffinity(0)
    chosen = {max(own)}
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    service = service_for(conn, services, cpus=chosen)
    assert service.save(HASHES, SLOTS).wait(10)
    assert service.load(HASHES, [s + 12 for s in SLOTS]).wait(10)
    assert service._threads and all(
        os.sched_getaffinity(t.native_id) == chosen for t in service._threads
    )
    assert os.sched_getaffinity(0) == own


def placed(conn, setting):
    """``conn`` with ``transfer_cpus = setting``: the same layout, pools and store."""
    return Connector(
        replace(conn.config, transfer_cpus=setting),
        conn.layout,
        rank=conn.rank,
        pools=conn.pools,
        backend=conn.backend,
    )


def test_transfer_cpus_inherit_leaves_the_threads_where_they_start(services, caplog):
    """What the engine suggests is not taken: a store server on the kept core, say,
    would take turns with the reads it serves."""
    own = os.sched_getaffinity(0)
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    with caplog.at_level("INFO", logger="kvconn"):
        service = service_for(placed(conn, "inherit"), services, cpus={max(own)})
    assert service.cpus is None
    assert "transfer threads where they start (transfer_cpus = 'inherit')" in caplog.text
    assert service.save(HASHES, SLOTS).wait(10)
    assert service._threads and all(
        os.sched_getaffinity(t.native_id) == own for t in service._threads
    )


def test_transfer_cpus_named_in_the_config_replace_the_engines_suggestion(services, caplog):
    own = os.sched_getaffinity(0)
    chosen = min(own)
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    with caplog.at_level("INFO", logger="kvconn"):
        service = service_for(placed(conn, str(chosen)), services, cpus={max(own) + 1})
    assert service.cpus == {chosen}
    assert f"transfer threads on CPUs [{chosen}] (transfer_cpus = '{chosen}')" in caplog.text
    assert service.load(HASHES, SLOTS).wait(10)
    assert all(os.sched_getaffinity(t.native_id) == {chosen} for t in service._threads)


def test_transfer_cpus_naming_a_cpu_this_machine_lacks_is_refused_at_start_up():
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    missing = os.cpu_count()
    with pytest.raises(ConfigError, match=f"transfer_cpus names CPU {missing}, but this machine"):
        TransferService(placed(conn, f"0,{missing}"))


def test_cpus_the_system_refuses_are_logged_and_the_transfers_still_run(services, caplog):
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    service = service_for(conn, services, cpus={1 << 20})  # no machine has this CPU
    with caplog.at_level("WARNING", logger="kvconn"):
        save = service.save(HASHES, SLOTS)
        assert save.wait(10) and save.result.ok
    assert "cannot run kvconn-store on CPUs [1048576]" in caplog.text


def _affinity_of_a_thread_started_here() -> set[int]:
    seen: list[set[int]] = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return seen[0]


def test_threads_a_client_starts_as_it_connects_run_on_the_transfer_cpus():
    """Mooncake's client starts its I/O threads as it connects; in an engine that binds
    its step to a core they would share the forward pass's core. Connecting on the
    transfer CPUs moves them, and the engine's thread goes back where it was."""
    own = os.sched_getaffinity(0)
    chosen = {max(own)}
    with connecting_on("auto", chosen):
        assert _affinity_of_a_thread_started_here() == chosen
    assert os.sched_getaffinity(0) == own
    with connecting_on(str(min(own)), chosen):  # the configured list wins
        assert _affinity_of_a_thread_started_here() == {min(own)}
    with connecting_on("inherit", chosen):
        assert _affinity_of_a_thread_started_here() == own
    assert os.sched_getaffinity(0) == own


def test_the_engines_thread_goes_back_where_it_was_when_connecting_fails():
    own = os.sched_getaffinity(0)
    with pytest.raises(ConfigError), connecting_on("auto", {max(own)}):
        raise ConfigError("the store refused the connection")
    assert os.sched_getaffinity(0) == own


def test_cpus_refused_while_connecting_are_logged_and_the_connection_is_still_made(caplog):
    own = os.sched_getaffinity(0)
    with caplog.at_level("WARNING", logger="kvconn"), connecting_on("auto", {1 << 20}):
        assert _affinity_of_a_thread_started_here() == own
    assert "cannot connect from CPUs [1048576]" in caplog.text
    assert os.sched_getaffinity(0) == own


@pytest.mark.parametrize("cpus", [set(), {-1}, {True}, {"0"}])
def test_a_cpu_set_that_names_no_cpu_is_refused(cpus):
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    with pytest.raises(ValueError, match="cpus must be a non-empty set of CPU numbers"):
        TransferService(conn, cpus=cpus)


def test_a_load_submitted_while_the_engine_idles_runs_on_the_submitting_threads_cores(
    services, monkeypatch
):
    """The engine's core has nothing to do until such a load is done, and its next
    forward pass reads what the load scatters; a load beside other work, and every save,
    stay on the cores kept for transfers."""
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.skip("needs two CPUs: one for the step, one kept for transfers")
    step, kept = {min(own)}, {max(own)}
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    seen: list[set[int]] = []
    load_into = conn.load_into

    def recorded(*args, **kwargs):
        seen.append(os.sched_getaffinity(0))
        return load_into(*args, **kwargs)

    monkeypatch.setattr(conn, "load_into", recorded)
    service = service_for(conn, services, cpus=kept, load_threads=1)
    os.sched_setaffinity(0, step)  # the engine's step, bound to its core
    try:
        assert service.save(HASHES, SLOTS).wait(10)
        (idle,) = service.load_many([LoadRequest(HASHES, [s + 12 for s in SLOTS])], idle=True)
        assert idle.wait(10) and idle.result.ok
        (busy,) = service.load_many([LoadRequest(HASHES, [s + 24 for s in SLOTS])])
        assert busy.wait(10) and busy.result.ok
    finally:
        os.sched_setaffinity(0, own)
    assert seen == [step, kept]
    store_thread = next(t for t in service._threads if t.name == "kvconn-store")
    assert os.sched_getaffinity(store_thread.native_id) == kept


class ThreadedClientBackend(GatedBackend):
    """A client that moves bytes on I/O threads of its own, as Mooncake's does."""

    capabilities = replace(GatedBackend.capabilities, io_threads=True)


def two_cpus() -> tuple[set[int], set[int]]:
    """One CPU for the engine's step, another for the transfers."""
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.skip("needs two CPUs: one for the step, one for transfers")
    return {min(own)}, {max(own)}


def idle_load_from(step: set[int], service: TransferService) -> None:
    """Save, then load the blocks back in an idle step submitted from ``step``."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, step)
    try:
        assert service.save(HASHES, SLOTS).wait(10)
        (idle,) = service.load_many([LoadRequest(HASHES, [s + 12 for s in SLOTS])], idle=True)
        assert idle.wait(10) and idle.result.ok
    finally:
        os.sched_setaffinity(0, own)


def test_an_idle_load_stays_on_the_kept_cores_when_the_client_has_io_threads(services):
    """Mooncake's I/O threads run on the step's core: a load thread moved there took
    turns with them (1.18x the peer's hit against 0.93x on the kept core)."""
    step, kept = two_cpus()
    (conn,) = tp_group(minimax_m3(tp_size=1), ThreadedClientBackend())
    service = service_for(conn, services, cpus=kept, load_threads=1)
    idle_load_from(step, service)
    assert all(os.sched_getaffinity(t.native_id) == kept for t in service._threads)


def test_an_idle_load_stays_on_the_cpus_the_configuration_names(services):
    """A CPU list the user names holds for every transfer; only cores the engine
    suggests (``auto``) give way to the idle step's."""
    step, named = two_cpus()
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    service = service_for(placed(conn, str(min(named))), services, load_threads=1)
    assert service.cpus == named
    idle_load_from(step, service)
    assert all(os.sched_getaffinity(t.native_id) == named for t in service._threads)


def test_an_idle_load_stays_where_the_threads_start_when_no_cpus_are_kept(services):
    """``transfer_cpus = "inherit"`` (or an engine that keeps no core): nothing moves."""
    own = os.sched_getaffinity(0)
    (conn,) = tp_group(minimax_m3(tp_size=1), GatedBackend())
    service = service_for(placed(conn, "inherit"), services, cpus={max(own)})
    (load,) = service.load_many([LoadRequest(HASHES, SLOTS)], idle=True)
    assert load.wait(10)
    assert all(os.sched_getaffinity(t.native_id) == own for t in service._threads)
