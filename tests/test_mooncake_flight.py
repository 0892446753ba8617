"""Calls that move bytes go in slices, within a bound shared by every thread.

Pure logic, with a stand-in for the client's calls: that the backend's real batches
land past Mooncake's TCP queue is tested against a real server in
``test_mooncake_backend.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
from kvconn_mooncake._flight import Flight, queue_limit
from kvconn_mooncake._replicas import Copy, Read, ReplicaReader


def test_a_call_goes_in_slices_of_the_limit_and_its_answers_join_in_order() -> None:
    calls: list[tuple[list[str], list[int]]] = []

    def call(keys: list[str], sizes: list[int]) -> list[int]:
        calls.append((keys, sizes))
        return [size * 2 for size in sizes]

    flight = Flight(4)
    keys = [f"k{i}" for i in range(10)]
    assert flight.run(call, keys, list(range(10))) == [i * 2 for i in range(10)]
    assert [c[0] for c in calls] == [keys[0:4], keys[4:8], keys[8:10]]
    assert flight.moving == 0


def test_without_a_bound_a_call_goes_whole() -> None:
    seen: list[int] = []

    def call(keys: list[int]) -> list[int]:
        seen.append(len(keys))
        return keys

    flight = Flight(None)
    assert flight.run(call, list(range(5000))) == list(range(5000))
    assert seen == [5000]
    assert flight.run(lambda k: list(k), []) == []


def test_threads_together_never_move_more_keys_than_the_limit() -> None:
    flight = Flight(10)
    lock = threading.Lock()
    moving, most = 0, 0

    def call(keys: list[int]) -> list[int]:
        nonlocal moving, most
        with lock:
            moving += len(keys)
            most = max(most, moving)
        time.sleep(0.01)
        with lock:
            moving -= len(keys)
        return keys

    answers: dict[int, list[int]] = {}

    def work(t: int) -> None:
        answers[t] = flight.run(call, list(range(t * 100, t * 100 + 25)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert most <= 10
    assert answers == {t: list(range(t * 100, t * 100 + 25)) for t in range(4)}
    assert flight.moving == 0


def test_a_slice_that_raises_stops_the_call_and_frees_its_keys() -> None:
    started: list[int] = []

    def call(keys: list[int]) -> list[int]:
        started.append(keys[0])
        if keys[0] == 3:
            raise RuntimeError("the store went away")
        return keys

    flight = Flight(3)
    with pytest.raises(RuntimeError, match="went away"):
        flight.run(call, list(range(9)))
    assert started == [0, 3]  # the slice after the failure never started
    assert flight.moving == 0
    assert flight.run(lambda k: list(k), [1, 2, 3, 4]) == [1, 2, 3, 4]  # nothing held


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        Flight(0)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        *[(None, 1024), ("4096", 4096), ("1", 1), ("65535", 65535), ("65536", 1024)],
        *[("0", 1024), ("-5", 1024), ("12k", 1024), ("", 1024), (" 8", 1024), ("٣", 1024)],
    ],
)
def test_the_queue_size_is_read_as_mooncake_reads_it(text: str | None, size: int) -> None:
    assert queue_limit(text) == size


class _Engine:
    """Records the replica reads a reader makes; fails those from ``bad`` peers."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.calls: list[list[int]] = []

    def batch_transfer_sync_read(
        self, endpoint: str, locals_: list[int], peers: list[int], sizes: list[int]
    ) -> int:
        self.calls.append(list(peers))
        return -1 if self.bad & set(peers) else 0


def test_replica_reads_go_in_slices_and_only_a_failed_slice_moves_on_to_other_copies() -> None:
    engine = _Engine(bad=set())
    reader = ReplicaReader(engine, Flight(2))
    reads = [Read(f"k{i}", 1000 + i, 8, (Copy("a:1", 100 + i),)) for i in range(5)]
    assert reader.read(reads) == [True] * 5
    assert engine.calls == [[100, 101], [102, 103], [104]]

    engine = _Engine(bad={103})
    reader = ReplicaReader(engine, Flight(2))
    reads = [
        Read(f"k{i}", 1000 + i, 8, (Copy("a:1", 100 + i), Copy("b:2", 200 + i))) for i in range(5)
    ]
    # the slice holding 103 failed on a:1 and went to b:2; the others landed on a:1
    assert reader.read(reads) == [True] * 5
    assert engine.calls == [[100, 101], [102, 103], [104], [202, 203]]
    assert reader.failed_endpoints() == {"a:1"}
