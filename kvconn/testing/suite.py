"""The backend conformance suite (a pytest base class).

Usage, in a backend's test module::

    class TestMyStore(BackendTests):
        backend_name = "mystore"

        @pytest.fixture
        def backend_options(self, tmp_path):
            return {"url": ...}

        @pytest.fixture
        def server_control(self, my_server):   # only for server backends
            return my_server                    # has .stop() and .start()

Each test states a rule of the backend contract in DESIGN.md. Options must be plain
picklable values: the multi-process test opens the backend again in child processes.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import pytest

from kvconn.backend import Backend, ReadStatus
from kvconn.errors import BackendError, InvalidKeyError
from kvconn.registry import load_backend
from kvconn.testing.processes import rank_context, start


class ServerControl(Protocol):
    """Stops and restarts the real server behind a backend (same address)."""

    def stop(self) -> None: ...

    def start(self) -> None: ...


class WriteStall(Protocol):
    """Makes the real store hold the puts it receives, while it still answers ``exists``.

    For the thread-safety tests: a put the store holds is a call in flight whose end the
    test decides, so whether other threads' calls are answered meanwhile is an ordering
    the test observes, not a duration it measures. (Redis: ``CLIENT PAUSE … WRITE``;
    Mooncake: its storage processes stopped, the master still answering.)
    """

    def hold(self) -> None:
        """From now on, hold every put that arrives."""

    def holding(self) -> int:
        """How many puts (requests, or keys) the store has received and is holding now."""

    def release(self) -> None:
        """Let every held put finish, and hold no more."""


def _value(seed: int, size: int) -> bytes:
    block = seed.to_bytes(4, "little") * 16 + bytes(range(256))
    return (block * (size // len(block) + 1))[:size]


def _writer_process(
    name: str, options: dict[str, Any], prefix: str, proc: int, rounds: int, queue: Any
) -> None:
    try:
        backend = load_backend(name, options)
        shared = [f"{prefix}/shared/{i}" for i in range(rounds)]
        own = [f"{prefix}/own/{proc}/{i}" for i in range(rounds)]
        for i in range(rounds):
            value = _value(proc * 1000 + i, 4096 + i)
            backend.put([shared[i], own[i]], [value, value])
        bufs = [bytearray(4096 + i) for i in range(rounds)]
        seen = backend.get(shared, bufs)
        # A put that found another writer's put of the key in flight answers True before
        # that one completes, and until it does the key reads as a miss (never as torn
        # bytes): ask again for a while, as a reader that missed would later.
        deadline = time.monotonic() + 10
        while not all(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
            missing = [i for i, ok in enumerate(seen) if not ok]
            again = backend.get([shared[i] for i in missing], [bufs[i] for i in missing])
            for i, ok in zip(missing, again):
                seen[i] = ok
        backend.close()
        queue.put((proc, all(seen), [bytes(b) for b in bufs]))
    except BaseException as exc:  # report, never hang the parent
        queue.put((proc, False, repr(exc)))


def _replacer_process(
    name: str, options: dict[str, Any], key: str, size: int, prefix: str, queue: Any
) -> None:
    """Delete ``key`` and store other bytes under it, plus enough new values that a
    store reusing freed space would reuse the old value's (while a borrow holds it)."""
    try:
        backend = load_backend(name, options)
        backend.delete([key])
        backend.put([key], [_value(999, size)])
        for i in range(8):
            backend.put([f"{prefix}/filler/{i}"], [_value(1000 + i, 4 * size)])
        backend.close()
        queue.put(("done", None))
    except BaseException as exc:  # report, never hang the parent
        queue.put(("failed", repr(exc)))


