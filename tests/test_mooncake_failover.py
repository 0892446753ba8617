"""Replica fail-over without a server: the policy (:mod:`kvconn_mooncake._failover`) and
the replica reader (:mod:`kvconn_mooncake._replicas`) against a scripted engine.

The real behaviour (a killed storage process, reads served by the live copy) is tested
against real Mooncake processes in ``test_mooncake_backend.py`` and
``test_tp_group_mooncake.py``; here the engine and the replica descriptors are stand-ins,
so the ordering, the endpoint bookkeeping and each decision can be checked exactly.
"""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from kvconn_mooncake import _codes as codes
from kvconn_mooncake._failover import (
    FUTILE_MISSES,
    RETRY,
    Reroute,
    Verdict,
    after_description,
    after_failed_transfer,
    bypass_client,
)
from kvconn_mooncake._replicas import (
    Copy,
    Read,
    ReplicaReader,
    Stored,
    bare_host,
    copies_of,
    make_engine,
)

from kvconn.backend import ReadStatus

A, B, C = "10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3"


class _Engine:
    """Transfers succeed except from endpoints listed as dead; records every call."""

    def __init__(self, dead: set[str]) -> None:
        self.dead = dead
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []

    def batch_transfer_sync_read(
        self, endpoint: str, locals_: list[int], peers: list[int], sizes: list[int]
    ) -> int:
        self.calls.append((endpoint, locals_, peers, sizes))
        return -1 if endpoint in self.dead else 0


def _read(key: str, *copies: Copy) -> Read:
    return Read(key, address=1000 + len(key), size=64, copies=copies)


def test_a_key_is_read_from_its_next_copy_when_the_first_endpoint_fails() -> None:
    engine = _Engine(dead={A})
    reader = ReplicaReader(engine)
    done = reader.read([_read("k1", Copy(A, 1), Copy(B, 2)), _read("k22", Copy(B, 3), Copy(A, 4))])
    assert done == [True, True]
    # One batch per endpoint and pass: A failed for k1 only, which then went to B.
    assert [(e, peers) for e, _, peers, _ in engine.calls] == [(A, [1]), (B, [3]), (B, [2])]
    assert reader.failed_endpoints() == {A}


def test_endpoints_known_to_fail_are_tried_last_and_not_again_first() -> None:
    engine = _Engine(dead={A})
    reader = ReplicaReader(engine)
    reader.mark_failed([A])
    assert reader.read([_read("k", Copy(A, 1), Copy(B, 2))]) == [True]
    assert [e for e, *_ in engine.calls] == [B]


def test_a_key_whose_every_copy_fails_reads_false_and_others_still_succeed() -> None:
    engine = _Engine(dead={A, B})
    reader = ReplicaReader(engine)
    done = reader.read([_read("k1", Copy(A, 1), Copy(B, 2)), _read("k2", Copy(C, 3))])
    assert done == [False, True]
    assert reader.failed_endpoints() == {A, B}


def test_a_binding_exception_is_a_failed_transfer_not_a_crash() -> None:
    class Raising(_Engine):
        def batch_transfer_sync_read(self, *args: Any) -> int:
            raise RuntimeError("binding error")

    reader = ReplicaReader(Raising(dead=set()))
    assert reader.read([_read("k", Copy(A, 1))]) == [False]
    assert reader.failed_endpoints() == {A}


def test_a_failed_endpoint_is_forgotten_after_the_avoid_window() -> None:
    reader = ReplicaReader(_Engine(dead=set()), avoid_s=0.0)
    reader.mark_failed([A])
    assert reader.failed_endpoints() == set()


@pytest.mark.parametrize(
    ("copies", "avoid", "bypass"),
    [
        ((Copy(A, 1), Copy(B, 2)), {A}, True),  # a live copy exists: go around the client
        ((Copy(A, 1), Copy(B, 2)), set(), False),  # nothing known to fail
        ((Copy(A, 1),), {A}, False),  # the only copy: nothing to fail over to
        ((Copy(A, 1), Copy(B, 2)), {A, B}, False),  # every copy suspect: let the client try
        ((Copy(B, 1), Copy(C, 2)), {A}, False),  # the failed endpoint holds no copy
    ],
)
def test_reads_bypass_the_client_only_when_a_copy_is_suspect_and_another_is_not(
    copies: tuple[Copy, ...], avoid: set[str], bypass: bool
) -> None:
    assert bypass_client(Stored(64, copies), avoid) is bypass


