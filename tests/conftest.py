"""Fixtures several test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvconn.testing.suite import require_or_skip
from kvconn.tools.devserver.redis import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server on a free loopback port for a whole test module; a missing
    redis-server skips locally and fails in CI. (Modules whose tests each need a server
    of their own define a per-test ``redis_server`` instead.)"""
    require_or_skip(RedisServer.available())
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
