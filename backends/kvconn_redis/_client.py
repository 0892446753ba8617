"""The batched operations on redis-py: one server (``Redis``) or a cluster (``RedisCluster``).

Every batch is one pipeline (``transaction=False``): one round trip to a server, or one
per node in a cluster, where redis-py writes every node's share before it reads any
reply and follows ``MOVED``/``ASK`` itself. Pipelines read every reply even when some
are errors, so a connection always goes back to its pool in step; redis-py drops a
connection that failed mid-batch (a timeout, a reset) instead of reusing it.

* ``put`` — ``SET key value NX [PX ttl]`` per key: content-addressed keys make "first
  writer wins" right; a key already present answers nil, which is success. ``OOM`` (the
  server is full and may not evict) fails only that key: a dropped save.
* ``lend`` — one ``MGET`` on a server, read off the socket into a reused
  reply buffer (:mod:`kvconn_redis._reply`); ``GET`` per key in a cluster, whose
  ``MGET`` needs one slot, as redis-py parses them (``fetch``). The backend lends the
  values (``borrow``).
* ``read`` — ``lend``, then each value is checked against its buffer's size and copied
  into it once. A value of another size, or a key that holds no string, fails and its buffer
  stays untouched. Asked why (``explain``), a key that did not load is ``MISSING`` or
  ``WRONG_SIZE`` (stored but unreadable: the connector deletes it). ``MGET`` answers nil
  both for an absent key and for one holding a list or a hash, so on a server the nil
  keys are asked about with ``EXISTS`` (a second round trip, only for a batch with
  misses); a cluster's ``GET`` says ``WRONGTYPE`` itself.
* ``exists`` — ``EXISTS`` per key. Any error reply raises: "could not ask" is never
  "absent".

Values of 64 KiB or more go out as the caller's memoryviews, without a join or a copy
(:mod:`kvconn_redis._packer`). Replies come in through a 1 MiB read buffer per
connection (``_READ_SIZE``).
"""

from __future__ import annotations

import contextlib
import inspect
import mmap
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, cast

import redis
from redis import exceptions as rx
from redis._parsers import BaseParser
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from kvconn.backend import ReadStatus
from kvconn.errors import BackendError, ConfigError
from kvconn_redis._config import RedisConfig
from kvconn_redis._deadline import (
    DeadlineConnection,
    DeadlinePool,
    DeadlineSSLConnection,
    DeadlineUnixConnection,
)
from kvconn_redis._errors import error_code, reply_error
from kvconn_redis._reply import ProtocolError, Reply, ReplyBuffers, ReplyError, read_mget

__all__ = ["CLIENT_ERRORS", "Client", "ClusterClient", "ServerClient", "make_client"]

#: What redis-py raises when a call fails (``RedisClusterException`` is no
#: ``RedisError``; a socket error may escape a few of its paths unwrapped).
CLIENT_ERRORS = (rx.RedisError, rx.RedisClusterException, OSError)

_SCAN_COUNT = 1000
#: redis-py 8.2 runs a re-read of the slot map that an error asked for (a failed node,
#: a run of ``MOVED``) at most once a second by default, on a later command. A store
#: call has one attempt within its deadline, and the next call should route by the new
#: map, as with earlier releases, which re-read at once: so no minimum interval.
_REFRESH_AT_ONCE: dict[str, Any] = (
    {"topology_refresh_min_interval": 0}
    if "topology_refresh_min_interval" in inspect.signature(RedisCluster.__init__).parameters
    else {}
)
#: Bytes a connection asks of its socket per read (redis-py's ``socket_read_size``;
#: 64 KiB by default). Each read lets the GIL go and must win it back, and in an
#: engine's process the thread that holds it meanwhile may keep it for a while: a
#: 47 MiB load from a local server took 1.5-1.7x as long beside a busy Python thread as
#: alone with 64 KiB reads, 1.3-1.4x with 1 MiB ones (``benchmarks/bench_load.py
#: --backend redis --contend``). The cost is the buffer, once per pooled connection.
_READ_SIZE = 1 << 20


