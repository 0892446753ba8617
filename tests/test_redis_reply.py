"""Reading an ``MGET`` reply off the socket into a reused buffer (kvconn_redis._reply).

The parser's rules over scripted sockets (the protocol logic in isolation), then the
backend over a real redis-server that the tests start: its loads lend values from the
reused buffers, and a view the borrower kept is never written over.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from kvconn_redis._reply import (
    KEEP_BYTES,
    KEEP_COUNT,
    ProtocolError,
    ReplyBuffers,
    ReplyError,
    new_buffer,
    read_mget,
)

from kvconn.backend import Backend
from kvconn.errors import ConfigError
from kvconn.registry import load_backend
from kvconn.tools.devserver.redis import RedisServer


class Scripted:
    """A socket that hands out ``data`` at most ``step`` bytes per ``recv_into``."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step, self.pos, self.reads = data, step, 0, 0

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        self.reads += 1
        n = min(self.step, len(view), len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def mget_reply(*values: bytes | None) -> bytes:
    parts = [b"*%d\r\n" % len(values)]
    for value in values:
        parts.append(b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value))
    return b"".join(parts)


VALUES = [b"a" * 3000, None, b"", bytes(range(256)) * 40, b"x\r\ny"]


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_values_are_found_in_place_however_the_socket_splits_the_reply(step):
    sock = Scripted(mget_reply(*VALUES), step)
    reply = read_mget(sock, len(VALUES), new_buffer(16))  # too small: it grows
    got = [None if s is None else bytes(reply.buffer[s[0] : s[0] + s[1]]) for s in reply.spans]
    assert got == VALUES
    assert sock.pos == len(sock.data)


def test_a_large_reply_grows_the_buffer_once_from_its_first_value():
    values = [bytes([i]) * 100_000 for i in range(20)]
    sock = Scripted(mget_reply(*values), 1 << 16)
    buffer = new_buffer(1024)
    reply = read_mget(sock, 20, buffer)
    assert 20 * 100_000 <= len(reply.buffer) < 2 * 20 * 100_002
    assert buffer is not reply.buffer and len(buffer) == 1024


def test_a_buffer_big_enough_is_used_as_it_is():
    buffer = new_buffer(1 << 20)
    assert read_mget(Scripted(mget_reply(b"v" * 1000), 1 << 20), 1, buffer).buffer is buffer


def test_an_error_reply_raises_with_the_servers_text():
    with pytest.raises(ReplyError, match="NOPERM this user has no permissions"):
        read_mget(Scripted(b"-NOPERM this user has no permissions\r\n", 5), 2, new_buffer(64))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"*3\r\n", "expected an array of 2 values"),
        (b"+OK\r\n", "expected an array of 2 values"),
        (b"*2\r\n:5\r\n", "value 0: expected a bulk string"),
        (b"*2\r\n$-2\r\n", "value 0: bulk string of length -2"),
        (b"*2\r\n$x\r\n", "is not a number"),
        (b"*2\r\n$3\r\nabcde", r"does not end in \\r\\n"),
        (b"*2\r\n$" + b"9" * 40, "a header line longer than 32 bytes"),
    ],
)
def test_bytes_that_are_no_mget_reply_are_a_protocol_error(data, message):
    with pytest.raises(ProtocolError, match=message):
        read_mget(Scripted(data, 3), 2, new_buffer(64))


def test_bytes_read_past_the_reply_are_a_protocol_error():
    with pytest.raises(ProtocolError, match="8 bytes after the reply"):
        read_mget(Scripted(mget_reply(b"a", b"b") + b"+extra\r\n", 1 << 10), 2, new_buffer(64))


def test_a_server_that_closes_mid_reply_is_a_connection_error():
    data = mget_reply(b"a" * 100, b"b" * 100)[:150]
    with pytest.raises(ConnectionError, match="closed the connection in mid-reply"):
        read_mget(Scripted(data, 64), 2, new_buffer(64))


