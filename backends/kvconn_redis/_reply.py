"""An ``MGET`` reply read straight off the socket into one reused buffer, values in place.

redis-py (with hiredis) turns each value of a reply into a new ``bytes``: for a load,
63 values of 768 KiB are 47 MiB of memory that is new each time, since the allocator
gives it back to the kernel after the load. A load from a loopback server took
12,500 minor page faults (47 MiB in 4 KiB pages) and 64 ms to parse, against 36 ms for
the same reply read raw into one buffer (``benchmarks/bench_load.py --backend redis``,
docs/performance.md). Here the reply goes into a buffer kept from call to call
(:class:`ReplyBuffers`), and each value is lent where it landed: the socket's bytes are
copied once, by the kernel, into memory already mapped.

Only what ``MGET`` answers in RESP2 is understood: an array of bulk strings, each
``$<len>\\r\\n<bytes>\\r\\n`` or nil ``$-1\\r\\n``, or an error ``-…\\r\\n`` for the whole
command. Anything else is a protocol error, and the caller drops the connection, as it
does after any error mid-reply: a connection is never reused with a reply half read.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any, Protocol

__all__ = [
    "KEEP_BYTES",
    "KEEP_COUNT",
    "ProtocolError",
    "Reply",
    "ReplyBuffers",
    "ReplyError",
    "new_buffer",
    "read_mget",
]

#: A reply buffer is kept for the next call up to this size; a larger reply's buffer is
#: dropped after its call. A load's chunk is at most ``staging_bytes``.
KEEP_BYTES = 256 << 20
#: Buffers kept at most: one per load thread (2) and one for a call that overlaps.
KEEP_COUNT = 3
#: The first buffer a thread gets.
_FIRST_BYTES = 1 << 20
#: Longest header line (``*<count>`` or ``$<len>``) a reply may send: a longer one is
#: not RESP.
_MAX_LINE = 32
#: Longest error line (``-ERR …``) read whole.
_MAX_ERROR = 64 << 10


def new_buffer(size: int) -> mmap.mmap:
    """Anonymous memory: its pages are mapped as the socket's bytes land, once. (A
    ``bytearray`` of a load's 47 MiB took 38 ms to make, writing zeros over every page
    before any byte arrived.)"""
    return mmap.mmap(-1, size)


class _Socket(Protocol):
    def recv_into(self, buffer: Any, nbytes: int = ..., /) -> int: ...


class ReplyError(Exception):
    """The server answered the whole command with an error (``-ERR …``): its text."""


class ProtocolError(Exception):
    """The bytes are not an ``MGET`` reply: the connection must not be reused."""


class Reply:
    """The values of one reply: ``spans[i]`` is ``(offset, length)`` in ``buffer``, or
    None for nil. The buffer is the reader's until :meth:`ReplyBuffers.give`."""

    __slots__ = ("buffer", "spans")

    def __init__(self, buffer: mmap.mmap, spans: list[tuple[int, int] | None]) -> None:
        self.buffer = buffer
        self.spans = spans