class _NotAString:
    """``fetch``'s answer for a key that holds something other than a string."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_A_STRING"


#: A key stored as a list, a hash, ...: stored, but no page can ever be read from it.
NOT_A_STRING = _NotAString()
#: A key's answer to ``fetch``: its value, ``NOT_A_STRING``, or ``None`` (absent).
Fetched = bytes | _NotAString | None


class Lent:
    """Read-only views of one batch's values (None: absent; empty: :data:`NOT_A_STRING`),
    valid until :meth:`release`, which returns their memory for reuse unless a view is
    still held somewhere (then that memory is simply never reused)."""

    __slots__ = ("_base", "_buffer", "_buffers", "views")

    def __init__(
        self,
        views: list[memoryview | None],
        base: memoryview | None = None,
        buffers: ReplyBuffers | None = None,
        buffer: mmap.mmap | None = None,
    ) -> None:
        self.views = views
        self._base, self._buffers, self._buffer = base, buffers, buffer

    def release(self) -> None:
        for view in self.views:
            if view is not None:
                with contextlib.suppress(BufferError):  # exported: checked below
                    view.release()
        if self._base is not None:
            with contextlib.suppress(BufferError):
                self._base.release()
        buffer, self._buffer = self._buffer, None
        if self._buffers is not None and buffer is not None and _unexported(buffer):
            self._buffers.give(buffer)


def _unexported(buffer: mmap.mmap) -> bool:
    """Whether no view of ``buffer`` is alive (a slice the borrower made of a lent view
    keeps it exported, unseen by the views above). A resize is refused while one is; a
    resize to its own size changes nothing."""
    try:
        buffer.resize(len(buffer))
    except BufferError:
        return False
    return True


def _views_of(values: Sequence[Fetched]) -> list[memoryview | None]:
    return [
        None if value is None else memoryview(value if isinstance(value, bytes) else b"")
        for value in values
    ]


#: Bytes every key of ours is made of (printable ASCII, no space): anything else in a
#: listing was written by another program and is skipped, never decoded blindly.
_KEY_BYTES = bytes(range(0x21, 0x7F))


class Client(Protocol):
    """What the backend needs from either mode."""

    def check_access(self, key_prefix: str = "") -> None: ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]: ...

    def lend(self, keys: Sequence[str], explain: bool) -> Lent: ...

    def read(
        self, keys: Sequence[str], buffers: Sequence[memoryview], explain: bool
    ) -> list[ReadStatus]: ...

    def delete(self, keys: Sequence[str]) -> list[bool]: ...

    def scan(self, prefix: str) -> Iterator[list[tuple[str, int]]]: ...

    def close(self) -> None: ...


def _connection_options(config: RedisConfig) -> dict[str, Any]:
    """What every connection gets, in either mode (redis-py keyword arguments)."""
    options: dict[str, Any] = {
        "username": config.username,
        "password": config.password,
        # RESP2: plain strings and integers are all these commands exchange; it needs
        # no HELLO round trip, and redis-py's RESP3 default also turns on maintenance
        # notifications, which skip the pool's check for unread replies.
        "protocol": 2,
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "max_connections": config.max_connections,
        "socket_read_size": _READ_SIZE,
    }
    if config.unix_path is None:
        options["socket_keepalive"] = True
    if config.tls:
        options.update(
            ssl_ca_certs=config.tls_ca_file,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
            ssl_cert_reqs="required" if config.tls_verify else "none",
            ssl_check_hostname=config.tls_verify,
        )
    return options


def _connection_class(config: RedisConfig) -> type[redis.connection.AbstractConnection]:
    if config.unix_path is not None:
        return DeadlineUnixConnection
    return DeadlineSSLConnection if config.tls else DeadlineConnection


class _Commands:
    """Building a batch and reading its replies: the same in both modes."""

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self._set_tail: tuple[Any, ...] = ("NX",)
        if config.ttl_ms is not None:
            self._set_tail = ("NX", "PX", config.ttl_ms)

    def _pipeline(self) -> Any:
        raise NotImplementedError

    def _order(self, keys: Sequence[str]) -> list[int] | None:
        """The order to queue a batch in (None: as given); see :class:`ClusterClient`."""
        return None

    def _after_batch(self, pipe: Any) -> None:
        """Housekeeping once ``pipe``'s batch is done; see :class:`ClusterClient`."""

    def _run(self, command: str, keys: Sequence[str], values: Sequence[Any] = ()) -> list[Any]:
        """``command key [value] *tail`` per key as one pipeline; replies in ``keys`` order."""
        pipe = self._pipeline()
        prefix = self.prefix
        order = self._order(keys)
        queue = pipe.execute_command
        if values:
            tail = self._set_tail
            for i in order if order is not None else range(len(keys)):
                queue(command, prefix + keys[i], values[i], *tail)
        else:
            for i in order if order is not None else range(len(keys)):
                queue(command, prefix + keys[i])
        replies = list(pipe.execute(raise_on_error=False))
        self._after_batch(pipe)
        if order is None:
            return replies
        out: list[Any] = [None] * len(keys)
        for i, reply in zip(order, replies):
            out[i] = reply
        return out

    def _flags(self, op: str, command: str, keys: Sequence[str]) -> list[bool]:
        replies = self._run(command, keys)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply_error(reply, self.config, op)
        return [reply > 0 for reply in replies]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._flags("exists", "EXISTS", keys)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self._flags("delete", "DEL", keys)

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        replies = self._run("SET", keys, values)
        out = []
        for reply in replies:
            if isinstance(reply, Exception):
                if isinstance(reply, rx.OutOfMemoryError):
                    out.append(False)  # not saved: a dropped save, not a broken store
                    continue
                raise reply_error(reply, self.config, "put")
            out.append(True)  # OK: stored; nil: already present, left untouched
        return out

    def fetch(self, keys: Sequence[str], explain: bool) -> list[Fetched]:
        """Each key's value, ``None`` when absent, or :data:`NOT_A_STRING`; errors raise.

        A server answers every key it was asked about, so a key with no value is either
        absent or stored as something no buffer can take: never "stored but
        unreachable" (a connection failure raises for the whole call). ``explain``: tell
        those two apart where the server's answer does not (``MGET``; see
        :meth:`ServerClient.lend`, which reads replies itself unless told not to).
        """
        raise NotImplementedError

    def lend(self, keys: Sequence[str], explain: bool) -> Lent:
        """:meth:`fetch`'s values as views, for the caller to read in place and release.

        Here the values are ``bytes`` made for this call; :class:`ServerClient` reads
        them into a reused buffer instead.
        """
        return Lent(_views_of(self.fetch(keys, explain)))

    def read(
        self, keys: Sequence[str], buffers: Sequence[memoryview], explain: bool
    ) -> list[ReadStatus]:
        """Copy each value into its buffer when the sizes match; see :meth:`fetch`."""
        out = []
        lent = self.lend(keys, explain)
        try:
            for view, buffer in zip(lent.views, buffers):
                if view is None:
                    out.append(ReadStatus.MISSING)
                elif view.nbytes == buffer.nbytes:  # NOT_A_STRING is lent empty
                    buffer[:] = view
                    out.append(ReadStatus.LOADED)
                else:  # another size, or not a string
                    out.append(ReadStatus.WRONG_SIZE)
        finally:
            lent.release()
        return out

    def _probe_key(self, key_prefix: str) -> str:
        # A space cannot occur in kvconn's keys, so no page can ever be this key.
        return f"{self.prefix}{key_prefix}kvconn access probe {os.urandom(8).hex()}"

    def _probe(self, pipe: Any, key_prefix: str) -> None:
        """Ask, without changing anything, whether this user may write and read our keys.

        ``SET key "" XX`` on an absent key writes nothing, yet the server checks it
        against the user's ACL exactly like the puts to come (command *and* key). A
        user's own ``ACL DRYRUN`` would say the same but is an admin command that
        application users are rarely granted, so it cannot be the probe. ``key_prefix``
        is what every key of the caller starts with after the ``key_prefix`` option (a
        connector's ``{namespace}/{model}/``), so key patterns are checked on a key of
        the same shape as the real ones.
        """
        key = self._probe_key(key_prefix)
        pipe.execute_command("SET", key, "", "XX")
        pipe.execute_command("GET", key)
        pipe.execute_command("EXISTS", key)

    def _check_probe(self, replies: Sequence[Any], key_prefix: str) -> None:
        user = self.config.username or "default"
        for command, reply in zip(("SET", "GET", "EXISTS"), replies):
            if not isinstance(reply, Exception):
                continue
            code = error_code(reply)
            if code == "NOPERM":
                keys = "key" in str(reply)
                if keys and not (self.prefix or key_prefix):
                    # The user is confined to some keys; with no prefix at all nothing
                    # says which keys the backend will use, so nothing can be concluded.
                    continue
                what, fix = f"the {command} command", "grant it"
                if keys:
                    what = f"keys under key_prefix {self.prefix!r}"
                    if key_prefix:
                        what = (
                            f"keys under {self.prefix + key_prefix!r} (key_prefix "
                            f"{self.prefix!r}, then kvconn's namespace and model {key_prefix!r})"
                        )
                    fix = "make its key patterns (ACL SETUSER … ~<pattern>) match them"
                raise ConfigError(
                    f"redis at {self.config.where}: the ACL user {user!r} has no "
                    f"permission for {what}, which the backend needs "
                    f"(server said: NOPERM {reply}); {fix} or use another user"
                )
            if code == "READONLY":
                raise ConfigError(
                    f"redis at {self.config.where} is a read-only replica ({reply}); "
                    "point the backend at a primary"
                )
            if isinstance(reply, (rx.ConnectionError, rx.TimeoutError, rx.ClusterError)):
                raise reply
            # OOM and the like say nothing about permissions: the probe has no verdict.


