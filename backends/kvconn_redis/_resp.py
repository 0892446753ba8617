"""A small RESP2 pipeline client: the hot path of single-server and cluster mode alike.

Why not redis-py here: a redis-py pipeline copies every value at least twice on a
``get`` (socket → parser buffer → ``bytes`` object) before kvconn copies it a third time
into the caller's buffer, and that cost dominates at KV-page sizes (hundreds of KiB).
This client instead

* sends a whole batch with one ``sendmsg`` of header fragments and the caller's value
  buffers themselves (no copy of values, no join), and
* reads each bulk reply's ``$<len>`` header first, then — only when ``len`` equals the
  caller's buffer size — ``recv_into`` straight into that buffer; a wrong size is
  drained into a scratch buffer and reported as a failure, leaving the buffer untouched.

The pieces are split so that a cluster can reuse them: a :class:`Node` is the pooled
connections to one address, :class:`Commands` writes a batch and reads its replies for
any node, and :func:`run_jobs` sends every node's share of a batch before it reads any
reply, so the nodes of a cluster overlap (:mod:`kvconn_redis._cluster` routes the keys).

Correctness rules that make a hand-written client safe to pool:

* a connection returns to the pool only after *every* reply of its batch was read,
  so the next batch never reads a stale reply;
* anything else — timeout, reset, EOF, a malformed reply, an exception from the caller's
  thread (``KeyboardInterrupt``) — closes the connection: it is never reused in an
  unknown state;
* server error replies (``-ERR …``) are read like any other reply, so a batch with an
  error still leaves the connection clean; they are raised after the batch is drained.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeAlias, TypeVar, cast

from kvconn.errors import BackendError, BackendUnavailable
from kvconn_redis._config import RedisConfig

__all__ = [
    "Commands",
    "ConnectionPool",
    "ErrorReply",
    "HandshakeError",
    "Job",
    "Node",
    "RespClient",
    "RespConnection",
    "encode_command",
    "run_jobs",
]

T = TypeVar("T")

#: How much a refill of the read buffer asks for. Small on purpose: a refill after a
#: value usually also pulls in the start of the *next* value, which then costs a copy
#: out of this buffer; 8 KiB keeps that below 4 % of a 256 KiB page while still holding
#: ~2000 small replies (``:1\r\n``) per ``recv``.
_READ_CHUNK = 8192
_READ_BUFFER = 1 << 16
#: Values at most this big are copied into the header fragments (one iovec instead of
#: three); bigger ones are sent straight from the caller's buffer.
_INLINE_VALUE = 16 * 1024
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_SCAN_COUNT = 1000
#: Most ``:0``/``:1`` replies decoded in one slice (16 KiB of the read buffer).
_FLAG_RUN = 4096

#: Error reply prefixes that mean "try again later", not "this request is wrong".
_TRANSIENT = ("LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")
#: The same, for replies whose code is a plain ``ERR``: sent on accept by a server at
#: its ``maxclients``, and gone once other clients leave.
_TRANSIENT_TEXT = ("max number of clients reached",)
_AUTH = ("NOAUTH", "WRONGPASS", "NOPERM")


def _transient(reply: ErrorReply) -> bool:
    return reply.code in _TRANSIENT or any(t in reply.message for t in _TRANSIENT_TEXT)


class ErrorReply:
    """A ``-…`` reply: returned, not raised, so a pipeline can be drained first."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"ErrorReply({self.message!r})"

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]


Reply: TypeAlias = "bytes | int | ErrorReply | list[Reply] | None"


class ProtocolError(Exception):
    """The server sent something that is not the RESP we expect: drop the connection."""


class HandshakeError(BackendError):
    """The server refused our credentials, database number or mode: a configuration problem."""