class ReplyBuffers:
    """Reply buffers kept for reuse once their pages are mapped, shared by the threads
    of one client: a load thread takes whichever is free (vLLM at TP=1 loads on two
    threads in turn, and each thread's own buffer would be new to the other's load).

    A buffer is handed out by :meth:`take` and comes back by :meth:`give`; a view of it
    that the borrower kept past its block (see ``Lent``) means it never comes back, so
    no later reply can change bytes someone still reads. At most :data:`KEEP_COUNT`
    are kept, each of at most :data:`KEEP_BYTES`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()  # the largest: kept in ascending size
        return new_buffer(_FIRST_BYTES)

    def give(self, buffer: mmap.mmap) -> None:
        if len(buffer) > KEEP_BYTES:
            return
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=len)
            del self._free[: max(0, len(self._free) - KEEP_COUNT)]  # drop the smallest


def read_mget(sock: _Socket, count: int, buffer: mmap.mmap) -> Reply:
    """Read one ``MGET`` reply of ``count`` values from ``sock`` into ``buffer``.

    Returns the reply, whose buffer may be a larger one than given (grown to fit).
    Raises :class:`ReplyError` for an error reply, :class:`ProtocolError` for bytes
    that are no such reply, ``ConnectionError`` when the server closes the connection, and
    whatever ``sock.recv_into`` raises (a timeout).
    """
    reader = _Reader(sock, buffer)
    head = reader.line(_MAX_ERROR)
    if head[:1] == b"-":
        raise ReplyError(head[1:].decode("utf-8", "replace"))
    if head[:1] != b"*" or _number(head[1:]) != count:
        raise ProtocolError(f"expected an array of {count} values, got {head[:_MAX_LINE]!r}")
    spans: list[tuple[int, int] | None] = []
    for i in range(count):
        line = reader.line()
        if line[:1] != b"$":
            raise ProtocolError(f"value {i}: expected a bulk string, got {line[:_MAX_LINE]!r}")
        length = _number(line[1:])
        if length == -1:
            spans.append(None)
            continue
        if length < 0:
            raise ProtocolError(f"value {i}: bulk string of length {length}")
        start = reader.bulk(length, values_left=count - i - 1)
        spans.append((start, length))
    reader.done()
    return Reply(reader.buffer, spans)


def _number(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"{text[:_MAX_LINE]!r} is not a number") from None


class _Reader:
    """Bytes ``[pos, end)`` of ``buffer`` are read and not yet parsed."""

    def __init__(self, sock: _Socket, buffer: mmap.mmap) -> None:
        self.sock = sock
        self.buffer = buffer
        self.pos = 0
        self.end = 0

    def _fill(self, need: int, hint: int = 0) -> None:
        """Read until ``need`` bytes past ``pos`` are here; a buffer too small for them
        grows to hold ``max(need, hint)`` bytes past ``pos``."""
        if self.pos + need > len(self.buffer):
            self._grow(self.pos + max(need, hint))
        while self.end - self.pos < need:
            with memoryview(self.buffer) as view:
                got = self.sock.recv_into(view[self.end :])
            if got == 0:
                raise ConnectionError("the server closed the connection in mid-reply")
            self.end += got

    def _grow(self, size: int) -> None:
        """A buffer of at least ``size`` bytes (and twice the old), the read bytes kept
        at their offsets. Once per thread for a load's size: the buffer is reused."""
        grown = new_buffer(max(size, 2 * len(self.buffer)))
        grown[: self.end] = memoryview(self.buffer)[: self.end]
        self.buffer = grown

    def line(self, limit: int = _MAX_LINE) -> bytes:
        """The next header line, without its ``\\r\\n``."""
        while True:
            stop = self.buffer.find(b"\r\n", self.pos, self.end)
            if stop >= 0:
                line = bytes(self.buffer[self.pos : stop])
                self.pos = stop + 2
                return line
            if self.end - self.pos > limit:
                raise ProtocolError(
                    f"a header line longer than {limit} bytes: "
                    f"{bytes(self.buffer[self.pos : self.pos + _MAX_LINE])!r}"
                )
            self._fill(self.end - self.pos + 1)

    def bulk(self, length: int, values_left: int) -> int:
        """Where a bulk string of ``length`` bytes starts, once it and its ``\\r\\n``
        are read. Grows for the values still to come as for this one (a load's values
        are mostly one size), so a large reply grows the buffer once, not per value."""
        self._fill(length + 2, hint=(length + 2 + _MAX_LINE) * (values_left + 1))
        start = self.pos
        if self.buffer[start + length : start + length + 2] != b"\r\n":
            raise ProtocolError(f"a bulk string of {length} bytes does not end in \\r\\n")
        self.pos = start + length + 2
        return start

    def done(self) -> None:
        """Bytes read past the reply are no part of it. (Bytes sent after it and not yet
        read are found by the pool's check for unread data when the connection is next
        taken: redis-py drops it then.)"""
        if self.end != self.pos:
            raise ProtocolError(f"{self.end - self.pos} bytes after the reply")
