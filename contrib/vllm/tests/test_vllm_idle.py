"""While a hit loads and nothing else runs, vLLM's steps compute nothing and poll the
connector: an idle step waits for the oldest load (``idle_wait_s`` at most) instead of
returning at once, so the polling loop leaves the core and the GIL to the load; a rank
with no load of its own (another rank's load, a lookup) waits ``idle_wait_s``, except
in the step after it reported its loads, when the other ranks report theirs."""

from __future__ import annotations

import threading
import time

from kvconn.transfer import Transfer
from kvconn_vllm.connector import wait_while_idle


def loads(n: int) -> list[Transfer]:
    return [Transfer("load", f"req-{i}", 4) for i in range(n)]


def test_an_idle_step_returns_as_soon_as_the_oldest_load_finishes() -> None:
    handles = loads(2)
    threading.Timer(0.05, handles[0].cancel).start()  # finishes it, from another thread
    started = time.monotonic()
    wait_while_idle(handles, 30.0)
    assert handles[0].done()
    assert time.monotonic() - started < 10  # not the 30 s bound


def test_an_idle_step_waits_no_longer_than_idle_wait_s() -> None:
    handles = loads(1)
    started = time.monotonic()
    wait_while_idle(handles, 0.05)
    waited = time.monotonic() - started
    assert not handles[0].done()
    assert 0.05 <= waited < 10


def test_a_step_with_a_load_done_already_or_no_wait_configured_does_not_wait() -> None:
    handles = loads(2)
    handles[1].cancel()
    started = time.monotonic()
    wait_while_idle(handles, 30.0)  # the newer one is done: report it now
    wait_while_idle(handles[:1], 0.0)  # idle_wait_s = 0
    wait_while_idle([], 0.0)
    assert time.monotonic() - started < 10


def test_a_rank_with_no_load_of_its_own_waits_idle_wait_s_instead_of_spinning() -> None:
    """At TP=2 the rank whose load was done first spun through empty steps at 93% of its
    core while the other rank's load waited on a store server that got no CPU."""
    started = time.monotonic()
    wait_while_idle([], 0.05)
    assert 0.05 <= time.monotonic() - started < 10


def test_a_rank_that_reported_its_loads_the_step_before_does_not_hold_the_others_report() -> None:
    """At TP=2 the rank whose load ended first reported it, then slept the whole
    ``idle_wait_s`` in the step where the other rank reported its own: 3.3 ms of a fresh
    hit's time before the model ran."""
    started = time.monotonic()
    wait_while_idle([], 30.0, reported=True)
    assert time.monotonic() - started < 10  # not the 30 s bound
    handles = loads(1)  # a load still in flight is waited for as before
    started = time.monotonic()
    wait_while_idle(handles, 0.05, reported=True)
    assert 0.05 <= time.monotonic() - started < 10
