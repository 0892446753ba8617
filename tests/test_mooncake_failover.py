"""Replica fail-over logic (:mod:`kvconn_mooncake._failover`) against a scripted engine.

The real behaviour (a killed storage process, reads served by the live copy) is tested
against real Mooncake processes in ``test_mooncake_backend.py`` and
``test_tp_group_mooncake.py``; here the engine is a stand-in so the ordering and
endpoint bookkeeping can be checked exactly.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kvconn_mooncake._failover import (
    Copy,
    Read,
    ReplicaReader,
    Stored,
    bare_host,
    make_engine,
)

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
    reader = ReplicaReader(_Engine(dead=set()))
    assert reader.should_bypass(Stored(64, copies), avoid) is bypass


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