def test_a_buffer_given_back_is_taken_again_by_any_thread_and_a_huge_one_is_not_kept():
    buffers = ReplyBuffers()
    first = buffers.take()
    assert buffers.take() is not first  # lent out: a call meanwhile gets its own
    buffers.give(first)
    other: list[mmap.mmap] = []
    thread = threading.Thread(target=lambda: other.append(buffers.take()))
    thread.start()
    thread.join()
    assert other[0] is first
    buffers.give(new_buffer(KEEP_BYTES + 1))
    assert len(buffers.take()) < KEEP_BYTES


def test_the_largest_buffers_are_kept_and_taken_first():
    buffers = ReplyBuffers()
    sizes = [10, 50, 20, 40, 30]
    for size in sizes:
        buffers.give(new_buffer(size))
    assert [len(buffers.take()) for _ in range(KEEP_COUNT)] == [50, 40, 30]


# ------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def store(redis_server: RedisServer) -> Iterator[Backend]:  # tests/conftest.py
    backend = load_backend("redis", {"url": redis_server.url})
    try:
        yield backend
    finally:
        backend.close()


SIZE = 768 << 10


def test_every_load_is_read_into_the_same_buffer(store):
    keys = [f"reuse/{i}" for i in range(4)]
    assert all(store.put(keys, [memoryview(bytes([i]) * SIZE) for i in range(4)]))
    seen = []
    for _ in range(3):
        with store.borrow(keys) as views:
            assert [bytes(v[:1]) for v in views] == [bytes([i]) for i in range(4)]
            with memoryview(views[0]).cast("B") as v:
                seen.append(np.frombuffer(v, np.uint8).__array_interface__["data"][0])
    assert seen[0] == seen[1] == seen[2]


def test_a_view_kept_past_its_borrow_is_never_written_over_by_a_later_load(store):
    first, second = ["kept/a", "kept/b"], ["kept/c", "kept/d"]
    assert all(store.put(first, [memoryview(b"\x01" * SIZE)] * 2))
    assert all(store.put(second, [memoryview(b"\x02" * SIZE)] * 2))
    with store.borrow(first) as views:
        kept = views[0][10:20]  # a slice the lending code never saw
    with store.borrow(second) as views:
        assert bytes(views[1][:4]) == b"\x02" * 4
    assert bytes(kept) == b"\x01" * 10
    kept.release()
    with store.borrow(first) as views:
        assert bytes(views[1][:4]) == b"\x01" * 4


def test_without_reused_buffers_values_come_as_redis_py_parses_them(redis_server, store):
    """``reuse_reply_buffers = false``: the same values, each in memory of its own."""
    keys = [f"parsed/{i}" for i in range(3)]
    assert all(store.put(keys, [memoryview(bytes([i + 5]) * SIZE) for i in range(3)]))
    plain = load_backend("redis", {"url": redis_server.url, "reuse_reply_buffers": False})
    try:
        with plain.borrow([*keys, "parsed/absent"]) as views:
            assert [bytes(v[:2]) for v in views[:3] if v] == [bytes([i + 5]) * 2 for i in range(3)]
            assert views[3] is None
            first, second = views[0], views[1]
            assert first is not None and second is not None
            assert first.obj is not second.obj  # bytes of their own, not one reply buffer
        buffers = [memoryview(bytearray(SIZE)) for _ in keys]
        assert all(plain.get(keys, buffers))
        assert bytes(buffers[2][:1]) == b"\x07"
    finally:
        plain.close()


@pytest.mark.parametrize("value", ["yes", 1])
def test_reuse_reply_buffers_must_be_a_bool(value):
    with pytest.raises(ConfigError, match="option 'reuse_reply_buffers' must be a bool"):
        load_backend("redis", {"url": "redis://127.0.0.1:1/0", "reuse_reply_buffers": value})