class BackendTests:
    """Conformance tests every backend must pass against a real store."""

    backend_name: ClassVar[str] = ""
    #: Processes the concurrency test starts; each writes and reads.
    concurrent_processes: ClassVar[int] = 4

    # ------------------------------------------------------------ fixtures
    @pytest.fixture
    def backend_options(self) -> dict[str, Any]:
        raise NotImplementedError("subclasses provide the backend_options fixture")

    @pytest.fixture
    def server_control(self) -> ServerControl:
        pytest.skip("not a server backend")

    @pytest.fixture
    def backend(self, backend_options: dict[str, Any]) -> Iterator[Backend]:
        backend = self.open_backend(backend_options)
        try:
            yield backend
        finally:
            backend.close()

    @pytest.fixture
    def prefix(self) -> str:
        """A fresh key prefix per test, so tests never see each other's keys."""
        return f"conformance/{uuid.uuid4().hex}"

    def open_backend(self, options: dict[str, Any]) -> Backend:
        return load_backend(self.backend_name, options)

    # ------------------------------------------------------------ basics
    def test_the_backend_is_found_by_its_registered_name(self, backend: Backend) -> None:
        assert backend.name == self.backend_name

    def test_a_key_never_written_is_absent(self, backend: Backend, prefix: str) -> None:
        assert backend.exists([f"{prefix}/nothing"]) == [False]
        buf = bytearray(b"\xaa" * 8)
        assert backend.get([f"{prefix}/nothing"], [buf]) == [False]
        assert buf == bytearray(b"\xaa" * 8)

    @pytest.mark.parametrize("size", [1, 7, 4096, 65536 + 3, 1 << 20, (4 << 20) + 1])
    def test_values_of_many_sizes_round_trip_byte_for_byte(
        self, backend: Backend, prefix: str, size: int
    ) -> None:
        key = f"{prefix}/v{size}"
        value = _value(size, size)
        assert backend.put([key], [value]) == [True]
        assert backend.exists([key]) == [True]
        buf = bytearray(size)
        assert backend.get([key], [buf]) == [True]
        assert bytes(buf) == value

    def test_a_batch_answers_per_key_with_duplicates_and_misses(
        self, backend: Backend, prefix: str
    ) -> None:
        keys = [f"{prefix}/{i}" for i in range(20)]
        values = [_value(i, 100 + i) for i in range(20)]
        assert backend.put(keys[::2], values[::2]) == [True] * 10
        probe = [keys[0], keys[1], keys[0], keys[2], keys[3], keys[2]]
        assert backend.exists(probe) == [True, False, True, True, False, True]
        bufs = [bytearray(100 + int(k.rsplit("/", 1)[1])) for k in probe]
        assert backend.get(probe, bufs) == [True, False, True, True, False, True]
        assert bytes(bufs[0]) == values[0] and bytes(bufs[2]) == values[0]
        assert bytes(bufs[5]) == values[2]

    def test_duplicate_keys_in_one_put_store_the_first_value(
        self, backend: Backend, prefix: str
    ) -> None:
        key = f"{prefix}/dup"
        assert backend.put([key, key], [b"first!", b"second"]) == [True, True]
        buf = bytearray(6)
        assert backend.get([key], [buf]) == [True]
        assert bytes(buf) == b"first!"

    def test_put_never_overwrites_a_stored_value(self, backend: Backend, prefix: str) -> None:
        key = f"{prefix}/once"
        assert backend.put([key], [b"original"]) == [True]
        assert backend.put([key], [b"replaced"]) == [True]  # present: success, untouched
        buf = bytearray(8)
        assert backend.get([key], [buf]) == [True]
        assert bytes(buf) == b"original"

    @pytest.mark.parametrize("size", [5, 7])
    def test_a_buffer_of_the_wrong_size_fails_and_stays_untouched(
        self, backend: Backend, prefix: str, size: int
    ) -> None:
        key = f"{prefix}/six"
        backend.put([key], [b"sixsix"])
        buf = bytearray(b"\x11" * size)
        assert backend.get([key], [buf]) == [False]
        assert buf == bytearray(b"\x11" * size)

    @pytest.mark.parametrize("size", [1, 5, 7, 4096])
    def test_a_value_of_the_wrong_size_fails_into_scratch_buffers_too(
        self, backend: Backend, prefix: str, size: int
    ) -> None:
        keys = [f"{prefix}/six", f"{prefix}/six-too", f"{prefix}/absent"]
        backend.put(keys[:2], [b"sixsix", b"sixsix"])
        bufs = [bytearray(size), bytearray(6), bytearray(6)]
        assert backend.get(keys, bufs, scratch=True) == [False, True, False]
        assert bufs[1] == bytearray(b"sixsix")
        # One key into buffers of two sizes: only the right one succeeds.
        bufs = [bytearray(size), bytearray(6)]
        assert backend.get(keys[:1] * 2, bufs, scratch=True) == [False, True]
        assert bufs[1] == bytearray(b"sixsix")

    def test_scratch_gets_fill_every_buffer_of_the_right_size(
        self, backend: Backend, prefix: str
    ) -> None:
        keys = [f"{prefix}/{i}" for i in range(20)]
        values = [_value(i, 1 + 997 * i) for i in range(20)]
        backend.put(keys[::2], values[::2])
        bufs = [bytearray(len(v)) for v in values]
        assert backend.get(keys, bufs, scratch=True) == [i % 2 == 0 for i in range(20)]
        assert all(bufs[i] == values[i] for i in range(0, 20, 2))

    def test_get_accepts_memoryviews_of_larger_buffers(self, backend: Backend, prefix: str) -> None:
        key = f"{prefix}/slice"
        backend.put([key], [memoryview(b"0123456789")[2:6]])
        arena = bytearray(b"." * 12)
        assert backend.get([key], [memoryview(arena)[4:8]]) == [True]
        assert arena == bytearray(b"....2345....")

    def test_empty_batches_do_nothing(self, backend: Backend) -> None:
        assert backend.exists([]) == []
        assert backend.put([], []) == []
        assert backend.get([], []) == []
        assert backend.read([], []) == []

    # ------------------------------------------------------------ why a read failed
    @pytest.mark.parametrize("scratch", [False, True], ids=["checked", "scratch"])
    def test_read_loads_exactly_what_get_loads(
        self, backend: Backend, prefix: str, scratch: bool
    ) -> None:
        """``read`` is ``get`` telling why: the same keys load, with the same bytes."""
        keys = [f"{prefix}/{i}" for i in range(5)]
        values = [_value(i, 100 + 997 * i) for i in range(4)]
        assert backend.put(keys[:4], values) == [True] * 4
        # hits, one key twice, a miss, and a stored value asked with another size
        asked = [keys[0], keys[1], keys[0], keys[4], keys[2], keys[3]]
        sizes = [len(values[0]), len(values[1]), len(values[0]), 64, len(values[2]) + 1]
        sizes.append(len(values[3]))
        got = [bytearray(n) for n in sizes]
        read = [bytearray(n) for n in sizes]
        flags = backend.get(asked, got, scratch=scratch)
        statuses = backend.read(asked, read, scratch=scratch)
        assert flags == [True, True, True, False, False, True]
        assert [s is ReadStatus.LOADED for s in statuses] == flags, statuses
        for ok, a, b in zip(flags, got, read):
            if ok:
                assert a == b
        assert bytes(read[2]) == values[0] and bytes(read[5]) == values[3]

    @pytest.mark.parametrize("scratch", [False, True], ids=["checked", "scratch"])
    def test_an_absent_key_reads_as_missing_or_failed(
        self, backend: Backend, prefix: str, scratch: bool
    ) -> None:
        """Never ``UNREACHABLE`` (the connector would keep counting a page that is not
        there) nor ``WRONG_SIZE`` (it would delete a key nobody stored)."""
        buf = bytearray(b"\xaa" * 8)
        statuses = backend.read([f"{prefix}/nothing"], [buf], scratch=scratch)
        assert statuses in ([ReadStatus.MISSING], [ReadStatus.FAILED])
        if not scratch:
            assert buf == bytearray(b"\xaa" * 8)

    @pytest.mark.parametrize("size", [1, 5, 7, 4096])
    @pytest.mark.parametrize("scratch", [False, True], ids=["checked", "scratch"])
    def test_a_value_of_another_size_reads_as_wrong_size_or_failed(
        self, backend: Backend, prefix: str, size: int, scratch: bool
    ) -> None:
        """Stored but unusable: ``WRONG_SIZE`` makes the connector delete and rewrite it.
        Never ``MISSING`` (it is stored) nor ``UNREACHABLE`` (it would be kept, failing
        every load until the store dropped it)."""
        key = f"{prefix}/six"
        assert backend.put([key], [b"sixsix"]) == [True]
        buf = bytearray(b"\x11" * size)
        statuses = backend.read([key], [buf], scratch=scratch)
        assert statuses in ([ReadStatus.WRONG_SIZE], [ReadStatus.FAILED])
        if not scratch:
            assert buf == bytearray(b"\x11" * size)
        assert backend.exists([key]) == [True]  # reading it changed nothing

    @pytest.mark.parametrize(
        "key",
        ["", "has space", "tab\there", "nul\x00", "caf\u00e9", "x" * 251, b"bytes", 42],
        ids=["empty", "space", "tab", "nul", "non-ascii", "too-long", "bytes", "int"],
    )
    def test_invalid_keys_are_rejected_before_reaching_the_store(
        self, backend: Backend, key: Any
    ) -> None:
        with pytest.raises(InvalidKeyError):
            backend.exists([key])
        with pytest.raises(InvalidKeyError):
            backend.put([key], [b"v"])
        with pytest.raises(InvalidKeyError):
            backend.get([key], [bytearray(1)])
        if backend.capabilities.borrowed_reads:
            with pytest.raises(InvalidKeyError):
                backend.borrow([key])

    def test_bad_batches_are_rejected_with_a_clear_error(
        self, backend: Backend, prefix: str
    ) -> None:
        with pytest.raises(ValueError, match="2 keys but 1 values"):
            backend.put([f"{prefix}/a", f"{prefix}/b"], [b"x"])
        a, b = f"{prefix}/a", f"{prefix}/b"
        with pytest.raises(ValueError, match=f"value for '{b}' is empty"):
            backend.put([a, b], [b"x", b""])
        with pytest.raises(ValueError, match=f"buffer for '{b}' is read-only"):
            backend.get([a, b], [bytearray(1), b"immutable"])
        with pytest.raises(TypeError, match=f"value for '{b}' must support the buffer protocol"):
            backend.put([a, b], [b"x", "text is not bytes"])
        with pytest.raises(ValueError, match=f"buffer for '{b}' must be a contiguous buffer"):
            backend.get([a, b], [bytearray(1), memoryview(bytearray(4))[::2]])
        assert backend.exists([a, b]) == [False, False]

    # ------------------------------------------------------------ optional capabilities
    def test_delete_removes_only_the_named_keys(self, backend: Backend, prefix: str) -> None:
        if not backend.capabilities.delete:
            pytest.skip("backend does not declare delete")
        backend.put([f"{prefix}/a", f"{prefix}/b"], [b"a", b"b"])
        assert backend.delete([f"{prefix}/a", f"{prefix}/zz"]) == [True, False]
        assert backend.exists([f"{prefix}/a", f"{prefix}/b"]) == [False, True]

    def test_listing_yields_keys_under_a_prefix_with_sizes(
        self, backend: Backend, prefix: str
    ) -> None:
        if not backend.capabilities.listing:
            pytest.skip("backend does not declare listing")
        backend.put([f"{prefix}/x/1", f"{prefix}/x/2", f"{prefix}/y"], [b"1", b"22", b"333"])
        assert sorted(backend.list_keys(f"{prefix}/x/")) == [
            (f"{prefix}/x/1", 1),
            (f"{prefix}/x/2", 2),
        ]

    @pytest.mark.parametrize("outside", ["caf\u00e9", "with space", "nul\x00", "\udcc3"])
    def test_a_prefix_outside_the_key_alphabet_lists_nothing(
        self, backend: Backend, prefix: str, outside: str
    ) -> None:
        """No key can start with it; an answer, not an encoding error from the store."""
        if not backend.capabilities.listing:
            pytest.skip("backend does not declare listing")
        backend.put([f"{prefix}/x/1"], [b"1"])
        assert list(backend.list_keys(f"{prefix}/x/{outside}")) == []

    def test_registered_buffers_round_trip(self, backend: Backend, prefix: str) -> None:
        if not backend.capabilities.buffer_registration:
            pytest.skip("backend does not declare buffer registration")
        arena = bytearray(1 << 20)
        view = memoryview(arena)
        backend.register_buffer(view)
        try:
            view[:4096] = _value(3, 4096)
            keys = [f"{prefix}/reg{i}" for i in range(4)]
            assert (
                backend.put(keys, [view[i * 1024 : (i + 1) * 1024] for i in range(4)]) == [True] * 4
            )
            dest = [view[8192 + i * 1024 : 8192 + (i + 1) * 1024] for i in range(4)]
            assert backend.get(keys, dest) == [True] * 4
            assert bytes(view[8192 : 8192 + 4096]) == _value(3, 4096)
            # the same key twice in one batch fills both registered buffers
            twice = [view[16384 : 16384 + 1024], view[20480 : 20480 + 1024]]
            assert backend.get([keys[1], keys[1]], twice) == [True, True]
            assert bytes(twice[0]) == bytes(twice[1]) == _value(3, 4096)[1024:2048]
            # a registered buffer of the wrong size fails and stays untouched
            view[32768 : 32768 + 1500] = b"\x33" * 1500
            assert backend.get([keys[2]], [view[32768 : 32768 + 1500]]) == [False]
            assert bytes(view[32768 : 32768 + 1500]) == b"\x33" * 1500
        finally:
            backend.unregister_buffer(view)

    def test_a_backend_without_borrowed_reads_refuses_to_lend(
        self, backend: Backend, prefix: str
    ) -> None:
        if backend.capabilities.borrowed_reads:
            pytest.skip("backend declares borrowed reads")
        with pytest.raises(NotImplementedError, match="borrowed_reads"):
            backend.borrow([f"{prefix}/k"])

    def test_borrowed_views_show_the_stored_values_and_none_for_absent_keys(
        self, backend: Backend, prefix: str
    ) -> None:
        if not backend.capabilities.borrowed_reads:
            pytest.skip("backend does not declare borrowed reads")
        sizes = [1, 7, 4096, 65536 + 3, (1 << 20) + 1]
        keys = [f"{prefix}/b{size}" for size in sizes]
        values = [_value(size, size) for size in sizes]
        assert backend.put(keys, values) == [True] * len(keys)
        asked = [keys[3], f"{prefix}/absent", keys[0], keys[3], *keys[1:]]
        expected = [values[3], None, values[0], values[3], *values[1:]]
        with backend.borrow(asked) as views:
            assert len(views) == len(asked)
            for view, value in zip(views, expected):
                if value is None:
                    assert view is None
                    continue
                assert view is not None and view.readonly
                assert view.nbytes == len(value) and bytes(view) == value
        with backend.borrow([]) as nothing:
            assert nothing == []

    def test_borrowed_views_keep_their_bytes_while_another_process_replaces_the_value(
        self, backend: Backend, backend_options: dict[str, Any], prefix: str
    ) -> None:
        """A view is the value as it was when lent, for the whole block: another
        process deleting the key, storing other bytes under it and writing more may not
        change it (LMDB: the read transaction pins its snapshot's pages)."""
        if not backend.capabilities.borrowed_reads:
            pytest.skip("backend does not declare borrowed reads")
        if not backend.capabilities.delete:
            pytest.skip("replacing a value needs delete")
        size = 256 * 1024
        key = f"{prefix}/lent"
        original = _value(7, size)
        backend.put([key], [original])
        ctx = rank_context()
        queue = ctx.Queue()
        with backend.borrow([key]) as views:
            proc = start(
                ctx,
                _replacer_process,
                (self.backend_name, backend_options, key, size, prefix, queue),
            )
            status, detail = queue.get(timeout=120)
            proc.join(timeout=30)
            assert status == "done", detail
            view = views[0]
            assert view is not None and bytes(view) == original
        buf = bytearray(size)
        assert backend.get([key], [buf]) == [True]
        assert bytes(buf) == _value(999, size)  # outside the block, the new value

    # ------------------------------------------------------------ model-based
    def test_random_operation_sequences_agree_with_a_first_writer_wins_dict(
        self, backend: Backend
    ) -> None:
        """Hypothesis drives random batches against the store and a plain dict model."""
        from hypothesis import settings
        from hypothesis import strategies as st
        from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

        names = st.lists(st.integers(0, 7), min_size=1, max_size=6)
        sizes = st.sampled_from([1, 3, 100, 5000])

        class Model(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.prefix = f"model/{uuid.uuid4().hex}"
                self.model: dict[str, bytes] = {}

            def key(self, i: int) -> str:
                return f"{self.prefix}/{i}"

            @rule(ids=names, size=sizes, seed=st.integers(0, 255))
            def put(self, ids: list[int], size: int, seed: int) -> None:
                keys = [self.key(i) for i in ids]
                values = [_value(seed + n, size) for n in range(len(ids))]
                assert backend.put(keys, values) == [True] * len(keys)
                for k, v in zip(keys, values):
                    self.model.setdefault(k, v)

            @rule(ids=names)
            def exists(self, ids: list[int]) -> None:
                keys = [self.key(i) for i in ids]
                assert backend.exists(keys) == [k in self.model for k in keys]

            @rule(ids=names, size=sizes)
            def get(self, ids: list[int], size: int) -> None:
                keys = [self.key(i) for i in ids]
                bufs = [bytearray(b"\x5a" * size) for _ in keys]
                got = backend.get(keys, bufs)
                for k, ok, buf in zip(keys, got, bufs):
                    stored = self.model.get(k)
                    assert ok == (stored is not None and len(stored) == size)
                    assert bytes(buf) == (stored if ok else b"\x5a" * size)

        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            Model, settings=settings(max_examples=25, stateful_step_count=15, deadline=None)
        )

    # ------------------------------------------------------------ concurrency
    def test_concurrent_writers_in_several_processes_agree_on_one_value(
        self, backend: Backend, backend_options: dict[str, Any], prefix: str
    ) -> None:
        rounds = 16
        ctx = rank_context()
        queue = ctx.Queue()
        procs = [
            start(
                ctx, _writer_process, (self.backend_name, backend_options, prefix, p, rounds, queue)
            )
            for p in range(self.concurrent_processes)
        ]
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        failures = [r for r in results if not r[1]]
        assert not failures, failures
        # Every process read the same bytes for every shared key: one writer won.
        first = results[0][2]
        for _, _, seen in results[1:]:
            assert seen == first
        candidates = {
            i: {_value(p * 1000 + i, 4096 + i) for p in range(self.concurrent_processes)}
            for i in range(rounds)
        }
        for i, value in enumerate(first):
            assert value in candidates[i]
        own = [
            f"{prefix}/own/{p}/{i}" for p in range(self.concurrent_processes) for i in range(rounds)
        ]
        assert all(backend.exists(own))

    # ------------------------------------------------------------ threads
    #: Threads of the thread-safety test; each mixes exists, put, get and delete.
    concurrent_threads: ClassVar[int] = 6
    #: Options added to ``backend_options`` for the held-call test (say, a ``timeout_s``
    #: longer than a loaded machine may take to observe the held put); none: the
    #: ``backend`` fixture's backend.
    held_call_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def write_stall(self) -> WriteStall:
        pytest.skip("no way to hold this store's puts (the write_stall fixture)")

    def test_threads_sharing_one_backend_each_get_exactly_their_answers(
        self, backend: Backend, prefix: str
    ) -> None:
        """Interleaved batches from several threads: nothing lost, crossed or raised.

        Each round a thread writes keys of its own (sizes on both sides of 64 KiB, which
        some stores send differently), checks them, reads its neighbour's keys of the
        round before (a value of the wrong size must still fail), deletes some of its
        older keys, and puts its own value under keys every thread puts: first writer
        wins, so every thread must read the one value that won. A put another writer had
        in flight may leave the key reading as a miss for a moment, never as torn bytes.
        """
        if not backend.capabilities.thread_safe:
            pytest.skip("backend does not declare thread_safe")
        threads, rounds, own = self.concurrent_threads, 6, 5
        can_delete = backend.capabilities.delete
        shared_size = 5000
        barrier = threading.Barrier(threads)
        problems: list[str] = []
        seen: dict[str, set[bytes]] = {}
        seen_lock = threading.Lock()

        def key(t: int, r: int, i: int) -> str:
            return f"{prefix}/own/{t}/{r}/{i}"

        def value(t: int, r: int, i: int) -> bytes:
            size = (1, 97, 4096, 65536 + 11, 70_000)[i % 5] + t  # a crossed value misfits
            return _value(t * 10_000 + r * 100 + i, size)

        def shared(r: int) -> list[str]:
            return [f"{prefix}/shared/{r}/{j}" for j in range(2)]

        def candidates(k: str) -> set[bytes]:
            r, j = (int(part) for part in k.rsplit("/", 2)[1:])
            return {_value(1_000_000 + t * 100 + r * 10 + j, shared_size) for t in range(threads)}

        def work(t: int) -> None:
            for r in range(rounds):
                mine = [key(t, r, i) for i in range(own)]
                common = shared(r)
                values = [value(t, r, i) for i in range(own)]
                offers = [_value(1_000_000 + t * 100 + r * 10 + j, shared_size) for j in range(2)]
                assert backend.exists(mine) == [False] * own, "a key no one wrote is present"
                assert backend.put(mine + common, values + offers) == [True] * (own + 2)
                assert backend.exists(mine) == [True] * own
                bufs = [bytearray(len(v)) for v in values]
                assert backend.get(mine, bufs) == [True] * own
                assert [bytes(b) for b in bufs] == values, "a value came back crossed or torn"
                common_bufs = [bytearray(shared_size) for _ in common]
                for k, ok, buf in zip(common, backend.get(common, common_bufs), common_bufs):
                    if ok:  # a miss while the winner's put is in flight is allowed
                        assert bytes(buf) in candidates(k), "a shared value is torn"
                        with seen_lock:
                            seen.setdefault(k, set()).add(bytes(buf))
                if r > 0:  # the neighbour's keys of the last round: all stored by now
                    n = (t + 1) % threads
                    theirs = [key(n, r - 1, i) for i in range(own)]
                    expected = [value(n, r - 1, i) for i in range(own)]
                    misfit = bytearray(len(expected[0]) + 1)  # one key, a wrong size too
                    bufs = [bytearray(len(v)) for v in expected] + [misfit]
                    got = backend.get(theirs + theirs[:1], bufs, scratch=True)
                    assert got == [True] * own + [False], f"a neighbour's keys read {got}"
                    assert [bytes(b) for b in bufs[:own]] == expected
                if can_delete and r > 1:  # nobody reads the round before last any more
                    old = [key(t, r - 2, i) for i in range(0, own, 2)]
                    assert backend.delete(old) == [True] * len(old)
                    assert backend.exists(old + mine[:1]) == [False] * len(old) + [True]
                barrier.wait(timeout=120)

        def run(t: int) -> None:
            try:
                work(t)
            except threading.BrokenBarrierError:
                pass  # another thread failed and said why
            except BaseException as exc:
                problems.append(f"thread {t}: {exc!r}")
                barrier.abort()

        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert not any(w.is_alive() for w in workers), "a thread hung"
        assert not problems, problems
        # Every put has finished: each shared key reads as the one value that won, and
        # every thread that read it earlier saw that same value.
        for r in range(rounds):
            common = shared(r)
            bufs = [bytearray(shared_size) for _ in common]
            assert backend.get(common, bufs) == [True, True]
            for k, buf in zip(common, bufs):
                assert bytes(buf) in candidates(k)
                assert seen.get(k, {bytes(buf)}) == {bytes(buf)}, f"threads disagree on {k}"

    def test_puts_the_store_holds_do_not_hold_up_calls_from_other_threads(
        self,
        backend: Backend,
        backend_options: dict[str, Any],
        write_stall: WriteStall,
        prefix: str,
    ) -> None:
        """Calls overlap: two puts the store holds are both in flight, and exists answers.

        Judged by order, not by time: the store holds each put until the test releases
        it, so a backend that serialized its calls (one lock around the round trip)
        would never have the second put reach the store, nor answer the exists, until
        then. Only after both happened are the puts let go, and both must succeed.
        """
        if not backend.capabilities.thread_safe:
            pytest.skip("backend does not declare thread_safe")
        store = backend
        if self.held_call_options:
            store = self.open_backend({**backend_options, **self.held_call_options})
        present = f"{prefix}/present"
        held = [f"{prefix}/held/{i}" for i in range(2)]
        assert store.put([present], [b"here"]) == [True]
        outcome: dict[str, object] = {}

        def put(k: str) -> None:
            try:
                outcome[k] = store.put([k], [_value(len(k), 4096)])
            except BaseException as exc:
                outcome[k] = exc

        write_stall.hold()
        workers = [threading.Thread(target=put, args=(k,)) for k in held]
        try:
            for worker in workers:
                worker.start()
            deadline = time.monotonic() + 30
            while write_stall.holding() < len(held):
                assert not outcome, f"a put ended while the store held puts: {outcome}"
                assert time.monotonic() < deadline, (
                    f"the store held {write_stall.holding()} of {len(held)} puts: "
                    "a call in flight kept the other from starting"
                )
                time.sleep(0.005)
            found = store.exists([present, *held])
            assert found == [True, False, False], (
                f"exists of a stored key and two held puts: {found}"
            )
            assert not outcome, f"a put ended before the store let it: {outcome}"
        finally:
            write_stall.release()
            for worker in workers:
                worker.join(timeout=60)
            if store is not backend:
                store.close()
        assert outcome == {k: [True] for k in held}
        assert backend.exists(held) == [True, True]

    # ------------------------------------------------------------ server down
    def test_an_unreachable_store_raises_a_backend_error_not_a_miss(
        self, backend: Backend, server_control: ServerControl, prefix: str
    ) -> None:
        key = f"{prefix}/k"
        backend.put([key], [b"value"])
        server_control.stop()
        try:
            with pytest.raises(BackendError):
                backend.exists([key])
            with pytest.raises(BackendError):
                backend.get([key], [bytearray(5)])
            with pytest.raises(BackendError):  # "could not ask" is never a status
                backend.read([key], [bytearray(5)], scratch=True)
            with pytest.raises(BackendError):
                backend.put([f"{prefix}/new"], [b"value"])
            if backend.capabilities.borrowed_reads:
                with pytest.raises(BackendError), backend.borrow([key]):
                    pass
        finally:
            server_control.start()

    def test_the_same_backend_object_works_again_after_the_server_returns(
        self, backend: Backend, server_control: ServerControl, prefix: str
    ) -> None:
        server_control.stop()
        server_control.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                assert backend.put([f"{prefix}/after"], [b"back"]) == [True]
                break
            except BackendError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        buf = bytearray(4)
        assert backend.get([f"{prefix}/after"], [buf]) == [True]
        assert bytes(buf) == b"back"