def _page_keys(found: Sequence[bytes], key_prefix: bytes, seen: set[bytes]) -> list[bytes]:
    """Keys of a SCAN page that are new and could be kvconn's; foreign bytes are skipped."""
    out = []
    for key in found:
        if key in seen or not key.startswith(key_prefix):
            continue
        seen.add(key)
        rest = key[len(key_prefix) :]
        if rest and not rest.translate(None, _KEY_BYTES):
            out.append(key)
    return out


class ServerClient(_Commands):
    """One server: a ``Redis`` client over a blocking pool of deadline-aware connections."""

    def __init__(self, config: RedisConfig) -> None:
        super().__init__(config)
        options = _connection_options(config)
        if config.unix_path is not None:
            options["path"] = config.unix_path
        else:
            options["host"], options["port"] = config.nodes[0]
        self._pool = DeadlinePool(  # type: ignore[no-untyped-call]
            connection_class=_connection_class(config),
            db=config.db,
            **options,
        )
        self._redis = redis.Redis(connection_pool=self._pool)
        self._buffers = ReplyBuffers()

    def _pipeline(self) -> Any:
        return self._redis.pipeline(transaction=False)

    def check_access(self, key_prefix: str = "") -> None:
        """Connect once; refuse a cluster node, and a user who may not read or write."""
        pipe = self._pipeline()
        pipe.execute_command("INFO", "cluster")
        self._probe(pipe, key_prefix)
        info, *probe = pipe.execute(raise_on_error=False)
        if isinstance(info, (rx.ConnectionError, rx.TimeoutError)):
            raise info
        if isinstance(info, dict) and info.get("cluster_enabled") == 1:
            raise ConfigError(
                f"redis at {self.config.where} is a Redis Cluster node: use "
                "cluster=True (or a redis+cluster:// URL)"
            )
        self._check_probe(probe, key_prefix)

    def lend(self, keys: Sequence[str], explain: bool) -> Lent:
        """One ``MGET`` read off the socket into a reused reply buffer
        (:mod:`kvconn_redis._reply`), its values lent where they landed.

        One attempt per connection error as redis-py's own commands get (its
        ``retry``: a pooled connection the server closed since is replaced), all within
        the call's deadline; after any error mid-reply the connection is dropped.
        """
        if not self.config.reuse_reply_buffers:
            return super().lend(keys, explain)
        names = [self.prefix + key for key in keys]
        conn = self._pool.get_connection()
        try:
            reply = conn.retry.call_with_retry(
                lambda: self._mget(conn, names), lambda _error: conn.disconnect()
            )
        except rx.ResponseError as exc:  # the whole reply was read: the connection is fine
            raise reply_error(exc, self.config, "get") from exc
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)
        base = memoryview(reply.buffer).toreadonly()
        views: list[memoryview | None] = [
            None if span is None else base[span[0] : span[0] + span[1]] for span in reply.spans
        ]
        lent = Lent(views, base, self._buffers, reply.buffer)
        nil = [i for i, view in enumerate(views) if view is None] if explain else []
        if nil:
            # MGET's nil is also its answer for a key holding a list or a hash: such a
            # key is stored and can never load. (A key stored between the two round
            # trips reads as unreadable too, and is deleted: one more miss, never a
            # wrong byte, as in the connector's own check.)
            try:
                there = self.exists([keys[i] for i in nil])
            except BaseException:
                lent.release()  # the caller never sees it: the buffer goes back now
                raise
            for i, stored in zip(nil, there):
                if stored:
                    views[i] = base[0:0]
        return lent

    def _mget(self, conn: Any, names: list[str]) -> Reply:
        """Send ``MGET`` and read its reply; redis-py's errors for what goes wrong."""
        conn.send_command("MGET", *names)
        buffer = self._buffers.take()
        try:
            try:
                return read_mget(conn._sock, len(names), buffer)
            except BaseException:
                self._buffers.give(buffer)  # no view of it was made
                raise
        except ReplyError as exc:
            raise BaseParser.parse_error(str(exc)) from None  # type: ignore[no-untyped-call]
        except TimeoutError as exc:  # the socket's timeout or the call's deadline
            raise rx.TimeoutError(f"Timeout reading from {self.config.where}") from exc
        except (OSError, ProtocolError) as exc:
            raise rx.ConnectionError(f"Error reading from {self.config.where}: {exc}") from exc

    def fetch(self, keys: Sequence[str], explain: bool) -> list[Fetched]:
        """The values as redis-py parses them (``reuse_reply_buffers = False``)."""
        prefix = self.prefix
        try:
            values: list[Fetched] = self._redis.execute_command(  # type: ignore[no-untyped-call]
                "MGET", *[prefix + key for key in keys]
            )
        except rx.ResponseError as exc:
            raise reply_error(exc, self.config, "get") from exc
        nil = [i for i, value in enumerate(values) if value is None] if explain else []
        if nil:  # see lend
            for i, there in zip(nil, self.exists([keys[i] for i in nil])):
                if there:
                    values[i] = NOT_A_STRING
        return values

    def scan(self, prefix: str) -> Iterator[list[tuple[str, int]]]:
        return _scan(self, self._redis, prefix, set())

    def close(self) -> None:
        self._pool.disconnect()