def encode_command(*args: bytes) -> bytes:
    """A RESP array of bulk strings (the request format)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def error_for(reply: ErrorReply, op: str, where: str) -> BackendError:
    """The kvconn error for a server error reply; transient ones are 'unavailable'."""
    code = reply.code
    text = f"redis at {where}: {op} failed: {reply.message}"
    if _transient(reply):
        return BackendUnavailable(text)
    if code == "MOVED" or code == "ASK" or reply.message.startswith("CLUSTERDOWN"):
        return BackendError(f"{text} (the server is a cluster node: use cluster=True)")
    if code in _AUTH:
        return HandshakeError(f"{text} (check the username/password options)")
    return BackendError(text)


class RespConnection:
    """One socket, a small read buffer, and the few reads the batched operations need.

    Not thread-safe: the pool hands a connection to one caller at a time.
    """

    def __init__(self, sock: socket.socket, where: str, *, use_sendmsg: bool) -> None:
        self.sock = sock
        self.where = where
        self.pid = os.getpid()
        #: Bytes received since :meth:`begin`; a batch that failed before any reply
        #: arrived on a reused connection may be retried on a fresh one.
        self.received = 0
        self._use_sendmsg = use_sendmsg and hasattr(sock, "sendmsg")
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._scratch: memoryview | None = None

    def begin(self) -> None:
        self.received = 0

    def close(self) -> None:
        # Never shutdown(): after a fork the parent may still use the same socket.
        with contextlib.suppress(OSError):
            self.sock.close()

    # ------------------------------------------------------------------ writing
    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send every part, in order; values travel from the caller's memory as they are."""
        if not self._use_sendmsg:  # TLS sockets have no sendmsg
            for part in parts:
                self.sock.sendall(part)
            return
        views = [memoryview(p) for p in parts]
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + _IOV_MAX])
            while sent:
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    # ------------------------------------------------------------------ reading
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + _READ_CHUNK > _READ_BUFFER:
            # Keep the unread tail, at the front.
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
            if n + _READ_CHUNK > _READ_BUFFER:
                raise ProtocolError(f"a reply line longer than {n} bytes")
        got = self.sock.recv_into(self._view[self._end : self._end + _READ_CHUNK])
        if not got:
            raise ConnectionResetError("the server closed the connection")
        self.received += got
        self._end += got

    def read_line(self) -> bytes:
        """One reply line without its CRLF."""
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start : i])
                self._start = i + 2
                return line
            self._fill()

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` completely: buffered bytes first, then straight from the socket."""
        n = dest.nbytes
        have = min(self._end - self._start, n)
        if have:
            dest[:have] = self._view[self._start : self._start + have]
            self._start += have
        while have < n:
            got = self.sock.recv_into(dest[have:], n - have)
            if not got:
                raise ConnectionResetError("the server closed the connection mid-value")
            self.received += got
            have += got

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (a value nobody asked for at that size)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 16))
        while n:
            chunk = min(n, self._scratch.nbytes)
            self.read_into(self._scratch[:chunk])
            n -= chunk

    def read_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("a bulk string does not end with CRLF")
        self._start += 2

    def read_reply(self) -> Reply:
        """Any RESP2 reply; error replies are returned as :class:`ErrorReply`."""
        line = self.read_line()
        kind, body = line[:1], line[1:]
        if kind == b"+":
            return body
        if kind == b"-":
            return ErrorReply(body.decode("utf-8", "replace"))
        if kind == b":":
            return _int(body)
        if kind == b"$":
            length = _int(body)
            if length < 0:
                return None
            value = bytearray(length)
            self.read_into(memoryview(value))
            self.read_crlf()
            return bytes(value)
        if kind == b"*":
            count = _int(body)
            return None if count < 0 else [self.read_reply() for _ in range(count)]
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def read_flags(self, n: int) -> list[Reply]:
        """``n`` replies of one-key EXISTS/DEL, which are ``:0`` or ``:1`` (4 bytes each).

        Checked and decoded a run at a time with byte slicing instead of reply by reply:
        Python's per-reply overhead, not the server, limits big ``exists`` batches. Any
        other reply (an error) breaks the run and is parsed by :meth:`read_reply`.
        """
        out: list[Reply] = []
        limit = _FLAG_RUN
        while len(out) < n:
            k = min(n - len(out), limit, (self._end - self._start) // 4)
            if k:
                data = self._buf[self._start : self._start + 4 * k]
                flags = data[1::4]
                if (
                    data[0::4] == b":" * k
                    and data[2::4] == b"\r" * k
                    and data[3::4] == b"\n" * k
                    and flags.count(b"0") + flags.count(b"1") == k
                ):
                    out.extend([c == 0x31 for c in flags])  # b"1"
                    self._start += 4 * k
                    limit = _FLAG_RUN
                    continue
                if k > 1:
                    limit = k // 2  # the run holds something else: find where it starts
                    continue
            out.append(self.read_reply())  # also refills the buffer when it is empty
            limit = _FLAG_RUN
        return out

    def read_bulk_into(self, dest: memoryview) -> bool | ErrorReply:
        """A bulk reply into ``dest`` if its length is exactly ``dest``'s; else False.

        The length is checked *before* any byte is written, so a value of the wrong size
        (another layout, a corrupted store) never overwrites part of the caller's buffer.
        """
        line = self.read_line()
        kind, body = line[:1], line[1:]
        if kind == b"$":
            length = _int(body)
            if length < 0:
                return False
            if length != dest.nbytes:
                self.skip(length + 2)
                return False
            self.read_into(dest)
            self.read_crlf()
            return True
        if kind == b"-":
            return ErrorReply(body.decode("utf-8", "replace"))
        raise ProtocolError(f"expected a bulk string, got {line[:40]!r}")


def _int(body: bytes) -> int:
    try:
        return int(body)
    except ValueError:
        raise ProtocolError(f"bad integer in a reply: {body[:40]!r}") from None


class ConnectionPool:
    """Up to ``max_connections`` open connections, handed to one caller at a time.

    A caller that finds them all busy waits up to the operation timeout, then gets
    :class:`BackendUnavailable`, rather than opening connections without bound.
    After ``fork`` the child drops the parent's connections (reading replies meant for
    the parent would corrupt both) and opens its own.
    """

    def __init__(
        self, connect: Callable[[], RespConnection], max_connections: int, wait_s: float, where: str
    ) -> None:
        self._connect = connect
        self._max = max_connections
        self._wait_s = wait_s
        self._where = where
        self._idle: list[RespConnection] = []
        self._open = 0
        self._closed = False
        #: No longer kept: connections still close after use, but none stay idle.
        self._retired = False
        self._pid = os.getpid()
        self._cond = threading.Condition()

    def _after_fork(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        self._open = 0
        self._pid = os.getpid()
        self._cond = threading.Condition()  # the parent's lock may have been held

    def acquire(self) -> tuple[RespConnection, bool]:
        """A connection and whether it was used before (it may have gone stale)."""
        if os.getpid() != self._pid:
            self._after_fork()
        with self._cond:
            deadline = time.monotonic() + self._wait_s
            while True:
                if self._closed:
                    raise BackendError(f"redis at {self._where}: the backend is closed")
                if self._idle:
                    return self._idle.pop(), True
                if self._open < self._max:
                    self._open += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BackendUnavailable(
                        f"redis at {self._where}: all {self._max} connections stayed busy "
                        f"for {self._wait_s:g} s (raise max_connections?)"
                    )
                self._cond.wait(left)
        try:
            return self._connect(), False
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def release(self, conn: RespConnection) -> None:
        """Back to the pool: only for a connection whose every reply was read."""
        if conn.pid != os.getpid():
            return
        with self._cond:
            if self._closed or self._retired:
                self._open -= 1
                conn.close()
            else:
                self._idle.append(conn)
            self._cond.notify()

    def retire(self) -> None:
        """Keep no idle connection from now on: a caller still holding the pool (a
        batch routed by an older slot map) is served, and its connection closed after."""
        if os.getpid() != self._pid:
            self._after_fork()  # the parent's lock may be held by a thread not here
        with self._cond:
            self._retired = True
        self.drop_idle()

    def drop_idle(self) -> None:
        """Close every idle connection: after one was found closed by the server, the
        others that went idle with it most likely were too (a restart, an idle timeout),
        and each would cost a failed try."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()

    def discard(self, conn: RespConnection) -> None:
        """Close a connection in an unknown state; it is never handed out again."""
        conn.close()
        if conn.pid != os.getpid():
            return
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def close(self) -> None:
        if os.getpid() != self._pid:
            self._after_fork()  # the parent's lock may be held by a thread not here
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()


class _Batch:
    """Request bytes for one pipeline: small fragments joined, large values by reference."""

    __slots__ = ("_parts", "_small")

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = []
        self._small: list[bytes | memoryview] = []

    def add(self, data: bytes | memoryview) -> None:
        self._small.append(data)

    def add_value(self, value: memoryview) -> None:
        if value.nbytes <= _INLINE_VALUE:
            self._small.append(value)
            return
        if self._small:
            self._parts.append(b"".join(self._small))
            self._small = []
        self._parts.append(value)

    def parts(self) -> list[bytes | memoryview]:
        if self._small:
            self._parts.append(b"".join(self._small))
            self._small = []
        return self._parts


def _handshake(config: RedisConfig) -> list[bytes]:
    """The commands every new connection sends before it is used: AUTH, SELECT."""
    commands = []
    if config.password is not None:
        user = [config.username.encode()] if config.username is not None else []
        commands.append(encode_command(b"AUTH", *user, config.password.encode()))
    if config.db:
        commands.append(encode_command(b"SELECT", b"%d" % config.db))
    return commands


class Node:
    """Pooled connections to one server, each opened with the deployment's options.

    The single-server client drives one node; the cluster client one per primary, so
    TLS, credentials, timeouts and ``max_connections`` hold for every node alike.
    ``address`` is ``(host, port)``, or None for the configured unix socket.
    """

    def __init__(
        self,
        config: RedisConfig,
        address: tuple[str, int] | None,
        ssl_context: ssl.SSLContext | None,
        where: str,
    ) -> None:
        self.config = config
        self.address = address
        self.where = where
        self._ssl = ssl_context
        handshake = _handshake(config)
        self._handshake = b"".join(handshake)
        self._handshake_count = len(handshake)
        self.pool = ConnectionPool(self._connect, config.max_connections, config.timeout_s, where)

    def __repr__(self) -> str:
        return f"Node({self.where!r})"

    def _open_socket(self) -> socket.socket:
        config = self.config
        if self.address is None:
            assert config.unix_path is not None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(config.connect_timeout_s)
                sock.connect(config.unix_path)
            except BaseException:
                sock.close()
                raise
            return sock
        host, port = self.address
        sock = socket.create_connection((host, port), timeout=config.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                return self._ssl.wrap_socket(sock, server_hostname=host)  # handshakes here
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self) -> RespConnection:
        try:
            sock = self._open_socket()
        except ssl.SSLCertVerificationError as exc:
            # Not a transient failure: the server's certificate is not one we trust.
            raise HandshakeError(
                f"redis at {self.where}: the server's TLS certificate is not trusted "
                f"({exc.verify_message}); check tls_ca_file / tls_verify"
            ) from exc
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise BackendUnavailable(
                f"redis at {self.where}: cannot connect: {_describe(exc)}"
            ) from exc
        sock.settimeout(self.config.timeout_s)
        conn = RespConnection(sock, self.where, use_sendmsg=self._ssl is None)
        if not self._handshake_count:
            return conn
        try:
            conn.send([self._handshake])
            replies = [conn.read_reply() for _ in range(self._handshake_count)]
        except (OSError, ProtocolError) as exc:
            conn.close()
            raise BackendUnavailable(
                f"redis at {self.where}: connection setup failed: {_describe(exc)}"
            ) from exc
        except BaseException:
            conn.close()
            raise
        for reply in replies:
            if isinstance(reply, ErrorReply):
                conn.close()
                message = reply.message
                if _transient(reply):  # a full or loading server: it may answer later
                    raise BackendUnavailable(
                        f"redis at {self.where}: connection setup failed: {message}"
                    )
                if "AUTH" in message.upper() or reply.code in _AUTH:
                    raise HandshakeError(
                        f"redis at {self.where} refused the credentials ({message}); "
                        "check the username/password options"
                    )
                raise HandshakeError(
                    f"redis at {self.where} refused the connection setup: {message}"
                )
        return conn

    def run(
        self,
        op: str,
        parts: Sequence[bytes | memoryview],
        read: Callable[[RespConnection], T],
        *,
        retry: bool = True,
    ) -> T:
        """One batch on one connection: send it, read every reply."""
        job = Job(self, op, parts, read, retry=retry)
        run_jobs([job])
        return job.value()

    def close(self) -> None:
        self.pool.close()

    def retire(self) -> None:
        """The node left the slot map: close its idle connections, keep none later."""
        self.pool.retire()


_UNSET = object()


class Job(Generic[T]):
    """One node's share of a batch: its request, how to read its replies, what came back.

    ``retry``: a pooled connection may have been closed by the server while idle (a
    restart, an idle timeout); when such a connection fails before any reply byte came
    back, an idempotent batch is sent once more on a fresh connection, so a server that
    came back is not reported as down.
    """

    __slots__ = ("_again", "_result", "error", "node", "op", "parts", "read", "retry")

    def __init__(
        self,
        node: Node,
        op: str,
        parts: Sequence[bytes | memoryview],
        read: Callable[[RespConnection], T],
        *,
        retry: bool = True,
    ) -> None:
        self.node = node
        self.op = op
        self.parts = parts
        self.read = read
        self.retry = retry
        self.error: BackendError | None = None
        self._result: object = _UNSET
        self._again = False

    def value(self) -> T:
        """The replies, or the error that kept them from arriving."""
        if self.error is not None:
            raise self.error
        if self._result is _UNSET:
            raise AssertionError(f"{self.op} on {self.node.where} was never run")
        return cast(T, self._result)

    def _failed(self, conn: RespConnection, reused: bool, exc: OSError | ProtocolError) -> None:
        """The connection is in an unknown state: drop it, then plan a retry or keep the error."""
        pool = self.node.pool
        pool.discard(conn)
        where, op = self.node.where, self.op
        error: BackendError
        if isinstance(exc, TimeoutError):
            error = BackendUnavailable(
                f"redis at {where}: {op} timed out after {self.node.config.timeout_s:g} s"
            )
        elif self.retry and reused and conn.received == 0:
            pool.drop_idle()  # the others went idle at the same time: likely closed too
            self._again = True
            return
        elif isinstance(exc, ProtocolError):
            error = BackendError(f"redis at {where}: {op} failed: {_describe(exc)}")
        else:
            error = BackendUnavailable(f"redis at {where}: {op} failed: {_describe(exc)}")
        error.__cause__ = exc
        self.error = error


def run_jobs(jobs: Sequence[Job[Any]]) -> None:
    """Send every job's request, then read every job's replies; outcomes stay in the jobs.

    Each job has its own node's connection, so the nodes work on their shares at the
    same time: one overlapping round trip per node, not one node after another. Jobs
    must name distinct nodes, in an order every caller shares (sorted by address): a
    thread keeps its earlier nodes' connections while it waits for a busy pool, and the
    shared order keeps two threads from each waiting for what the other holds. For the
    same reason a retry (see :class:`Job`) runs only after every connection went back.
    """
    held: dict[int, tuple[RespConnection, bool]] = {}
    try:
        for i, job in enumerate(jobs):
            try:
                conn, reused = job.node.pool.acquire()
            except BackendError as exc:  # cannot connect, credentials refused, closed
                job.error = exc
                continue
            held[i] = conn, reused
            conn.begin()
            try:
                conn.send(job.parts)
            except (OSError, ProtocolError) as exc:
                del held[i]
                job._failed(conn, reused, exc)
        for i in list(held):
            conn, reused = held[i]
            job = jobs[i]
            try:
                result = job.read(conn)
            except (OSError, ProtocolError) as exc:
                del held[i]
                job._failed(conn, reused, exc)
                continue
            del held[i]
            job.node.pool.release(conn)  # every reply was read: the connection is clean
            job._result = result
    except BaseException:
        # Anything else (KeyboardInterrupt, a bug) leaves replies unread: never reuse.
        for i, (conn, _) in held.items():
            jobs[i].node.pool.discard(conn)
        raise
    again = [job for job in jobs if job._again]
    for job in again:
        job._again = False
        job.retry = False
    if again:
        run_jobs(again)


_ASKING = encode_command(b"ASKING")


class Commands:
    """How each batched operation is written, and its replies read, for any one node.

    Shared by the single-server and the cluster client. ``asking`` (cluster only) marks
    the keys to send with ``ASKING`` first: their slot is being imported by that node.
    """

    def __init__(self, config: RedisConfig) -> None:
        self.prefix = config.key_prefix.encode("ascii")
        if config.ttl_ms is not None:
            self._set_tail = b"\r\n$2\r\nNX\r\n$2\r\nPX\r\n" + _bulk(b"%d" % config.ttl_ms)
            self._set_argc = 6
        else:
            self._set_tail = b"\r\n$2\r\nNX\r\n"
            self._set_argc = 4

    def key(self, key: str) -> bytes:
        return self.prefix + key.encode("ascii")

    def one_key(
        self, command: bytes, keys: Sequence[str], asking: Sequence[bool] | None = None
    ) -> bytes:
        """``command key`` per key (EXISTS, GET, DEL), as one request."""
        head = b"*2\r\n$%d\r\n%s\r\n" % (len(command), command)
        prefix = self.prefix
        asks = itertools.repeat(False) if asking is None else asking
        return b"".join(
            [
                b"%s%s$%d\r\n%s%s\r\n"
                % (_ASKING if ask else b"", head, len(prefix) + len(k), prefix, k.encode())
                for k, ask in zip(keys, asks)
            ]
        )

    def sets(
        self,
        keys: Sequence[str],
        values: Sequence[memoryview],
        asking: Sequence[bool] | None = None,
    ) -> list[bytes | memoryview]:
        """``SET key value NX [PX ttl]`` per key; big values go out from the caller's memory."""
        batch = _Batch()
        head = b"*%d\r\n$3\r\nSET\r\n" % self._set_argc
        for n, (key, value) in enumerate(zip(keys, values)):
            ask = _ASKING if asking is not None and asking[n] else b""
            batch.add(ask + head + _bulk(self.key(key)) + b"$%d\r\n" % value.nbytes)
            batch.add_value(value)
            batch.add(self._set_tail)
        return batch.parts()

    @staticmethod
    def read_flags(
        n: int, asking: Sequence[bool] | None = None
    ) -> Callable[[RespConnection], list[Reply]]:
        """Replies of one-key EXISTS/DEL; the fast run decoder unless ASKING replies interleave."""
        if asking is None:
            return lambda conn: conn.read_flags(n)
        return Commands.read_replies(n, asking)

    @staticmethod
    def read_replies(
        n: int, asking: Sequence[bool] | None = None
    ) -> Callable[[RespConnection], list[Reply]]:
        def read(conn: RespConnection) -> list[Reply]:
            if asking is None:
                return [conn.read_reply() for _ in range(n)]
            out = []
            for ask in asking:
                if ask:
                    conn.read_reply()  # ASKING's +OK; a refusal shows in the next reply
                out.append(conn.read_reply())
            return out

        return read

    @staticmethod
    def read_values(
        buffers: Sequence[memoryview], asking: Sequence[bool] | None = None
    ) -> Callable[[RespConnection], list[bool | ErrorReply]]:
        """GET replies, each straight into its buffer when the size matches."""

        def read(conn: RespConnection) -> list[bool | ErrorReply]:
            if asking is None:
                return [conn.read_bulk_into(buf) for buf in buffers]
            out = []
            for buf, ask in zip(buffers, asking):
                if ask:
                    conn.read_reply()
                out.append(conn.read_bulk_into(buf))
            return out

        return read


def flag(reply: Reply, op: str, where: str) -> bool:
    """An EXISTS/DEL reply as a boolean; an error reply raises."""
    if isinstance(reply, int):  # bool is an int: the fast path's answers
        return reply > 0
    if isinstance(reply, ErrorReply):
        raise error_for(reply, op, where)
    raise BackendError(f"redis at {where}: {op} answered {reply!r}")


def stored(reply: Reply, op: str, where: str) -> bool:
    """A ``SET … NX`` reply as the put's per-key success.

    ``OOM`` (the server is full and may not evict) is that key's failure, not an error
    of the store: the page simply was not saved, like any dropped save.
    """
    if isinstance(reply, ErrorReply):
        if reply.code == "OOM":
            return False
        raise error_for(reply, op, where)
    return True  # +OK: stored; nil: already present, left untouched


def filled(result: bool | ErrorReply, op: str, where: str) -> bool:
    """A GET's outcome: True when the buffer was filled; an error reply raises."""
    if isinstance(result, ErrorReply):
        raise error_for(result, op, where)
    return result


def scan_node(
    node: Node, key_prefix: bytes, prefix: str, seen: set[bytes]
) -> Iterator[tuple[str, int]]:
    """Keys under ``prefix`` on one server with their sizes; SCAN + STRLEN, a batch per page.

    ``seen`` spans calls: SCAN may return a key more than once, and a cluster slot being
    migrated may show a key on two nodes.
    """
    pattern = glob_escape(key_prefix + prefix.encode("ascii")) + b"*"
    cursor = b"0"
    while True:
        reply = node.run(
            "list",
            [encode_command(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"%d" % _SCAN_COUNT)],
            lambda c: c.read_reply(),
        )
        if isinstance(reply, ErrorReply):
            raise error_for(reply, "list", node.where)
        if not (
            isinstance(reply, list)
            and len(reply) == 2
            and isinstance(reply[0], bytes)
            and isinstance(reply[1], list)
        ):
            raise BackendError(f"redis at {node.where}: SCAN answered {reply!r}")
        cursor = reply[0]
        found = [k for k in reply[1] if isinstance(k, bytes) and k not in seen]
        seen.update(found)
        if found:
            payload = b"".join(b"*2\r\n$6\r\nSTRLEN\r\n" + _bulk(k) for k in found)
            sizes = node.run("list", [payload], Commands.read_replies(len(found)))
            for key, size in zip(found, sizes):
                if isinstance(size, ErrorReply):
                    continue  # not a string: not one of our pages
                if isinstance(size, int) and size > 0:  # 0: deleted since SCAN
                    yield key[len(key_prefix) :].decode("ascii"), size
        if cursor == b"0":
            return


class RespClient:
    """Batched exists/put/get/delete/scan against one Redis server: one round trip each."""

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.where = config.where
        address = None if config.unix_path is not None else config.nodes[0]
        ssl_context = config.ssl_context() if config.tls else None
        self._node = Node(config, address, ssl_context, config.where)
        self._commands = Commands(config)

    def ping(self) -> None:
        reply = self._node.run("ping", [encode_command(b"PING")], lambda c: c.read_reply())
        if isinstance(reply, ErrorReply):
            raise error_for(reply, "ping", self.where)

    def close(self) -> None:
        self._node.close()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        payload = self._commands.one_key(b"EXISTS", keys)
        replies = self._node.run("exists", [payload], Commands.read_flags(len(keys)))
        return [flag(reply, "exists", self.where) for reply in replies]

    def delete(self, keys: Sequence[str]) -> list[bool]:
        payload = self._commands.one_key(b"DEL", keys)
        # Not retried: a DEL that ran before the connection broke would then answer 0.
        replies = self._node.run("delete", [payload], Commands.read_flags(len(keys)), retry=False)
        return [flag(reply, "delete", self.where) for reply in replies]

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        """``SET key value NX [PX ttl]`` per key: the first writer wins; present is success."""
        parts = self._commands.sets(keys, values)
        replies = self._node.run("put", parts, Commands.read_replies(len(keys)))
        return [stored(reply, "put", self.where) for reply in replies]

    def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """``GET`` per key, each value read straight into its buffer after a size check.

        If this raises, any buffer of the batch may hold part of a value: the caller must
        treat all of them as unfilled (the connector fails the whole load).
        """
        payload = self._commands.one_key(b"GET", keys)
        results = self._node.run("get", [payload], Commands.read_values(buffers))
        return [filled(result, "get", self.where) for result in results]

    def scan(self, prefix: str) -> Iterator[tuple[str, int]]:
        """Keys under ``prefix`` with their sizes."""
        return scan_node(self._node, self._commands.prefix, prefix, set())


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def glob_escape(data: bytes) -> bytes:
    """Escape Redis glob metacharacters, so a key prefix matches only itself."""
    out = bytearray()
    for byte in data:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
