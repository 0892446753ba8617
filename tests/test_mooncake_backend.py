"""The Mooncake backend against a real Mooncake Store: master, metadata server, storage.

Every cluster here is started by the tests on free loopback ports
(:class:`~kvconn.tools.devserver.mooncake.MooncakeCluster`) and stopped at the end; clients
mount no memory, so data lives in standalone storage processes. A missing Mooncake
skips locally and fails in CI (``require_or_skip``).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from kvconn_mooncake._failover import FUTILE_MISSES

from kvconn.backend import ReadStatus
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.cpus import connecting_on
from kvconn.errors import BackendError, BackendUnavailable, ConfigError
from kvconn.hashing import block_hashes
from kvconn.registry import describe_backends, load_backend
from kvconn.testing import BackendTests
from kvconn.testing.suite import require_or_skip
from kvconn.tools.devserver._ports import free_port
from kvconn.tools.devserver.mooncake import MooncakeCluster
from kvconn.tools.models import minimax_m3
from tests.helpers import native_threads, slot_bytes

pytestmark = pytest.mark.server

MiB = 2**20


def _require_mooncake() -> None:
    require_or_skip(MooncakeCluster.available())


@pytest.fixture(scope="module")
def loopback_env() -> Iterator[None]:
    """Keep the test clients' transfer engines on loopback, as the cluster's processes are.

    Without it Mooncake advertises the first non-loopback interface (e.g. eth0).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        # the transport's queue at Mooncake's default, which the backend's bound follows
        for name in (
            "MOONCAKE_CONFIG_PATH",
            "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH",
            "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
        ):
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def cluster(loopback_env: None) -> Iterator[MooncakeCluster]:
    _require_mooncake()
    # write_stall stops the storage process for as long as a test waits for its held
    # puts (up to 30 s on a loaded machine); the master must not take the silence for
    # a death and drop its segment, with every object in it, after its default 10 s.
    with MooncakeCluster(storage_processes=1, segment_size=256 * MiB, client_ttl=120) as running:
        yield running


def _options(cluster: MooncakeCluster, **extra: Any) -> dict[str, Any]:
    return {**cluster.options, "read_env": False, "setup_retries": 1, **extra}


def _open(options: dict[str, Any]) -> Any:
    """The backend as the connector gets it: by name, through the entry point."""
    return load_backend("mooncake", options)


class _StoppedStorage:
    """write_stall: the storage processes stopped (SIGSTOP) while the master answers.

    A put asks the master for room first (the master counts its keys as started), then
    waits on the stopped process for its bytes; ``exists`` asks only the master. Held
    puts are the keys started since :meth:`hold` and neither ended nor revoked yet, as
    the master's metrics count them.
    """

    def __init__(self, cluster: MooncakeCluster) -> None:
        self.cluster = cluster
        self._base = 0
        self._stopped: list[int] = []

    def _in_flight(self) -> int:
        metrics = self.cluster.metrics()
        return int(
            metrics["master_batch_put_start_items_total"]
            - metrics["master_batch_put_end_items_total"]
            - metrics["master_batch_put_revoke_items_total"]
        )

    def hold(self) -> None:
        self._base = self._in_flight()
        self._stopped = self.cluster.pids[1:]  # the master comes first
        for pid in self._stopped:
            os.kill(pid, signal.SIGSTOP)

    def holding(self) -> int:
        return self._in_flight() - self._base

    def release(self) -> None:
        stopped, self._stopped = self._stopped, []
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


class _RestartMaster:
    """server_control: crash the master, then start it again on the same ports (empty)."""

    def __init__(self, cluster: MooncakeCluster) -> None:
        self.cluster = cluster

    def stop(self) -> None:
        self.cluster.kill_master()

    def start(self) -> None:
        self.cluster.restart_master()


# ---------------------------------------------------------------- conformance
class _SharedClient:
    """One open backend for the tests that leave the server alone, opened when needed."""

    def __init__(self) -> None:
        self.backend: Any = None

    def get(self, options: dict[str, Any]) -> Any:
        if self.backend is None:
            self.backend = _open(options)
        return self.backend

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()


@pytest.fixture(scope="module")
def shared_client(cluster: MooncakeCluster) -> Iterator[_SharedClient]:
    shared = _SharedClient()
    try:
        yield shared
    finally:
        shared.close()


class TestMooncakeConformance(BackendTests):
    backend_name = "mooncake"

    @pytest.fixture
    def backend(
        self,
        request: pytest.FixtureRequest,
        backend_options: dict[str, Any],
        shared_client: _SharedClient,
    ) -> Iterator[Any]:
        """Closing a Mooncake client takes ~1 s (its transfer engine), so the tests share
        one; each writes under its own fresh prefix. A test that stops the server gets a
        client of its own, and the shared one, which saw the server before, is opened
        again by the next test."""
        if "server_control" not in request.fixturenames:
            yield shared_client.get(backend_options)
            return
        shared_client.close()
        own = _open(backend_options)
        try:
            yield own
        finally:
            own.close()

    @pytest.fixture
    def backend_options(self, cluster: MooncakeCluster) -> dict[str, Any]:
        return _options(cluster)

    @pytest.fixture
    def write_stall(self, cluster: MooncakeCluster) -> _StoppedStorage:
        return _StoppedStorage(cluster)

    @pytest.fixture
    def server_control(self, cluster: MooncakeCluster) -> _RestartMaster:
        return _RestartMaster(cluster)