def _scan(
    commands: _Commands, node: redis.Redis, prefix: str, seen: set[bytes]
) -> Iterator[list[tuple[str, int]]]:
    """SCAN one server for keys under ``prefix``, a page at a time, with their sizes.

    ``seen`` spans calls: SCAN may return a key twice, and a cluster slot in migration
    may show it on two nodes. STRLEN goes through ``commands``' pipeline (the cluster's,
    so a key moved meanwhile is still found).
    """
    key_prefix = commands.prefix.encode("ascii")
    pattern = _glob_escape(key_prefix + prefix.encode("ascii")) + b"*"
    cursor: int = 0
    while True:
        cursor, found = node.scan(cursor=cursor, match=pattern, count=_SCAN_COUNT)
        keys = _page_keys(cast("list[bytes]", found), key_prefix, seen)
        if keys:
            pipe = commands._pipeline()
            for key in keys:
                pipe.execute_command("STRLEN", key)
            sizes = pipe.execute(raise_on_error=False)
            yield [
                (key[len(key_prefix) :].decode("ascii"), size)
                for key, size in zip(keys, sizes)
                # An error: not a string, not a page. 0: deleted since SCAN.
                if isinstance(size, int) and size > 0
            ]
        if not cursor:
            return


def _glob_escape(data: bytes) -> bytes:
    """Escape Redis glob metacharacters, so a key prefix matches only itself."""
    out = bytearray()
    for byte in data:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


