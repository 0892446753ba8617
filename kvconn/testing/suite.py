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
import time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import pytest

from kvconn.backend import Backend
from kvconn.errors import BackendError, InvalidKeyError
from kvconn.registry import load_backend
from kvconn.testing.processes import rank_context, start


class ServerControl(Protocol):
    """Stops and restarts the real server behind a backend (same address)."""

    def stop(self) -> None: ...

    def start(self) -> None: ...


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
            with pytest.raises(BackendError):
                backend.put([f"{prefix}/new"], [b"value"])
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