@pytest.mark.parametrize(
    ("hostname", "host"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.1:12345", "127.0.0.1"),
        ("node-3.cluster", "node-3.cluster"),
        ("[fe80::1]:80", "[fe80::1]"),
        ("fe80::1", "fe80::1"),
    ],
)
def test_the_engine_name_keeps_the_host_and_gets_a_port_of_its_own(
    hostname: str, host: str
) -> None:
    assert bare_host(hostname) == host


def test_an_engine_that_cannot_start_turns_failover_off_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Module:
        class TransferEngine:
            names: list[str] = []

            def initialize(self, name: str, *args: str) -> int:
                self.names.append(name)
                return -1

    with caplog.at_level(logging.WARNING):
        assert make_engine(Module, "127.0.0.1", "P2PHANDSHAKE", "tcp", "") is None
    assert "fail-over is off" in caplog.text
    names = Module.TransferEngine.names
    assert len(names) == 3 and all(n.startswith("127.0.0.1:") for n in names)


# ---------------------------------------------------------------- replica descriptors
def _replica(status: str, *, endpoint: str = "", address: int = 0, size: int = 0) -> Any:
    """A stand-in of one entry of ``batch_get_replica_desc``; ``endpoint`` "" is on disk."""
    buffer = SimpleNamespace(transport_endpoint=endpoint, buffer_address=address, size=size)
    return SimpleNamespace(
        status=status,
        is_memory_replica=lambda: bool(endpoint),
        get_memory_descriptor=lambda: SimpleNamespace(buffer_descriptor=buffer),
        get_disk_descriptor=lambda: SimpleNamespace(object_size=size),
    )


def test_only_complete_replicas_are_copies_and_a_key_without_one_is_absent() -> None:
    described = {
        "two": [
            _replica("COMPLETE", endpoint=A, address=1, size=64),
            _replica("COMPLETE", endpoint=B, address=2, size=64),
        ],
        "in-flight": [_replica("PROCESSING", endpoint=A, address=3, size=64)],
        "half": [
            _replica("PROCESSING", endpoint=A, address=4, size=64),
            _replica("COMPLETE", endpoint=C, address=5, size=64),
        ],
    }
    assert copies_of(described, "COMPLETE") == {
        "two": Stored(64, (Copy(A, 1), Copy(B, 2))),
        "half": Stored(64, (Copy(C, 5),)),
    }


def test_a_disk_replica_gives_a_size_but_no_copy_and_copies_of_another_size_are_dropped() -> None:
    described = {
        "disk": [_replica("COMPLETE", size=96)],
        "mixed": [
            _replica("COMPLETE", endpoint=A, address=1, size=64),
            _replica("COMPLETE", endpoint=B, address=2, size=32),
        ],
    }
    assert copies_of(described, "COMPLETE") == {
        "disk": Stored(96, ()),
        "mixed": Stored(64, (Copy(A, 1),)),
    }


# ---------------------------------------------------------------- the policy
@pytest.mark.parametrize(
    ("stored", "verdict"),
    [
        (None, RETRY),  # read without the size query: copies unknown, ask and try them
        (Stored(64, (Copy(A, 1), Copy(B, 2))), RETRY),  # another copy to try
        (Stored(64, (Copy(A, 1),)), Verdict(ReadStatus.UNREACHABLE, (A,))),  # the only copy
        (Stored(64, ()), Verdict(ReadStatus.UNREACHABLE)),  # no copy the engine can read
    ],
    ids=["undescribed", "two-copies", "one-copy", "no-memory-copy"],
)
def test_a_failed_transfer_is_retried_on_another_copy_or_unreachable_with_its_endpoint_dead(
    stored: Stored | None, verdict: Verdict
) -> None:
    assert after_failed_transfer(stored) == verdict


@pytest.mark.parametrize(
    ("stored", "verdict"),
    [
        (None, Verdict(ReadStatus.MISSING)),  # gone since the transfer failed
        (Stored(32, (Copy(A, 1), Copy(B, 2))), Verdict(ReadStatus.WRONG_SIZE)),
        (Stored(64, (Copy(A, 1), Copy(B, 2))), RETRY),
        (Stored(64, (Copy(A, 1),)), Verdict(ReadStatus.UNREACHABLE, (A,))),
    ],
    ids=["missing", "wrong-size", "two-copies", "one-copy"],
)
def test_a_described_read_is_missing_wrong_size_retried_or_unreachable(
    stored: Stored | None, verdict: Verdict
) -> None:
    assert after_description(stored, 64) == verdict


