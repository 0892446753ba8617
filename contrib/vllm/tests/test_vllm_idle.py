"""While a hit loads and nothing else runs, vLLM's steps compute nothing and poll the
connector: an idle step waits for the oldest load (``idle_wait_s`` at most) instead of
returning at once, so the polling loop leaves the core and the GIL to the load."""

from __future__ import annotations

import threading
import time

from kvconn.transfer import Transfer
from kvconn_vllm.connector import wait_for_a_load


def loads(n: int) -> list[Transfer]:
    return [Transfer("load", f"req-{i}", 4) for i in range(n)]


def test_an_idle_step_returns_as_soon_as_the_oldest_load_finishes() -> None:
    handles = loads(2)
    threading.Timer(0.05, handles[0].cancel).start()  # finishes it, from another thread
    started = time.monotonic()
    wait_for_a_load(handles, 30.0)
    assert handles[0].done()
    assert time.monotonic() - started < 10  # not the 30 s bound


def test_an_idle_step_waits_no_longer_than_idle_wait_s() -> None:
    handles = loads(1)
    started = time.monotonic()
    wait_for_a_load(handles, 0.05)
    waited = time.monotonic() - started
    assert not handles[0].done()
    assert 0.05 <= waited < 10


def test_a_step_with_a_load_done_already_or_no_wait_configured_does_not_wait() -> None:
    handles = loads(2)
    handles[1].cancel()
    started = time.monotonic()
    wait_for_a_load(handles, 30.0)  # the newer one is done: report it now
    wait_for_a_load(handles[:1], 0.0)  # idle_wait_s = 0
    wait_for_a_load([], 30.0)
    assert time.monotonic() - started < 10
