"""One deadline for a whole backend call, enforced on every socket operation.

redis-py's ``socket_timeout`` bounds each read or write on its own, so a server that
sends one byte every 0.3 s never trips a 1 s timeout and keeps a call waiting for as long
as the reply takes (issue 11: 25 s for ``timeout_s=1``). The backend therefore opens a
deadline around each call (:func:`deadline`) and redis-py's connections are given
sockets that re-arm their timeout to the time *left* before every ``recv``/``send``
(:class:`_DeadlineSocket`), and raise ``socket.timeout`` once it is gone. Connecting,
the TLS handshake and waiting for a pooled connection are clamped the same way.

Nothing here changes what redis-py does with a timeout: it is the same
``socket.timeout`` a slow server produces, so redis-py drops the connection and raises
its ``TimeoutError`` as usual — a timed-out connection is never reused with a reply
half read. Outside a call (no deadline open) the sockets behave as redis-py set them.

The deadline lives in a :class:`~contextvars.ContextVar`: each thread (and each task)
has its own, so threads sharing one backend never shorten each other's calls.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from redis.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from kvconn_redis._packer import Packer

__all__ = [
    "DeadlineConnection",
    "DeadlinePool",
    "DeadlineSSLConnection",
    "DeadlineUnixConnection",
    "deadline",
]

_DEADLINE: ContextVar[float | None] = ContextVar("kvconn_redis_deadline", default=None)
#: What a connect or a handshake gets once the deadline has passed: fails at once.
_EXPIRED_S = 1e-6
#: How late past the deadline a socket operation may end (see :class:`_DeadlineSocket`).
_SLACK_S = 0.01


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every socket operation inside ends by ``seconds`` from now."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _left() -> float | None:
    """Seconds left in the current call, or None outside a call."""
    end = _DEADLINE.get()
    return None if end is None else end - time.monotonic()


def _clamped(timeout: float | None) -> float | None:
    """``timeout``, shortened to what is left of the call; never raises (see callers)."""
    left = _left()
    if left is None:
        return timeout
    left = max(left, _EXPIRED_S)
    return left if timeout is None or timeout > left else timeout


class _DeadlineSocket:
    """A socket (plain or TLS) whose every read and write ends by the call's deadline.

    redis-py's parsers and connections only call the methods defined here for I/O; all
    else (``fileno`` for ``poll``, ``shutdown``, ``close``…) goes to the real socket.
    ``settimeout`` is remembered as redis-py's wish (e.g. 0 for a readiness check) and
    re-applied, shortened, before each operation.

    Re-applying costs a system call, and a 16 MiB reply takes hundreds of reads: the
    timeout is only set again once :data:`_SLACK_S` has passed since it was last set
    for this deadline, so an operation may end at most that much after the deadline.
    """

    __slots__ = ("_armed_at", "_armed_for", "_sock", "_timeout")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()
        self._armed_for: float | None = None  # the deadline the socket's timeout serves
        self._armed_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def _arm(self) -> None:
        end = _DEADLINE.get()
        if end is None:
            if self._armed_for is not None:
                self._armed_for = None
                self._sock.settimeout(self._timeout)
            return
        now = time.monotonic()
        if end == self._armed_for and now - self._armed_at < _SLACK_S:
            return
        left = end - now
        if left <= 0:
            raise TimeoutError("the call ran out of time (timeout_s)")
        wish = self._timeout
        if wish is not None and wish <= left:
            self._sock.settimeout(wish)
            self._armed_for = None  # redis-py's own, shorter timeout: set it every time
            return
        self._sock.settimeout(left)
        self._armed_for, self._armed_at = end, now

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._armed_for = None
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> int:
        self._arm()
        return self._sock.send(*args)

    def sendall(self, data: Any, *args: Any) -> None:
        # Since Python 3.5 a sendall's timeout bounds the whole send, not each chunk.
        self._arm()
        self._sock.sendall(data, *args)


_PACKER = Packer()


class _DeadlineMixin:
    """Connection behaviour shared by TCP, TLS and Unix-socket connections."""

    _socket_timeout: float | None
    _socket_connect_timeout: float | None

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _PACKER)
        super().__init__(**kwargs)

    #: True while :meth:`_connect` runs: the socket timeout redis-py sets then also
    #: bounds the TLS handshake, so only then is it clamped. Elsewhere redis-py reads
    #: it as the socket's default to restore, which must not keep one call's leftovers.
    _in_connect = False

    @property
    def socket_connect_timeout(self) -> float | None:
        return _clamped(self._socket_connect_timeout)

    @socket_connect_timeout.setter
    def socket_connect_timeout(self, value: float | None) -> None:
        self._socket_connect_timeout = value

    @property
    def socket_timeout(self) -> float | None:
        timeout = self._socket_timeout
        return _clamped(timeout) if self._in_connect else timeout

    @socket_timeout.setter
    def socket_timeout(self, value: float | None) -> None:
        self._socket_timeout = value

    def _connect(self) -> Any:
        self._in_connect = True
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            self._in_connect = False
        sock.settimeout(self._socket_timeout)
        return _DeadlineSocket(sock)


class DeadlineConnection(_DeadlineMixin, Connection):  # type: ignore[misc]
    """TCP."""


class DeadlineSSLConnection(_DeadlineMixin, SSLConnection):  # type: ignore[misc]
    """TLS (``rediss://``)."""


class DeadlineUnixConnection(_DeadlineMixin, UnixDomainSocketConnection):  # type: ignore[misc]
    """Unix domain socket."""


class DeadlinePool(ConnectionPool):  # type: ignore[misc]
    """At most ``max_connections``; a caller finding all busy waits, within its call.

    redis-py's ``ConnectionPool`` raises at once when all are busy, and its
    ``BlockingConnectionPool`` hands out connections outside the lock that a cluster
    client takes to close idle ones, so under load a thread can get a connection
    that another is closing. This waits for a free connection instead and keeps
    every hand-out under redis-py's own lock. In a forked child it never waits on a
    lock the parent's threads held (see :meth:`reset`).
    """

    _RECHECK_S = 0.005  # a release between our failed try and our wait is seen this soon

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._released = threading.Condition()
        self._released_pid = os.getpid()

    def reset(self) -> None:
        # redis-py calls this in a forked child (pid changed) and takes the pool's lock
        # first; a parent thread may have held it at the fork, and no thread will ever
        # release it here. The child's pool starts empty anyway: a new lock is safe.
        pid = getattr(self, "pid", None)
        if pid is not None and pid != os.getpid():
            self._lock = threading.RLock()
        super().reset()

    def _condition(self) -> threading.Condition:
        if self._released_pid != os.getpid():  # a parent thread may have held it at fork
            self._released, self._released_pid = threading.Condition(), os.getpid()
        return self._released

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return super().get_connection(*args, **kwargs)
            except RedisConnectionError as exc:
                if not _pool_full(exc):
                    raise
            left = _left()
            if left is not None and left <= 0:
                raise RedisConnectionError("No connection available.")
            released = self._condition()
            with released:
                released.wait(self._RECHECK_S if left is None else min(left, self._RECHECK_S))

    def release(self, connection: Any) -> None:
        super().release(connection)
        released = self._condition()
        with released:
            released.notify()

    def close_idle(self) -> int:
        """Close the idle connections; how many are still out, in use by a call.

        One hold of the pool's lock for both, so a connection released in between is
        either closed now or counted as out (and closed by a later call).
        """
        with self._lock:  # an RLock: disconnect() takes it too
            self.disconnect(inuse_connections=False)
            return len(self._in_use_connections)


def _pool_full(exc: BaseException) -> bool:
    """redis-py's "all connections in use" (``MaxConnectionsError`` since 6.x)."""
    return type(exc).__name__ == "MaxConnectionsError" or "Too many connections" in str(exc)