def test_failed_puts_are_retried_only_for_a_transfer_failure_and_witnessed_by_landed_keys() -> None:
    keys = [f"k{i}" for i in range(12)]
    results = [codes.OK, codes.TRANSFER_FAIL, codes.NO_AVAILABLE_HANDLE]
    results += [codes.OBJECT_ALREADY_EXISTS] + [codes.OK] * 8
    assert Reroute.failed(results) == [1]  # a full store is a dropped save, not a reroute
    witnesses = Reroute.witnesses(keys, results)
    assert witnesses == ["k0", "k3", "k4", "k5", "k6", "k7", "k8", "k9"]  # landed, at most 8


def test_puts_are_rerouted_to_segments_seen_alive_or_recently_seen_never_to_a_dead_one() -> None:
    reroute = Reroute()
    assert reroute.segments([], set()) == []  # nothing known alive: no segment to prefer
    assert sorted(reroute.segments([B, A, B], set())) == [A, B]
    assert sorted(reroute.segments([], set())) == [A, B]  # a batch none of whose keys landed
    assert reroute.segments([], {A}) == [B]  # a read found A dead meanwhile
    assert reroute.segments([C], {A}) == [C]  # a fresh answer replaces the last one


def test_new_batches_are_steered_only_while_a_reroute_is_remembered() -> None:
    reroute = Reroute()
    assert reroute.steer(set()) == []  # no death seen: the master places freely
    reroute.segments([B, A], set())
    assert sorted(reroute.steer(set())) == [A, B]
    assert reroute.steer({A}) == [B]
    reroute.forget()
    assert reroute.steer(set()) == []
    brief = Reroute(remember_s=0.0)
    brief.segments([A], set())
    assert brief.steer(set()) == []


def test_each_answer_names_the_live_segments_first_in_turn() -> None:
    """The master puts a batch on the first preferred segment with room: were the order
    fixed, one live segment would take every write while a death is remembered."""
    reroute = Reroute()
    reroute.segments([C, A, B], set())
    answers = [reroute.steer(set()) for _ in range(6)] + [reroute.segments([], set())]
    rotations = [[A, B, C], [B, C, A], [C, A, B]]
    assert all(answer in rotations for answer in answers)
    assert Counter(answer[0] for answer in answers[:6]) == {A: 2, B: 2, C: 2}
    assert [answers[i + 1] for i in range(6)] == [
        rotations[(rotations.index(answer) + 1) % 3] for answer in answers[:6]
    ]


def test_eight_keys_placed_anywhere_that_all_missed_stop_such_placements_for_a_while() -> None:
    reroute = Reroute()
    assert reroute.place_anywhere()
    reroute.placed_anywhere(FUTILE_MISSES, landed=1)
    assert reroute.place_anywhere()
    reroute.placed_anywhere(FUTILE_MISSES, landed=0)
    assert not reroute.place_anywhere()
    quick = Reroute(remember_s=0.0)
    quick.placed_anywhere(FUTILE_MISSES, landed=0)
    assert quick.place_anywhere()


def test_a_small_placement_anywhere_that_landed_nothing_is_chance_not_futility() -> None:
    """One key lands on the dead process of two half the time: misses add up to
    :data:`FUTILE_MISSES` before placements anywhere stop, and a landing resets them."""
    reroute = Reroute()
    for _ in range(FUTILE_MISSES - 1):
        reroute.placed_anywhere(1, landed=0)
        assert reroute.place_anywhere()
    reroute.placed_anywhere(1, landed=1)
    for _ in range(FUTILE_MISSES - 1):
        reroute.placed_anywhere(1, landed=0)
    assert reroute.place_anywhere()
    reroute.placed_anywhere(1, landed=0)
    assert not reroute.place_anywhere()


def test_misses_older_than_the_memory_do_not_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    clock = SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr("kvconn_mooncake._failover.time", clock)
    reroute = Reroute(remember_s=30.0)
    reroute.placed_anywhere(FUTILE_MISSES - 1, landed=0)
    now[0] += 31.0
    reroute.placed_anywhere(1, landed=0)
    assert reroute.place_anywhere()
    reroute.placed_anywhere(FUTILE_MISSES - 1, landed=0)
    assert not reroute.place_anywhere()


def test_segments_seen_alive_are_forgotten_after_a_while() -> None:
    reroute = Reroute(remember_s=0.0)
    assert reroute.segments([A], set()) == [A]
    assert reroute.segments([], set()) == []