def in_ci() -> bool:
    """CI sets this: server-backed suites then fail instead of skipping."""
    return os.environ.get("KVCONN_DEV_REQUIRE_SERVERS", "") not in ("", "0") or os.environ.get(
        "CI", ""
    ).lower() in ("1", "true")


def require_or_skip(reason: str | None) -> None:
    """Skip locally when a server binary is missing; fail in CI, where it must be there."""
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"server required in CI but unavailable: {reason}")
    pytest.skip(reason)


class ExactReadStatusTests:
    """For a backend whose store answers for every key it is asked about, so ``read``
    always tells an absent key (``MISSING``) from a value of another size
    (``WRONG_SIZE``), never ``FAILED`` for them. Mixed into a :class:`BackendTests`
    subclass, whose ``backend`` and ``prefix`` fixtures it uses."""

    @pytest.mark.parametrize("scratch", [False, True], ids=["checked", "scratch"])
    def test_a_read_says_missing_for_an_absent_key_and_wrong_size_for_another_length(
        self, backend: Backend, prefix: str, scratch: bool
    ) -> None:
        """In one batch with a key asked twice: the reason, never ``FAILED``, and failed
        buffers left untouched."""
        six, ok = f"{prefix}/six", f"{prefix}/ok"
        assert backend.put([six, ok], [b"sixsix", b"ok"]) == [True, True]
        bufs = [bytearray(5), bytearray(7), bytearray(6), bytearray(2)]
        assert backend.read([six, six, f"{prefix}/absent", ok], bufs, scratch=scratch) == [
            ReadStatus.WRONG_SIZE,
            ReadStatus.WRONG_SIZE,
            ReadStatus.MISSING,
            ReadStatus.LOADED,
        ]
        assert bufs[:3] == [bytearray(5), bytearray(7), bytearray(6)]  # untouched
        assert bufs[3] == b"ok"