# ---------------------------------------------------------------- helpers
def _value(seed: int, size: int) -> bytes:
    block = bytes((seed * 7 + i) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


class _CountingStore:
    """Wraps the real client and counts which of its methods are called."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def _count_calls(backend: Any) -> _CountingStore:
    counting = _CountingStore(backend._session.store)
    backend._session.store = counting
    return counting


def _uncount(backend: Any, counting: _CountingStore) -> None:
    backend._session.store = counting._store


@pytest.fixture
def backend(cluster: MooncakeCluster) -> Iterator[Any]:
    opened = _open(_options(cluster))
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def prefix() -> str:
    return f"mc/{uuid.uuid4().hex}"


def test_the_client_starts_io_threads_of_its_own_as_it_declares(cluster: MooncakeCluster) -> None:
    """``io_threads`` keeps an idle step's loads off the step's core, where these run."""
    before = native_threads()
    opened = _open(_options(cluster))
    try:
        started = native_threads() - before
        python = {t.native_id for t in threading.enumerate()}
        assert started - python, "opening the client started no threads of its own"
        assert type(opened).capabilities.io_threads
    finally:
        opened.close()


# ---------------------------------------------------------------- zero-copy paths
def test_registered_memory_moves_with_batch_put_from_and_batch_get_into_only(
    backend: Any, prefix: str
) -> None:
    arena = bytearray(8 * MiB)
    view = memoryview(arena)
    backend.register_buffer(view)
    try:
        view[: 4 * MiB] = _value(1, 4 * MiB)
        keys = [f"{prefix}/{i}" for i in range(4)]
        counting = _count_calls(backend)
        pages = [view[i * MiB : (i + 1) * MiB] for i in range(4)]
        assert backend.put(keys, pages) == [True] * 4
        dest = [view[(4 + i) * MiB : (5 + i) * MiB] for i in range(4)]
        assert backend.get(keys, dest) == [True] * 4
        _uncount(backend, counting)
        assert bytes(view[4 * MiB :]) == _value(1, 4 * MiB)
        assert counting.calls == {
            "batch_put_from": 1,
            "batch_get_replica_desc": 1,  # the size check, one RPC for the batch
            "batch_get_into": 1,
        }
        assert backend.counters["put_zero_copy"] == 4 and backend.counters["put_scratch"] == 0
        assert backend.counters["get_zero_copy"] == 4 and backend.counters["get_scratch"] == 0
        view[4 * MiB :] = bytes(4 * MiB)
        counting = _count_calls(backend)
        assert backend.get(keys, dest, scratch=True) == [True] * 4
        _uncount(backend, counting)
        assert bytes(view[4 * MiB :]) == _value(1, 4 * MiB)
        assert counting.calls == {"batch_get_into": 1}  # scratch buffers: no size check
    finally:
        backend.unregister_buffer(view)


def test_a_batch_longer_than_the_tcp_queue_moves_in_slices_and_every_value_lands(
    backend: Any, prefix: str
) -> None:
    # Whole, 3,000 keys overflow Mooncake's TCP queue (1,024 per peer, as many more
    # held 1 s): the put took 61 s and stored 58 of them, the get failed with -800.
    n, size = 3000, 1024
    assert backend.config.transfers_in_flight == 1024  # the queue's default
    arena = bytearray(2 * n * size)
    view = memoryview(arena)
    backend.register_buffer(view)
    try:
        view[: n * size] = _value(3, n * size)
        keys = [f"{prefix}/{i}" for i in range(n)]
        counting = _count_calls(backend)
        assert backend.put(keys, [view[i * size : (i + 1) * size] for i in range(n)]) == [True] * n
        dest = [view[(n + i) * size : (n + i + 1) * size] for i in range(n)]
        assert backend.get(keys, dest, scratch=True) == [True] * n
        _uncount(backend, counting)
        assert bytes(view[n * size :]) == _value(3, n * size)
        assert counting.calls == {"batch_put_from": 3, "batch_get_into": 3}
        assert backend._session.flight.moving == 0
    finally:
        backend.unregister_buffer(view)


def test_threads_whose_batches_together_exceed_the_tcp_queue_all_land(
    cluster: MooncakeCluster, prefix: str
) -> None:
    # Each batch fits the queue and its hold (2,048); three at once do not, unless the
    # backend waits. Unbounded (transfers_in_flight=0) this failed, in 66 s.
    n, size = 2000, 1024
    backend = _open(_options(cluster, transfers_in_flight=n))
    try:
        stored: dict[int, list[bool]] = {}
        loaded: dict[int, list[bool]] = {}
        buffers = {t: [bytearray(size) for _ in range(n)] for t in range(3)}

        def work(t: int) -> None:
            keys = [f"{prefix}/{t}/{i}" for i in range(n)]
            stored[t] = backend.put(keys, [_value(t, size)] * n)
            loaded[t] = backend.get(keys, buffers[t])

        _run_threads(*(lambda t=t: work(t) for t in range(3)))
        for t in range(3):
            assert stored[t] == [True] * n and loaded[t] == [True] * n
            assert all(bytes(b) == _value(t, size) for b in buffers[t])
        assert backend._session.flight.moving == 0
    finally:
        backend.close()


def test_unregistered_buffers_round_trip_through_the_scratch_area_in_several_rounds(
    cluster: MooncakeCluster, prefix: str
) -> None:
    backend = _open(_options(cluster, scratch_bytes=256 * 1024))
    try:
        sizes = [100_000, 300_000, 5, 200_000, 70_000, 1]  # 300 KB > the scratch cap
        keys = [f"{prefix}/{i}" for i in range(len(sizes))]
        values = [_value(i, n) for i, n in enumerate(sizes)]
        counting = _count_calls(backend)
        assert backend.put(keys, values) == [True] * len(keys)
        buffers = [bytearray(n) for n in sizes]
        assert backend.get(keys, buffers) == [True] * len(keys)
        _uncount(backend, counting)
        assert [bytes(b) for b in buffers] == values
        assert counting.calls["batch_put_from"] >= 3  # rounds capped by scratch_bytes
        assert counting.calls["put"] == counting.calls["get"] == 0  # never the copying API
        assert backend.counters["put_scratch"] == backend.counters["get_scratch"] == len(keys)
    finally:
        backend.close()


def test_a_batch_mixing_registered_and_unregistered_memory_moves_both_correctly(
    backend: Any, prefix: str
) -> None:
    arena = bytearray(2 * MiB)
    view = memoryview(arena)
    backend.register_buffer(view)
    try:
        view[:1000] = _value(5, 1000)
        keys = [f"{prefix}/reg", f"{prefix}/bytes"]
        assert backend.put(keys, [view[:1000], _value(6, 2000)]) == [True, True]
        loose = bytearray(1000)
        assert backend.get(keys, [loose, view[MiB : MiB + 2000]]) == [True, True]
        assert bytes(loose) == _value(5, 1000)
        assert bytes(view[MiB : MiB + 2000]) == _value(6, 2000)
        assert backend.counters["put_zero_copy"] == 1 and backend.counters["put_scratch"] == 1
        assert backend.counters["get_zero_copy"] == 1 and backend.counters["get_scratch"] == 1
    finally:
        backend.unregister_buffer(view)


@pytest.mark.parametrize("size", [4095, 4097, 8192])
def test_a_registered_buffer_of_the_wrong_size_fails_and_stays_untouched(
    backend: Any, prefix: str, size: int
) -> None:
    arena = bytearray(b"\x11" * (64 * 1024))
    view = memoryview(arena)
    backend.register_buffer(view)
    try:
        key = f"{prefix}/page"
        assert backend.put([key], [_value(2, 4096)]) == [True]
        assert backend.get([key], [view[:size]]) == [False]
        assert arena == bytearray(b"\x11" * (64 * 1024))
        assert backend.counters["get_wrong_size"] == 1
    finally:
        backend.unregister_buffer(view)


def test_a_key_twice_in_one_get_fills_both_registered_buffers(backend: Any, prefix: str) -> None:
    """Mooncake's batch_get_into reports both but fills only one: the backend copies."""
    arena = bytearray(3 * 4096)
    view = memoryview(arena)
    backend.register_buffer(view)
    try:
        key = f"{prefix}/twice"
        backend.put([key], [_value(3, 4096)])
        assert backend.get([key, key], [view[:4096], view[4096:8192]]) == [True, True]
        assert bytes(view[:4096]) == bytes(view[4096:8192]) == _value(3, 4096)
    finally:
        backend.unregister_buffer(view)


def test_a_put_another_writer_has_in_flight_reads_as_a_miss_never_as_torn_bytes(
    backend: Any, prefix: str
) -> None:
    key = f"{prefix}/in-flight"
    raw = backend._session.store
    assert raw.batch_put_session_start([key], [4096]) == [0]  # reserved, bytes not yet sent
    try:
        buf = bytearray(b"\x22" * 4096)
        assert backend.exists([key]) == [False]
        assert backend.get([key], [buf]) == [False]
        assert buf == bytearray(b"\x22" * 4096)
        assert backend.get([key], [buf], scratch=True) == [False]
        assert backend.put([key], [_value(4, 4096)]) == [True]  # the first writer wins
    finally:
        raw.batch_put_session_revoke([key])


@pytest.mark.parametrize("scratch", [False, True], ids=["checked", "scratch"])
def test_misses_and_wrong_sizes_are_counted_once_per_buffer_on_either_read_path(
    backend: Any, prefix: str, scratch: bool
) -> None:
    present, absent = f"{prefix}/present", f"{prefix}/absent"
    backend.put([present], [b"four"])
    keys = [absent, absent, present, present]
    bufs = [bytearray(4), bytearray(4), bytearray(5), bytearray(5)]
    assert backend.get(keys, bufs, scratch=scratch) == [False] * 4
    assert backend.counters["get_miss"] == 2
    assert backend.counters["get_wrong_size"] == 2


# ---------------------------------------------------------------- threads
def _run_threads(*targets: Any) -> None:
    """Run every target on its own thread at once; fail with what any of them raised."""
    problems: list[str] = []
    start = threading.Barrier(len(targets))

    def run(target: Any) -> None:
        try:
            start.wait(timeout=30)
            target()
        except BaseException as exc:
            problems.append(repr(exc))

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not problems, problems


def test_transfers_stay_right_while_another_thread_registers_and_unregisters_memory(
    backend: Any, prefix: str
) -> None:
    """Registration racing with transfers, through registered and scratch memory.

    Each transfer thread moves half its keys from and into a registered arena (zero
    copy) and half through scratch memory; another thread registers fresh buffers,
    moves a value through each, and unregisters it. Every value must arrive whole, and
    the counters must add up exactly: every key counted once, on the path it took.
    """
    threads, rounds, keys_per_round, size = 3, 8, 8, 16 * 1024
    half = keys_per_round // 2
    arena = memoryview(bytearray(threads * MiB))
    backend.register_buffer(arena)
    churns = 20

    def transfer(t: int) -> None:
        region = arena[t * MiB : (t + 1) * MiB]
        for r in range(rounds):
            keys = [f"{prefix}/t{t}/r{r}/{i}" for i in range(keys_per_round)]
            values = [_value(t * 1000 + r * 10 + i, size) for i in range(keys_per_round)]
            for i in range(half):
                region[i * size : (i + 1) * size] = values[i]
            sources: list[Any] = [region[i * size : (i + 1) * size] for i in range(half)]
            sources += values[half:]  # through scratch memory
            assert backend.put(keys, sources) == [True] * keys_per_round
            into: list[Any] = [
                region[(half + i) * size : (half + i + 1) * size] for i in range(half)
            ]
            into += [bytearray(size) for _ in range(half)]
            assert backend.get(keys, into, scratch=r % 2 == 0) == [True] * keys_per_round
            assert [bytes(b) for b in into] == values, f"thread {t} round {r}"

    def churn() -> None:
        for c in range(churns):
            fresh = memoryview(bytearray(256 * 1024 + c * 4096))  # new memory each time
            backend.register_buffer(fresh)
            try:
                key = f"{prefix}/churn/{c}"
                fresh[:4096] = _value(c, 4096)
                assert backend.put([key], [fresh[:4096]]) == [True]
                out = fresh[8192 : 8192 + 4096]
                assert backend.get([key], [out]) == [True] and bytes(out) == _value(c, 4096)
            finally:
                backend.unregister_buffer(fresh)

    try:
        _run_threads(*[lambda t=t: transfer(t) for t in range(threads)], churn)
    finally:
        backend.unregister_buffer(arena)
    counters = backend.counters
    per_path = threads * rounds * half
    assert counters["register_refused"] == 0
    assert counters["put_zero_copy"] == counters["get_zero_copy"] == per_path + churns
    assert counters["put_scratch"] == counters["get_scratch"] == per_path


def test_reads_and_puts_from_several_threads_fail_over_while_a_storage_process_is_dead(
    loopback_env: None,
) -> None:
    """Fail-over state shared by threads: endpoints found dead, segments found alive.

    Readers (two replicas of every key) and writers (one replica: the master still
    places some on the dead segment) run at once while the master lists a dead storage
    process. Every read loads, every put is stored, and nothing is counted as failed.
    """
    with MooncakeCluster(storage_processes=2, segment_size=64 * MiB, client_ttl=60) as pair:
        reader = _open(_options(pair, replica_num=2))
        writer = _open(_options(pair))
        try:
            keys = [f"replicas/{i}" for i in range(16)]
            values = [_value(i, 128 * 1024) for i in range(16)]
            assert reader.put(keys, values) == [True] * 16
            pair.kill_storage(0)
            assert len(pair.segments()) == 2  # the master still lists the dead segment

            def read(t: int) -> None:
                for attempt in range(3):
                    buffers = [bytearray(len(v)) for v in values]
                    scratch = (t + attempt) % 2 == 0
                    assert reader.get(keys, buffers, scratch=scratch) == [True] * 16
                    assert [bytes(b) for b in buffers] == values, (t, attempt)

            def write(t: int) -> None:
                for r in range(3):
                    new = [f"after-death/{t}/{r}/{i}" for i in range(8)]
                    new_values = [_value(t * 100 + r * 10 + i, 64 * 1024) for i in range(8)]
                    assert writer.put(new, new_values) == [True] * 8, (t, r)
                    buffers = [bytearray(len(v)) for v in new_values]
                    assert writer.get(new, buffers, scratch=True) == [True] * 8, (t, r)
                    assert [bytes(b) for b in buffers] == new_values

            _run_threads(
                *[lambda t=t: read(t) for t in range(3)], *[lambda t=t: write(t) for t in range(3)]
            )
            assert reader.counters["get_failed"] == 0 and reader.counters["get_failover"] > 0
            assert writer.counters["put_failed"] == 0 and writer.counters["put_rerouted"] > 0
            loaded = 3 * 3 * 16
            assert reader.counters["get_zero_copy"] + reader.counters["get_scratch"] == loaded
        finally:
            reader.close()
            writer.close()


def test_a_value_read_before_can_still_be_deleted(backend: Any, prefix: str) -> None:
    """Reads take a 10 s lease that blocks a plain remove: delete forces it."""
    key = f"{prefix}/leased"
    backend.put([key], [b"leased"])
    assert backend.get([key], [bytearray(6)]) == [True]
    assert backend.delete([key, key]) == [True, True]
    assert backend.exists([key]) == [False]


class _ScriptedExists:
    """The real client, but ``batch_is_exist`` answers the codes a test gives it."""

    def __init__(self, store: Any, answers: list[int]) -> None:
        self._store = store
        self.answers = answers
        self.calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        return list(self.answers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.parametrize(
    "answers",
    [[1, -704, 0], [-1, -1, -1], [0, 0, -200]],
    ids=["object-not-found", "internal-error", "no-handle"],
)
def test_a_negative_exists_code_raises_naming_it_and_never_reads_as_a_miss(
    backend: Any, answers: list[int]
) -> None:
    real = backend._session.store
    backend._session.store = _ScriptedExists(real, answers)
    try:
        worst = str(min(answers))
        with pytest.raises(BackendError, match=f"exists failed with {worst} "):
            backend.exists(["k/1", "k/2", "k/3"])
    finally:
        backend._session.store = real


def test_an_exists_answer_of_the_wrong_length_raises(backend: Any) -> None:
    real = backend._session.store
    backend._session.store = _ScriptedExists(real, [1, 0])
    try:
        with pytest.raises(BackendError, match="answered 2/3"):
            backend.exists(["k/1", "k/2", "k/3"])
    finally:
        backend._session.store = real


def test_exists_asks_once_more_after_a_lost_master_and_then_reports_it_unavailable(
    backend: Any,
) -> None:
    real = backend._session.store
    scripted = backend._session.store = _ScriptedExists(real, [-900, -900])
    try:
        with pytest.raises(BackendUnavailable, match="-900"):
            backend.exists(["k/1", "k/2"])
        assert scripted.calls == 2  # the master's port answers, so the call was repeated
        scripted.answers = [1, 0]
        assert backend.exists(["k/1", "k/2"]) == [True, False]
    finally:
        backend._session.store = real


def test_exists_answers_any_mix_of_hits_and_misses_per_key(backend: Any, prefix: str) -> None:
    keys = [f"{prefix}/{i}" for i in range(12)]
    stored = [0, 1, 2, 5, 8, 11]
    assert backend.put([keys[i] for i in stored], [b"v"] * len(stored)) == [True] * 6
    assert backend.exists(keys) == [i in stored for i in range(12)]
    assert backend.exists(keys[:3]) == [True] * 3
    assert backend.exists(keys[3:5]) == [False] * 2


def test_the_clients_threads_run_on_the_cpus_it_connected_from(
    cluster: MooncakeCluster, prefix: str
) -> None:
    """Mooncake's transfer engine starts its I/O threads as the client connects. Opened
    within ``connecting_on`` (as the engine adapters open it), they run on the transfer
    CPUs, not on the core the engine's thread, and its forward pass, is bound to."""
    own = os.sched_getaffinity(0)
    chosen = {max(own)}
    tasks = f"/proc/{os.getpid()}/task"
    before = set(os.listdir(tasks))
    with connecting_on("auto", chosen):
        backend = _open(_options(cluster))
    try:
        assert os.sched_getaffinity(0) == own
        backend.put([f"{prefix}/cpus"], [b"x" * 4096])  # connections made on first use too
        assert backend.exists([f"{prefix}/cpus"]) == [True]
        started = {int(t) for t in set(os.listdir(tasks)) - before}
        assert len(started) >= 4, "Mooncake's client started no threads of its own"
        assert {t: os.sched_getaffinity(t) for t in started} == dict.fromkeys(started, chosen)
    finally:
        backend.close()


# ---------------------------------------------------------------- lifecycle and faults
def test_a_closed_backend_raises_instead_of_crashing_the_process(cluster: MooncakeCluster) -> None:
    backend = _open(_options(cluster))
    arena = bytearray(4096)
    backend.register_buffer(memoryview(arena))
    backend.close()
    backend.close()  # idempotent
    backend.unregister_buffer(memoryview(arena))  # a no-op now
    for call in (
        lambda: backend.exists(["closed/a"]),
        lambda: backend.put(["closed/a"], [b"x"]),
        lambda: backend.get(["closed/a"], [bytearray(1)]),
        lambda: backend.delete(["closed/a"]),
        lambda: backend.register_buffer(memoryview(bytearray(8))),
    ):
        with pytest.raises(BackendError, match="closed"):
            call()


def test_after_one_slow_failure_a_dead_master_is_reported_at_once(
    cluster: MooncakeCluster, prefix: str
) -> None:
    backend = _open(_options(cluster))
    try:
        backend.put([f"{prefix}/a"], [b"a"])
        cluster.kill_master()
        try:
            with pytest.raises(BackendUnavailable):
                backend.exists([f"{prefix}/a"])  # asks the client: up to ~4.4 s
            for call in (
                lambda: backend.exists([f"{prefix}/a"]),
                lambda: backend.get([f"{prefix}/a"], [bytearray(1)]),
                lambda: backend.put([f"{prefix}/b"], [b"b"]),
            ):
                started = time.monotonic()
                with pytest.raises(BackendUnavailable, match="unreachable"):
                    call()
                assert time.monotonic() - started < 1.0  # the probe, not a 4.4 s RPC
        finally:
            cluster.restart_master()
        assert backend.put([f"{prefix}/c"], [b"c"]) == [True]
        assert backend.exists([f"{prefix}/c"]) == [True]
    finally:
        backend.close()


def test_a_master_down_at_start_is_unavailable_then_the_same_backend_connects(
    cluster: MooncakeCluster, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.kill_master()
    try:
        with caplog.at_level(logging.WARNING):
            backend = _open(_options(cluster))
        assert "unreachable" in caplog.text
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            backend.exists([f"{prefix}/a"])
        assert time.monotonic() - started < 1.0
        arena = bytearray(4096)
        backend.register_buffer(memoryview(arena))  # remembered, registered at setup
    finally:
        cluster.restart_master()
    try:
        arena[:] = _value(9, 4096)
        assert backend.put([f"{prefix}/a"], [memoryview(arena)]) == [True]
        assert backend.counters["put_zero_copy"] == 1
        assert backend.exists([f"{prefix}/a"]) == [True]
    finally:
        backend.close()


def test_memory_released_while_the_master_is_down_can_be_registered_again_after_it_returns(
    cluster: MooncakeCluster, prefix: str
) -> None:
    """An unregister while the metadata server is down would wedge the range for good."""
    backend = _open(_options(cluster))
    try:
        arena = bytearray(MiB)
        view = memoryview(arena)
        backend.register_buffer(view)
        cluster.kill_master()
        try:
            with pytest.raises(BackendUnavailable):
                backend.exists([f"{prefix}/a"])
            backend.unregister_buffer(view)  # as the connector's staging does on regrowth
        finally:
            cluster.restart_master()
        backend.register_buffer(view)  # the same addresses again
        view[:4096] = _value(8, 4096)
        assert backend.put([f"{prefix}/a"], [view[:4096]]) == [True]
        assert backend.get([f"{prefix}/a"], [view[8192 : 8192 + 4096]]) == [True]
        assert bytes(view[8192 : 8192 + 4096]) == _value(8, 4096)
        assert backend.counters["register_refused"] == 0
        assert backend.counters["put_zero_copy"] == backend.counters["get_zero_copy"] == 1
        backend.unregister_buffer(view)
    finally:
        backend.close()


def test_a_full_store_drops_saves_as_false_and_never_yields_a_partial_value(
    loopback_env: None,
) -> None:
    _require_mooncake()
    with MooncakeCluster(storage_processes=1, segment_size=32 * MiB) as small:
        backend = _open(_options(small))
        try:
            arena = bytearray(40 * MiB)
            view = memoryview(arena)
            backend.register_buffer(view)
            for i in range(40):
                view[i * MiB : (i + 1) * MiB] = _value(i, MiB)
            keys = [f"full/{i}" for i in range(40)]
            stored = backend.put(keys, [view[i * MiB : (i + 1) * MiB] for i in range(40)])
            assert 0 < sum(stored) < 40  # 40 MiB into 32 MiB: some puts got -200
            assert backend.counters["put_full"] == stored.count(False)
            more = [f"full/more/{i}" for i in range(40)]  # keeps eviction busy
            for start in range(0, 40, 8):
                backend.put(more[start : start + 8], [_value(i, MiB) for i in range(8)])
            buffers = [bytearray(b"\xee" * MiB) for _ in keys]
            found = backend.get(keys, buffers)
            for i, (ok, buf) in enumerate(zip(found, buffers)):
                assert bytes(buf) == (_value(i, MiB) if ok else b"\xee" * MiB)
            assert sum(found) < 40
            backend.unregister_buffer(view)
        finally:
            backend.close()


@pytest.mark.parametrize("scratch", [False, True], ids=["checked", "scratch"])
def test_with_two_replicas_every_value_loads_at_once_after_a_storage_process_dies(
    loopback_env: None, scratch: bool
) -> None:
    # client_ttl=60: the master keeps listing the dead segment for the whole test, the
    # window in which Mooncake's own client keeps choosing the dead copy.
    with MooncakeCluster(storage_processes=2, segment_size=64 * MiB, client_ttl=60) as pair:
        backend = _open(_options(pair, replica_num=2))
        try:
            keys = [f"replicas/{i}" for i in range(20)]
            values = [_value(i, 256 * 1024) for i in range(20)]
            assert backend.put(keys, values) == [True] * 20
            pair.kill_storage(0)
            assert len(pair.segments()) == 2  # the master still lists the dead segment
            for attempt in range(2):
                buffers = [bytearray(len(v)) for v in values]
                assert backend.get(keys, buffers, scratch=scratch) == [True] * 20, attempt
                assert [bytes(b) for b in buffers] == values
            counters = backend.counters
            # Some keys' chosen copy was the dead one: read from the live copy instead...
            assert counters["get_failover"] >= 2 * counters["get_transfer_failed"] > 0
            # ...and the second pass skipped the dead endpoint instead of failing on it.
            first_pass_failures = counters["get_transfer_failed"]
            buffers = [bytearray(len(v)) for v in values]
            assert backend.get(keys, buffers, scratch=scratch) == [True] * 20
            assert counters["get_transfer_failed"] == first_pass_failures
            assert counters["get_failed"] == 0
        finally:
            backend.close()


def test_puts_placed_on_a_dead_storage_process_are_stored_on_a_live_one(
    loopback_env: None,
) -> None:
    # client_ttl=60: the master keeps placing new objects on the dead segment.
    with MooncakeCluster(storage_processes=2, segment_size=64 * MiB, client_ttl=60) as pair:
        backend = _open(_options(pair))
        try:
            pair.kill_storage(0)
            assert len(pair.segments()) == 2  # the master still lists the dead segment
            keys = [f"after-death/{i}" for i in range(40)]
            values = [_value(i, 64 * 1024) for i in range(40)]
            assert backend.put(keys, values) == [True] * 40
            assert backend.counters["put_rerouted"] > 0  # some first landed on the dead one
            assert backend.counters["put_failed"] == 0
            # One-key batches: when the key lands on the dead segment no other key of its
            # batch names a live one, so the segments learned above are used.
            for i, value in enumerate(values[:12]):
                assert backend.put([f"after-death/single/{i}"], [value]) == [True], i
            assert backend.counters["put_failed"] == 0
            buffers = [bytearray(len(v)) for v in values]
            assert backend.get(keys, buffers, scratch=True) == [True] * 40
            assert [bytes(b) for b in buffers] == values
        finally:
            backend.close()


class _PlacedOnTheDead:
    """The real client, but its first puts answer ``-800`` for the keys a test names, as
    when the master placed them on a dead storage process (nothing is stored)."""

    def __init__(self, store: Any, fail: list[set[str]]) -> None:
        self._store = store
        self.fail = fail
        #: (keys, preferred segments) of each put
        self.puts: list[tuple[list[str], list[str]]] = []

    def batch_put_from(
        self, keys: list[str], addresses: list[int], sizes: list[int], config: Any
    ) -> list[int]:
        self.puts.append((list(keys), list(config.preferred_segments)))
        failing = self.fail.pop(0) if self.fail else set()
        kept = [i for i, key in enumerate(keys) if key not in failing]
        landed = iter(
            self._store.batch_put_from(
                [keys[i] for i in kept],
                [addresses[i] for i in kept],
                [sizes[i] for i in kept],
                config,
            )
            if kept
            else []
        )
        return [-800 if k in failing else next(landed) for k in keys]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_with_one_of_three_storage_processes_dead_both_replicas_are_steered_to_live_ones(
    loopback_env: None,
) -> None:
    """After the first batch's reroute, later batches land from their first put: no more
    reroutes, every key with its two copies on the two live processes."""
    with MooncakeCluster(storage_processes=3, segment_size=64 * MiB, client_ttl=60) as trio:
        backend = _open(_options(trio, replica_num=2))
        try:
            trio.kill_storage(0)
            assert len(trio.segments()) == 3  # the master still lists the dead segment
            batches = [[f"trio/{r}/{i}" for i in range(16)] for r in range(3)]
            rerouted = []
            for keys in batches:
                assert backend.put(keys, [_value_of(k) for k in keys]) == [True] * 16
                rerouted.append(backend.counters["put_rerouted"])
            # the first batch: 16 keys, each needing two of three segments, one dead
            assert rerouted[0] > 0 and rerouted[2] == rerouted[0], rerouted
            keys = [k for batch in batches for k in batch]
            described = backend._transfers.describe(keys)
            assert sorted(described) == sorted(keys)
            assert {len(found.copies) for found in described.values()} == {2}
            endpoints = {c.endpoint for found in described.values() for c in found.copies}
            assert len(endpoints) == 2  # never the dead third
            buffers = [bytearray(len(_value_of(k))) for k in keys]
            assert backend.get(keys, buffers, scratch=True) == [True] * len(keys)
            assert [bytes(b) for b in buffers] == [_value_of(k) for k in keys]
        finally:
            backend.close()


def test_steered_batches_spread_over_the_live_segments(loopback_env: None) -> None:
    """The master puts a batch on the first preferred segment with room: the order turns
    with every batch, so while a death is remembered the live segments share the writes
    rather than one taking them all."""
    with MooncakeCluster(storage_processes=3, segment_size=64 * MiB, client_ttl=60) as trio:
        backend = _open(_options(trio))
        try:
            trio.kill_storage(0)
            batches = [[f"spread/{r}/{i}" for i in range(16)] for r in range(8)]
            for keys in batches:
                assert backend.put(keys, [_value_of(k) for k in keys]) == [True] * 16
            steered = [k for batch in batches[2:] for k in batch]
            described = backend._transfers.describe(steered)
            held = Counter(c.endpoint for found in described.values() for c in found.copies)
            assert len(held) == 2 and min(held.values()) >= 16, held  # a batch or more each
        finally:
            backend.close()


def _value_of(key: str) -> bytes:
    return key.encode() * 2


def _put_placed(
    backend: Any, fail: list[set[str]], *batches: list[str]
) -> tuple[list[Sequence[bool]], list[tuple[list[str], list[str]]]]:
    """Put each batch in turn (each key's value :func:`_value_of` it) through a client
    whose first puts fail the keys ``fail`` names; what each put answered, and every
    put the client made as (keys, preferred segments)."""
    real = backend._session.store
    scripted = backend._session.store = _PlacedOnTheDead(real, fail)
    try:
        answers = [backend.put(keys, [_value_of(k) for k in keys]) for keys in batches]
    finally:
        backend._session.store = real
    return answers, scripted.puts


def test_a_batch_that_lands_nowhere_in_a_new_client_is_put_again_where_the_master_chooses(
    backend: Any, prefix: str, cluster: MooncakeCluster
) -> None:
    """No key landed and no batch landed lately: no segment is known alive. The keys are
    put again once, where the master chooses; those that land there name the segment the
    rest go to. Before, the whole batch was dropped."""
    keys = [f"{prefix}/{i}" for i in range(8)]
    answers, puts = _put_placed(backend, [set(keys), set(keys[4:])], keys)
    assert answers == [[True] * 8]
    assert puts == [(keys, []), (keys, []), (keys[4:], list(cluster.segments()))]
    assert backend.counters["put_rerouted"] == 8 and backend.counters["put_failed"] == 0
    buffers = [bytearray(len(_value_of(k))) for k in keys]
    assert backend.get(keys, buffers, scratch=True) == [True] * 8
    assert [bytes(b) for b in buffers] == [_value_of(k) for k in keys]


def test_a_reroute_in_one_scratch_round_steers_the_next_round_of_the_same_put(
    cluster: MooncakeCluster, prefix: str
) -> None:
    """A put larger than the scratch area goes in rounds, each a put of its own: once the
    first round has met the dead process, the second does not wait out its timeout."""
    backend = _open(_options(cluster, scratch_bytes=len(_value_of(f"{prefix}/0")) * 4))
    try:
        keys = [f"{prefix}/{i}" for i in range(8)]
        answers, puts = _put_placed(backend, [set(keys[2:4])], keys)
        assert answers == [[True] * 8]
        live = list(cluster.segments())
        assert puts == [(keys[:4], []), (keys[2:4], live), (keys[4:], live)]
        assert backend.counters["put_rerouted"] == 2
    finally:
        backend.close()


def test_a_batch_that_lands_nowhere_twice_is_dropped_and_later_ones_are_not_placed_again(
    backend: Any, prefix: str
) -> None:
    """When the second placement of eight keys lands nowhere either, every placement
    needs the dead process (two replicas, two segments): each try costs a transfer
    timeout, so the batches after it are not placed again for a while. One extra put,
    not one per batch."""
    keys = [f"{prefix}/{i}" for i in range(FUTILE_MISSES)]
    later = [f"{prefix}/later/{i}" for i in range(4)]
    fail = [set(keys), set(keys), set(later), set(later)]
    answers, puts = _put_placed(backend, fail, keys, later)
    assert answers == [[False] * FUTILE_MISSES, [False] * 4]
    assert [put for put, _ in puts] == [keys, keys, later]
    assert backend.counters["put_failed"] == FUTILE_MISSES + 4
    assert backend.counters["put_rerouted"] == 0
    assert backend.exists(keys + later) == [False] * (FUTILE_MISSES + 4)


def test_a_one_key_batch_that_lands_nowhere_twice_leaves_the_next_one_its_second_placement(
    backend: Any, prefix: str
) -> None:
    """A key lands on the dead process of two half the time, twice a quarter: chance,
    not proof that every placement needs it. The next 1-key batch is still put again
    where the master chooses, and lands."""
    lost, saved = [f"{prefix}/lost"], [f"{prefix}/saved"]
    answers, puts = _put_placed(backend, [set(lost), set(lost), set(saved)], lost, saved)
    assert answers == [[False], [True]]
    assert puts == [(lost, []), (lost, []), (saved, []), (saved, [])]
    assert backend.counters["put_failed"] == 1 and backend.counters["put_rerouted"] == 1
    assert backend.exists(lost + saved) == [False, True]


@pytest.mark.parametrize("steered_lands", [True, False], ids=["lands", "lands-nowhere"])
def test_after_a_reroute_new_batches_prefer_the_live_segments_from_their_first_put(
    backend: Any, prefix: str, cluster: MooncakeCluster, steered_lands: bool
) -> None:
    """A first put the master places on a dead process waits out a transfer timeout
    (~1 s) before its reroute: while the death is recent, new batches are steered. The
    segments remembered alive may have died since: a steered put none of whose keys
    landed drops them, and is put again where the master chooses."""
    first = [f"{prefix}/first/{i}" for i in range(8)]
    steered = [f"{prefix}/steered/{i}" for i in range(8)]
    fail = [set(first[4:]), set()] + ([] if steered_lands else [set(steered)])
    answers, puts = _put_placed(backend, fail, first, steered)
    assert answers == [[True] * 8, [True] * 8]
    live = list(cluster.segments())
    expected = [(first, []), (first[4:], live), (steered, live)]
    assert puts == expected + ([] if steered_lands else [(steered, [])])
    assert backend.counters["put_rerouted"] == (4 if steered_lands else 12)
    assert backend.exists(first + steered) == [True] * 16


def test_without_read_failover_a_dead_copy_fails_its_reads_and_leaves_buffers_untouched(
    loopback_env: None,
) -> None:
    with MooncakeCluster(storage_processes=2, segment_size=64 * MiB, client_ttl=2) as pair:
        backend = _open(_options(pair, replica_num=2, read_failover=False))
        try:
            keys = [f"replicas/{i}" for i in range(20)]
            values = [_value(i, 256 * 1024) for i in range(20)]
            assert backend.put(keys, values) == [True] * 20
            pair.kill_storage(0)
            # Before the master drops the dead segment, reads that pick it fail (-800):
            # False and an untouched buffer, never an exception or wrong bytes.
            buffers = [bytearray(b"\xee" * len(v)) for v in values]
            found = backend.get(keys, buffers)
            assert not all(found)
            for ok, buf, value in zip(found, buffers, values):
                assert bytes(buf) == (value if ok else b"\xee" * len(value))
            assert backend.counters["get_failover"] == 0
            deadline = time.monotonic() + 30
            while len(pair.segments()) > 1:
                assert time.monotonic() < deadline, pair.segments()
                time.sleep(0.2)
            buffers = [bytearray(len(v)) for v in values]
            assert backend.get(keys, buffers) == [True] * 20
            assert [bytes(b) for b in buffers] == values
        finally:
            backend.close()


def _published(cluster: MooncakeCluster, name: str) -> bytes | None:
    """The metadata server's entry for the transfer engine ``name``, None if it has none."""
    key = urllib.parse.quote(f"mooncake/rpc_meta/{name}", safe="")
    try:
        with urllib.request.urlopen(f"{cluster.metadata_server}?key={key}", timeout=5) as reply:
            return bytes(reply.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def test_an_engine_name_that_clashes_with_a_peer_leaves_the_peer_its_name(
    cluster: MooncakeCluster, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name's port is a label nobody binds, so a free port can be a peer's name.

    The metadata server refuses the duplicate, and Mooncake's destructor of the engine
    that failed then deletes the name's entry, the peer's. The peer can no longer be
    handshaken with (RDMA needs it), and the next process that draws the port takes the
    name while the master still lists the peer's segment under it (a killed peer's
    stays listed for ``client_ttl``): its first read of a copy there segfaults
    (measured). A CI run of the TP group lost a rank's loads so.
    """
    from kvconn_mooncake import _library, _replicas

    keys = [f"{prefix}/{i}" for i in range(4)]
    values = [_value(i, 64 * 1024) for i in range(4)]
    writer = _open(_options(cluster))
    try:
        assert writer.put(keys, values) == [True] * 4
    finally:
        writer.close()
    (peer,) = cluster.segments()  # the storage process, where the objects lie
    entry = _published(cluster, peer)
    assert entry is not None
    engines = _library.load("engine")
    ports = iter([int(peer.rpartition(":")[2]), free_port()])
    monkeypatch.setattr(_replicas, "_free_port", lambda: next(ports))
    made = _replicas.make_engine(engines, "127.0.0.1", cluster.metadata_server, "tcp", "")
    monkeypatch.undo()
    assert made is not None and made[1] != peer
    assert _published(cluster, peer) == entry
    late = engines.TransferEngine()
    _replicas._keep_alive(late)
    assert late.initialize(peer, cluster.metadata_server, "tcp", "") != 0  # not taken over
    assert _published(cluster, peer) == entry
    reader = _open(_options(cluster))  # a new engine: it looks the peer up afresh
    try:
        buffers = [bytearray(len(v)) for v in values]
        assert reader.get(keys, buffers) == [True] * 4
        assert [bytes(b) for b in buffers] == values
    finally:
        reader.close()


# ---------------------------------------------------------------- why a read failed
LOADED, MISSING = ReadStatus.LOADED, ReadStatus.MISSING
WRONG_SIZE, UNREACHABLE = ReadStatus.WRONG_SIZE, ReadStatus.UNREACHABLE


def test_a_read_says_missing_for_an_absent_key_and_wrong_size_for_another_length(
    backend: Any, prefix: str
) -> None:
    """Each read path tells the two apart from what it already learns: the checked one
    from the size query, the scratch one from ``batch_get_into`` (``-600`` for a buffer
    too small, the value's length for one too large)."""
    six, ok, absent = f"{prefix}/six", f"{prefix}/ok", f"{prefix}/absent"
    assert backend.put([six, ok], [b"sixsix", b"ok"]) == [True, True]
    for scratch in (False, True):
        for size in (5, 7):  # one size per call: the scratch path stays the scratch path
            buf = bytearray(b"\x11" * size)
            assert backend.read(
                [six, absent, ok], [buf, bytearray(6), bytearray(2)], scratch=scratch
            )[:2] == [WRONG_SIZE, MISSING]
            if not scratch:
                assert buf == b"\x11" * size
        bufs = [bytearray(2), bytearray(6)]
        assert backend.read([ok, absent], bufs, scratch=scratch) == [LOADED, MISSING]
        assert bufs[0] == b"ok"


@pytest.mark.parametrize("read_failover", [True, False], ids=["failover", "no-failover"])
def test_keys_on_a_dead_storage_process_read_as_unreachable_then_missing_once_dropped(
    loopback_env: None, read_failover: bool
) -> None:
    """Until the master drops a dead storage process's segment (``client_ttl``) it still
    lists the objects there, and every read of one fails with ``-800``: stored, bytes not
    at fault, only out of reach, so ``UNREACHABLE`` (the connector keeps such a page).
    Once the segment is dropped the objects are gone: ``MISSING``."""
    _require_mooncake()
    with MooncakeCluster(storage_processes=1, segment_size=32 * MiB, client_ttl=8) as one:
        backend = _open(_options(one, read_failover=read_failover))
        try:
            keys = [f"dead/{i}" for i in range(4)]
            values = [_value(i, 64 * 1024) for i in range(4)]
            assert backend.put(keys, values) == [True] * 4
            one.kill_storage(0)
            for scratch in (True, False):
                buffers = [bytearray(b"\xee" * len(v)) for v in values]
                assert backend.read(keys, buffers, scratch=scratch) == [UNREACHABLE] * 4
                if not scratch:
                    assert all(b == b"\xee" * len(b) for b in buffers)
            assert len(one.segments()) == 1  # the master still lists the dead segment...
            assert backend.exists(keys) == [True] * 4  # ...and so its objects
            deadline = time.monotonic() + 60
            while one.segments():
                assert time.monotonic() < deadline, one.segments()
                time.sleep(0.2)
            for scratch in (True, False):
                buffers = [bytearray(len(v)) for v in values]
                assert backend.read(keys, buffers, scratch=scratch) == [MISSING] * 4
            assert backend.exists(keys) == [False] * 4
        finally:
            backend.close()


def test_a_key_whose_every_copy_is_on_a_dead_storage_process_reads_as_unreachable(
    loopback_env: None,
) -> None:
    """Fail-over tries every copy the master lists; when none transfers the key is out
    of reach, not unreadable."""
    _require_mooncake()
    with MooncakeCluster(storage_processes=2, segment_size=32 * MiB, client_ttl=60) as pair:
        backend = _open(_options(pair, replica_num=2))
        try:
            keys = [f"all-dead/{i}" for i in range(6)]
            values = [_value(i, 64 * 1024) for i in range(6)]
            assert backend.put(keys, values) == [True] * 6
            pair.kill_storage(0)
            pair.kill_storage(1)
            for scratch in (True, False):
                buffers = [bytearray(len(v)) for v in values]
                assert backend.read(keys, buffers, scratch=scratch) == [UNREACHABLE] * 6
            assert backend.counters["get_failover"] == 0
            assert backend.exists(keys) == [True] * 6  # still listed: kept, not deleted
        finally:
            backend.close()


def _connector(cluster: MooncakeCluster) -> Connector:
    layout = minimax_m3(tp_size=1, layers=2, num_slots=8)
    pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
    config = ConnectorConfig(
        model=f"mm3-{uuid.uuid4().hex[:8]}", backend="mooncake", options=_options(cluster)
    )
    return Connector(config, layout, rank=0, pools=[pool])


def _same_slots(conn: Connector, saved: list[int], loaded: list[int]) -> bool:
    return all(
        slot_bytes(conn.layout, conn.pools, a) == slot_bytes(conn.layout, conn.pools, b)
        for a, b in zip(saved, loaded)
    )


def _wait_for_replica_queries(cluster: MooncakeCluster, baseline: float, items: int) -> None:
    """Until the master has told clients where ``items`` more keys lie: a read that got
    that far goes on to move their bytes from the storage process."""
    deadline = time.monotonic() + 30
    name = "master_batch_get_replica_list_items_total"
    while cluster.metrics()[name] < baseline + items:
        assert time.monotonic() < deadline, "the load never asked the master"
        time.sleep(0.01)


def test_a_load_whose_storage_process_dies_mid_load_keeps_its_pages_and_counts_them_unreachable(
    loopback_env: None,
) -> None:
    """Issue 15, item 3: a transfer failure to a dead storage process looked like "stored
    but unreadable" and repair deleted good pages. Now the block fails as a miss, the
    pages stay stored (another replica, or the master dropping the dead segment, settles
    them) and ``unreachable`` counts them; nothing is ``corrupt`` or ``repaired``.

    Killed mid-load, deterministically: the storage process is stopped (SIGSTOP), the
    load starts, and once the master has told it where every page lies (its replica
    query, seen in the master's metrics) the process is SIGKILLed while the load's
    transfer waits on it. A restarted storage process cannot serve the old pages: it
    mounts a new, empty segment, and the old objects stay listed on the dead one until
    the master drops it; after that they are misses, and the next save writes them anew.
    """
    _require_mooncake()
    with MooncakeCluster(storage_processes=1, segment_size=64 * MiB, client_ttl=20) as one:
        conn = _connector(one)
        try:
            hashes = block_hashes(list(range(32 * 4)), 32)
            assert conn.save(hashes, [0, 1, 2, 3]).dropped == 0
            assert conn.lookup(hashes).blocks == 4
            pages = 4 * len(conn.shares)
            keys = [k for h in hashes for k in conn.keys.rank_keys(0, h)]
            assert len(keys) == pages
            baseline = one.metrics()["master_batch_get_replica_list_items_total"]
            os.kill(one.pids[1], signal.SIGSTOP)  # the master comes first
            outcome: list[Any] = []
            loading = threading.Thread(
                target=lambda: outcome.append(conn.load(hashes, [4, 5, 6, 7]))
            )
            loading.start()
            _wait_for_replica_queries(one, baseline, pages)
            one.kill_storage(0)  # SIGKILL reaches a stopped process too
            loading.join(timeout=60)
            assert not loading.is_alive()
            result = outcome[0]
            assert result.loaded == 0 and result.failed == (0, 1, 2, 3)
            stats = conn.stats
            assert stats.pages("unreachable") == pages
            assert stats.pages("corrupt") == stats.pages("repaired") == 0
            assert stats.backend_errors == 0  # a miss, not an outage: no back-off
            # Kept: the master still lists the pages, so the lookup still hits, and the
            # next load fails the same way without deleting them.
            assert len(one.segments()) == 1
            assert conn.backend.exists(keys) == [True] * pages
            assert conn.lookup(hashes).blocks == 4
            assert conn.load(hashes, [4, 5, 6, 7]).loaded == 0
            assert stats.pages("unreachable") == 2 * pages
            assert stats.pages("corrupt") == stats.pages("repaired") == 0
            # A restarted storage process mounts a new segment: the old pages stay out
            # of reach until the master drops the dead one, then they are misses.
            dead = set(one.segments())
            one.restart_storage(0)
            deadline = time.monotonic() + 90
            while len(one.segments()) > 1:
                assert time.monotonic() < deadline, one.segments()
                time.sleep(0.2)
            assert one.segments().keys().isdisjoint(dead)  # a new segment, not the old one
            assert conn.lookup(hashes).blocks == 0
            assert conn.backend.exists(keys) == [False] * pages
            assert conn.load(hashes, [4, 5, 6, 7]).loaded == 0
            assert stats.pages("unreachable") == 2 * pages  # plain misses now
            assert stats.pages("corrupt") == stats.pages("repaired") == 0
            # The next save writes them onto the new process, and they load whole.
            assert conn.save(hashes, [0, 1, 2, 3]).written == pages
            assert conn.load(hashes, [4, 5, 6, 7]).loaded == 4
            assert _same_slots(conn, [0, 1, 2, 3], [4, 5, 6, 7])
        finally:
            conn.close()


def test_a_page_replaced_by_a_value_of_another_size_is_deleted_and_rewritten(
    cluster: MooncakeCluster,
) -> None:
    """The contrast: a stored value of another size can never load (``WRONG_SIZE``), so
    the load that finds it deletes it (``corrupt``, ``repaired``), the lookup misses the
    block and the next save writes the page again."""
    conn = _connector(cluster)
    try:
        hashes = block_hashes(list(range(32 * 2)), 32)
        assert conn.save(hashes, [0, 1]).dropped == 0
        key = conn.keys.rank_keys(0, hashes[1])[0]
        backend: Any = conn.backend
        assert backend.delete([key]) == [True]
        assert backend.put([key], [b"a value of another size"]) == [True]
        buffer = bytearray(conn.shares[0].plan.value_size)
        assert backend.read([key], [buffer], scratch=True) == [WRONG_SIZE]
        result = conn.load(hashes, [4, 5])
        assert result.loaded == 1 and result.failed == (1,)
        assert conn.stats.pages("corrupt") == conn.stats.pages("repaired") == 1
        assert conn.stats.pages("unreachable") == 0
        assert backend.exists([key]) == [False]
        assert conn.lookup(hashes).blocks == 1
        assert conn.save(hashes, [0, 1]).written == 1
        assert conn.load(hashes, [4, 5]).loaded == 2
        assert _same_slots(conn, [0, 1], [4, 5])
    finally:
        conn.close()


def test_a_client_that_mounts_memory_serves_its_pages_to_others_with_the_shared_engine(
    loopback_env: None,
) -> None:
    # Embedded mode: no storage process; the backend's own client contributes the
    # segment, set up with the transfer engine kvconn starts for replica reads.
    with MooncakeCluster(storage_processes=0) as bare:
        host = _open(_options(bare, global_segment_size=32 * MiB))
        reader = _open(_options(bare))
        try:
            assert host._session.reader is not None  # fail-over on: the client shares an engine
            keys = [f"embedded/{i}" for i in range(8)]
            values = [_value(i, 64 * 1024) for i in range(8)]
            assert host.put(keys, values) == [True] * 8
            assert len(bare.segments()) == 1
            buffers = [bytearray(len(v)) for v in values]
            assert reader.get(keys, buffers) == [True] * 8
            assert [bytes(b) for b in buffers] == values
        finally:
            reader.close()
            host.close()


# ---------------------------------------------------------------- the connector on top
def test_the_connector_registers_its_staging_once_and_moves_pages_without_copies(
    cluster: MooncakeCluster,
) -> None:
    layout = minimax_m3(tp_size=1, layers=2, num_slots=8)
    pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
    conn = Connector(
        ConnectorConfig(
            model=f"mm3-{uuid.uuid4().hex[:8]}", backend="mooncake", options=_options(cluster)
        ),
        layout,
        rank=0,
        pools=[pool],
    )
    backend: Any = conn.backend
    try:
        hashes = block_hashes(list(range(32 * 4)), 32)
        saved = conn.save(hashes, [0, 1, 2, 3])
        assert saved.written > 0 and saved.dropped == 0
        assert conn.lookup(hashes).blocks == 4
        result = conn.load(hashes, [4, 5, 6, 7])
        assert result.ok and result.loaded == 4
        assert len(backend._session.memory.registry) == 1  # the staging buffer, registered once
        assert backend.counters["put_scratch"] == backend.counters["get_scratch"] == 0
        # every page, plus one layout manifest per page kind, went out without a copy
        assert backend.counters["put_zero_copy"] == saved.written + len(conn.plans)
        assert backend.counters["get_zero_copy"] > 0
    finally:
        conn.close()


# ---------------------------------------------------------------- configuration
def test_mooncake_environment_variables_configure_the_backend(
    cluster: MooncakeCluster, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    for name, value in cluster.env.items():
        monkeypatch.setenv(name, value)
    backend = _open({"setup_retries": 1})
    try:
        assert backend.config.master_address == cluster.master_address
        assert backend.config.sources["master_address"] == "MOONCAKE_MASTER"
        assert backend.config.global_segment_size == 0
        assert backend.put([f"{prefix}/env"], [b"from env"]) == [True]
        assert backend.exists([f"{prefix}/env"]) == [True]
    finally:
        backend.close()


def test_a_mooncake_config_path_json_configures_the_backend_and_options_win(
    cluster: MooncakeCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, prefix: str
) -> None:
    document = {**cluster.config_json(), "local_buffer_size": "32mb"}
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(document))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    monkeypatch.setenv("MOONCAKE_MASTER", f"127.0.0.1:{free_port()}")  # ignored: the file wins
    backend = _open({"setup_retries": 1, "local_hostname": "127.0.0.1"})
    try:
        assert backend.config.master_address == cluster.master_address
        assert backend.config.local_buffer_size == 32 * MiB
        assert backend.config.sources["local_hostname"] == "option"
        assert backend.config.sources["metadata_server"].startswith("key 'metadata_server'")
        assert backend.put([f"{prefix}/json"], [b"from json"]) == [True]
    finally:
        backend.close()


def test_the_mooncake_backend_is_listed_as_usable() -> None:
    infos = {info.name: info for info in describe_backends()}
    assert "mooncake" in infos
    from kvconn_mooncake import MooncakeBackend

    assert infos["mooncake"].problem == MooncakeBackend.client_problem()


_MASTER = "127.0.0.1:1"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"master_address": "no-port"}, "option 'master_address' must be host:port"),
        ({"master_address": "h:99999"}, "option 'master_address'"),
        ({"master_address": 5}, "option 'master_address' must be a string"),
        ({"master_address": _MASTER, "protocol": "udp"}, "option 'protocol' must be one of"),
        ({"master_address": _MASTER, "metadata_server": ""}, "option 'metadata_server'"),
        ({"master_address": _MASTER, "device_name": 5}, "option 'device_name'"),
        ({"master_address": _MASTER, "local_hostname": "a b"}, "option 'local_hostname'"),
        ({"master_address": _MASTER, "global_segment_size": -1}, "option 'global_segment_size'"),
        ({"master_address": _MASTER, "global_segment_size": "lots"}, "'global_segment_size'"),
        (
            {"master_address": _MASTER, "global_segment_size": "1.5"},
            r"option 'global_segment_size': '1.5' is 1.5 bytes, not a whole number",
        ),
        ({"master_address": _MASTER, "local_buffer_size": True}, "option 'local_buffer_size'"),
        ({"master_address": _MASTER, "replica_num": 0}, "option 'replica_num'"),
        ({"master_address": _MASTER, "replica_num": True}, "option 'replica_num'"),
        ({"master_address": _MASTER, "soft_pin": "yes"}, "option 'soft_pin'"),
        ({"master_address": _MASTER, "setup_retries": 0}, "option 'setup_retries'"),
        ({"master_address": _MASTER, "probe_timeout_s": 0}, "option 'probe_timeout_s'"),
        ({"master_address": _MASTER, "scratch_bytes": 0}, "option 'scratch_bytes'"),
        ({"master_address": _MASTER, "read_env": "no"}, "option 'read_env'"),
        ({"master_address": _MASTER, "read_failover": 1}, "option 'read_failover'"),
        ({"master_address": _MASTER, "transfers_in_flight": -1}, "option 'transfers_in_flight'"),
        ({"master_address": _MASTER, "transfers_in_flight": "8"}, "option 'transfers_in_flight'"),
        ({"master_address": _MASTER, "transfers_in_flight": 1.5}, "option 'transfers_in_flight'"),
        ({"master_address": _MASTER, "no_such_option": 1}, "unknown option.*no_such_option"),
        ({"read_env": False}, "option 'master_address' is required"),
    ],
)
def test_bad_options_are_rejected_naming_the_option(options: dict[str, Any], match: str) -> None:
    require_or_skip(_client_problem())
    with pytest.raises(ConfigError, match=match):
        _open(options)


def test_a_bad_mooncake_environment_variable_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_or_skip(_client_problem())
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", _MASTER)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ConfigError, match="environment variable MOONCAKE_PROTOCOL"):
        _open({})


def test_a_broken_mooncake_config_file_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    require_or_skip(_client_problem())
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    with pytest.raises(ConfigError, match=r"MOONCAKE_CONFIG_PATH.*not valid JSON"):
        _open({})
    path.write_text(json.dumps({"master_server_address": _MASTER, "global_segment_size": "x"}))
    with pytest.raises(ConfigError, match=r"key 'global_segment_size' in .*broken.json"):
        _open({})


def test_settings_follow_option_then_file_then_environment_then_default() -> None:
    from kvconn_mooncake._config import make_config

    knobs: dict[str, Any] = {
        "replica_num": 1,
        "soft_pin": False,
        "setup_retries": None,
        "probe_timeout_s": 0.5,
        "scratch_bytes": MiB,
        "read_env": True,
        "read_failover": True,
        "transfers_in_flight": None,
    }
    env = {
        "MOONCAKE_MASTER": "env:1",
        "MOONCAKE_PROTOCOL": "RDMA",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "3.125gb",
        "MOONCAKE_DEVICE": "mlx5_0",
    }
    config = make_config({"master_address": "opt:2", **knobs}, environ=env)
    assert (config.master_address, config.protocol) == ("opt:2", "rdma")
    assert config.global_segment_size == 3355443200 and config.device_name == "mlx5_0"
    assert config.metadata_server == "P2PHANDSHAKE" and config.sources["metadata_server"] == (
        "default"
    )
    config = make_config({"device_name": ["mlx5_0", "mlx5_1"], **knobs}, environ=env)
    assert config.device_name == "mlx5_0,mlx5_1"
    assert config.master_host_port == ("env", 1)
    etcd = make_config({"master_address": "etcd://a:1;b:2", **knobs}, environ={})
    assert etcd.master_host_port is None  # no TCP probe for a master with HA


@pytest.mark.parametrize(
    ("protocol", "option", "queue", "bound"),
    [
        ("tcp", None, None, 1024),  # Mooncake's default queue per peer
        ("tcp", None, "4096", 4096),
        ("tcp", None, "70000", 1024),  # Mooncake ignores a value over 65535, so do we
        ("tcp", None, "lots", 1024),
        ("tcp", 16, "4096", 16),  # the option wins
        ("tcp", 0, None, None),  # 0: no bound
        ("rdma", None, "4096", None),  # RDMA's limits were not measured: no bound
        ("rdma", 64, None, 64),
    ],
)
def test_keys_in_flight_follow_the_option_else_the_tcp_queue_mooncake_reads(
    protocol: str, option: int | None, queue: str | None, bound: int | None
) -> None:
    from kvconn_mooncake import MooncakeBackend
    from kvconn_mooncake._config import make_config

    options = inspect.signature(MooncakeBackend.__init__).parameters
    knobs = {name: p.default for name, p in options.items() if name != "self"}
    knobs.update(master_address=_MASTER, protocol=protocol, transfers_in_flight=option)
    knobs["read_env"] = False  # the queue is read whatever read_env says: Mooncake does
    environ = {} if queue is None else {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": queue}
    assert make_config(knobs, environ=environ).transfers_in_flight == bound


# ---------------------------------------------------------------- logging
#: A client's whole life: set-up, a put and a get, close. Prints MC_LOG_LEVEL as the
#: process sees it afterwards, to show that kvconn's default was not left behind.
_CLIENT_LIFE = """
import json, os, sys
from kvconn.registry import load_backend
backend = load_backend("mooncake", json.loads(sys.argv[1]))
assert backend.put(["logging/k"], [b"x" * 4096]) == [True]
buffer = bytearray(4096)
assert backend.get(["logging/k"], [buffer]) == [True] and buffer == b"x" * 4096
backend.close()
print(os.environ.get("MC_LOG_LEVEL"))
"""
_GLOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ", re.MULTILINE)


def _client_life(cluster: MooncakeCluster, log_level: str | None) -> tuple[str, Counter[str]]:
    """Run :data:`_CLIENT_LIFE` in a fresh process; its stdout and glog lines by level."""
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    if log_level is not None:
        env["MC_LOG_LEVEL"] = log_level
    run = subprocess.run(
        [sys.executable, "-c", _CLIENT_LIFE, json.dumps(_options(cluster))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr, Counter(_GLOG_LINE.findall(run.stderr))


def test_a_backend_writes_no_mooncake_info_lines_to_stderr_by_default(
    cluster: MooncakeCluster,
) -> None:
    output, levels = _client_life(cluster, None)
    assert levels["I"] == 0, output
    assert output.startswith("None\n")  # the process's environment is as it was


@pytest.mark.parametrize(
    ("log_level", "shown"), [("INFO", "IWE"), ("ERROR", "E")], ids=["info", "error"]
)
def test_an_mc_log_level_the_user_set_wins_over_the_quiet_default(
    cluster: MooncakeCluster, log_level: str, shown: str
) -> None:
    output, levels = _client_life(cluster, log_level)
    assert {level for level, n in levels.items() if n} == set(shown), output
    assert output.startswith(f"{log_level}\n")


def test_an_mc_log_level_mooncake_does_not_know_is_named_in_a_warning(
    cluster: MooncakeCluster,
) -> None:
    output, levels = _client_life(cluster, "warning")  # Mooncake wants capitals
    assert "MC_LOG_LEVEL='warning' is not a level Mooncake knows" in output
    assert levels["I"] > 0  # as the warning says: Mooncake logs at INFO then


def test_every_option_of_the_backend_is_documented_in_docs_backends_md() -> None:
    from kvconn_mooncake import MooncakeBackend

    text = (Path(__file__).parents[1] / "docs" / "backends.md").read_text(encoding="utf-8")
    section = text.split("## `mooncake`", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)`", section, re.MULTILINE))
    options = set(inspect.signature(MooncakeBackend.__init__).parameters) - {"self"}
    assert documented == options


def _client_problem() -> str | None:
    from kvconn_mooncake import MooncakeBackend

    return MooncakeBackend.client_problem()