class ClusterClient(_Commands):
    """A Redis Cluster through redis-py's ``RedisCluster``, made when first reachable.

    ``RedisCluster`` reads the slot map as it is constructed, so a cluster that is down
    when the backend starts would fail start-up; instead the client is made at the first
    call that reaches the cluster, and until then every call is unavailable.
    """

    def __init__(self, config: RedisConfig) -> None:
        super().__init__(config)
        self._cluster: RedisCluster | None = None
        self._closed = False
        self._lock = threading.Lock()  # making the client, and closing it
        self._pid = os.getpid()
        #: Every node pool redis-py made for this client (it makes them through
        #: _new_pool), redis-py's node table as a batch last saw it, and the pools no
        #: table uses any more that still had a connection out; under _seen_lock.
        self._pools: weakref.WeakSet[DeadlinePool] = weakref.WeakSet()
        self._nodes_seen: dict[str, Any] = {}
        self._retired: set[DeadlinePool] = set()
        self._moved_seen = 0  # redis-py's count of MOVED answers since its last re-read
        self._seen_lock = threading.Lock()

    def _new_pool(self, **kwargs: Any) -> DeadlinePool:
        """redis-py's ``connection_pool_class``: every node pool, remembered (weakly)."""
        pool = DeadlinePool(**kwargs)
        with self._seen_lock:
            self._pools.add(pool)
        return pool

    def _after_batch(self, pipe: Any) -> None:
        """Close the connections of pools no node table uses any more, once idle.

        redis-py replaces its node table when it re-reads the map (after ``MOVED``, or a
        node failure) and just drops the nodes that left, whose pools keep their sockets
        open until garbage collection gets to them. With several threads, two things
        make that worse: another thread's batch, routed by an older table, may still
        have a connection to a departed node out when this one sees the new table, and
        redis-py may install and replace a table between two batches' looks (a re-read
        from a node that had not yet heard of a slot's move brings a node back, as a new
        object with a new pool, until the next re-read drops it again). So each time
        the table changed, every pool redis-py made for this client that the current
        table does not use is retired, and every later batch closes what has come back
        to a retired pool until nothing is out. The common case, nothing changed, takes
        no lock.
        """
        cluster = self._cluster
        if cluster is None:
            return
        manager = cluster.nodes_manager
        moved = getattr(cluster, "reinitialize_counter", 0)
        # redis-py 8.2 and later follow a MOVED inside the pipeline and count it there
        # (a new pipeline's count starts at 0), not on the client as before.
        moved_here = getattr(pipe, "reinitialize_counter", 0)
        if (
            not moved_here
            and manager.nodes_cache is self._nodes_seen
            and moved == self._moved_seen
            and not self._retired
        ):
            return
        with self._seen_lock:
            nodes = manager.nodes_cache
            if moved_here or nodes is not self._nodes_seen or moved != self._moved_seen:
                self._nodes_seen, self._moved_seen = nodes, moved
                # A MOVED rewrites slots in place and leaves the node that gave them up
                # in the table until redis-py re-reads the map (every few MOVEDs): a
                # node that serves no slot any more is not in use either.
                serving = {
                    id(node) for owners in list(manager.slots_cache.values()) for node in owners
                }
                used = {
                    id(node.redis_connection.connection_pool)
                    for node in list(nodes.values())  # a copy at once: redis-py may add
                    if node.redis_connection is not None and id(node) in serving
                }
                self._retired.update(pool for pool in self._pools if id(pool) not in used)
            self._retired = {pool for pool in self._retired if pool.close_idle()}

    def _make(self) -> RedisCluster:
        config = self.config
        (host, port), *others = config.nodes
        shown = f"[{host}]" if ":" in host else host
        return RedisCluster(
            # Through a URL (without credentials) redis-py builds each node's pool from
            # connection_pool_class and connection_class: the deadline-aware ones.
            url=f"redis://{shown}:{port}",
            startup_nodes=[ClusterNode(h, p) for h, p in others],  # type: ignore[no-untyped-call]
            connection_pool_class=self._new_pool,
            connection_class=_connection_class(config),
            # Redirections are followed regardless; a failed node is not retried
            # within a call (the deadline would end it anyway), only at the next call.
            retry=Retry(NoBackoff(), 0),
            **_REFRESH_AT_ONCE,
            **_connection_options(config),
        )

    def _client(self) -> RedisCluster:
        cluster = self._cluster
        if cluster is not None:
            return cluster
        if os.getpid() != self._pid:  # a parent thread may have held the lock at fork
            self._lock, self._pid = threading.Lock(), os.getpid()
        with self._lock:
            # A call that passed the backend's closed check as close() ran must not make
            # a new client: nothing would ever close it.
            if self._closed:
                raise BackendError(f"redis at {self.config.where}: the backend is closed")
            if self._cluster is None:
                self._cluster = self._make()
            return self._cluster

    def _pipeline(self) -> Any:
        return self._client().pipeline(transaction=False)  # type: ignore[no-untyped-call]

    def _order(self, keys: Sequence[str]) -> list[int] | None:
        """Keys grouped by node, nodes in one order shared by every thread.

        A cluster pipeline takes a connection from each node's pool in the order its
        commands were queued and holds them all until the replies are in. With full
        pools, two threads taking two nodes in opposite orders would each wait for the
        other's: one global order (by node address) rules that out.
        """
        # The slot map's primaries, read directly: get_node_from_key takes the map's
        # lock and checks replica options per key, 2.3x the time for a 64-key batch.
        slots = self._client().nodes_manager.slots_cache
        prefix = self.prefix.encode("ascii")
        names = []
        for key in keys:
            served = slots.get(key_slot(prefix + key.encode("ascii")))
            names.append(served[0].name if served else "")  # unserved: the pipeline says
        return sorted(range(len(keys)), key=names.__getitem__)

    def check_access(self, key_prefix: str = "") -> None:
        pipe = self._pipeline()
        self._probe(pipe, key_prefix)
        self._check_probe(pipe.execute(raise_on_error=False), key_prefix)

    def fetch(self, keys: Sequence[str], explain: bool) -> list[Fetched]:
        # GET answers WRONGTYPE for a key holding no string: nil is only ever absent.
        values: list[Fetched] = []
        for reply in self._run("GET", keys):
            if isinstance(reply, Exception):
                if error_code(reply) != "WRONGTYPE":
                    raise reply_error(reply, self.config, "get")
                reply = NOT_A_STRING
            values.append(reply)
        return values

    def scan(self, prefix: str) -> Iterator[list[tuple[str, int]]]:
        cluster = self._client()
        seen: set[bytes] = set()
        for node in cluster.get_primaries():  # type: ignore[no-untyped-call]
            yield from _scan(self, cluster.get_redis_connection(node), prefix, seen)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()  # closes the pools of the nodes in its table only
        with self._seen_lock:
            pools, self._retired = list(self._pools), set()
        for pool in pools:
            pool.disconnect()


def make_client(config: RedisConfig) -> ServerClient | ClusterClient:
    return ClusterClient(config) if config.cluster else ServerClient(config)
