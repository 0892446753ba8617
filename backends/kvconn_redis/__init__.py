"""Redis backend: one server, or a Redis Cluster, holding KV pages as plain strings.

Redis is the development and fallback store: easy to run anywhere, shared by every
process and machine that can reach it. Pages are stored with ``SET key value NX`` —
content-addressed keys make "first writer wins" the right rule — and an optional TTL
(``ttl_s``) lets a shared deployment bound how long pages live, on top of whatever
``maxmemory-policy`` evicts.

The wire is redis-py's (with hiredis when installed): pooled connections, TLS, ACL
users, Unix sockets, and Redis Cluster with its slot routing and ``MOVED``/``ASK``
redirections. Each batch is one pipeline — one round trip per server, or per node of a
cluster with every node's share sent before any reply is read (:mod:`kvconn_redis._client`).
What kvconn adds around it:

* one deadline for the *whole* call (``timeout_s``), enforced on every socket read and
  write, connect and pool wait (:mod:`kvconn_redis._deadline`): a server that trickles
  its replies cannot stall the serving loop past it;
* errors sorted into kvconn's kinds (:mod:`kvconn_redis._errors`): unreachable, timed
  out or resharding is :class:`~kvconn.errors.BackendUnavailable` (served as misses);
  credentials, ACL permissions, an untrusted certificate or the wrong mode are a
  :class:`~kvconn.errors.ConfigError` at start-up; messages never carry the password;
* a start-up probe that the user may write and read (``SET … XX`` on an absent key,
  which changes nothing but is checked against the ACL like the real puts), under the
  key prefix and, once told (:meth:`RedisBackend.check_access`), under the connector's
  namespace and model, so an ACL user confined to other keys is refused at start-up;
  and when the probe's connection opens but breaks, a look at the transport
  (:mod:`kvconn_redis._transport`): ``redis://`` at a TLS port, ``rediss://`` at a plain
  one, a missing client certificate are configuration errors, not an outage;
* values sent from the caller's buffers without a join; on one server, an ``MGET``
  reply read off the socket into a buffer kept from call to call
  (:mod:`kvconn_redis._reply`), not parsed into new ``bytes`` per value; each value is
  then copied once into the caller's buffer after its size was checked, or not at all
  when the caller borrows the values (``borrow``, ``Capabilities.borrowed_reads``): a
  load then verifies each page where the socket's bytes landed and scatters it into the
  KV pool from there.

Threads: one backend may be called from several threads at once
(``Capabilities.thread_safe``). redis-py's clients and pools are made to be shared: each
call takes its own pooled connection (waiting, within ``timeout_s``, when all are out)
and builds its own pipeline, and the deadline is per thread. What kvconn keeps besides
(the cluster client made at first use, the node table the last batch saw, pools of
departed nodes) changes under small locks, never held across a round trip.

Options (keyword arguments; ``load_backend("redis", {...})``):

``url``
    ``redis://host:port/db``, ``rediss://`` (TLS), ``unix:///path/redis.sock?db=N``,
    ``redis+cluster://host:port[,host:port…]`` / ``rediss+cluster://`` (cluster mode;
    the hosts are seeds). Default ``redis://127.0.0.1:6379/0``.
``username`` / ``password``
    ACL user and password (``AUTH``); override any given in the URL.
``db``
    Database number; overrides the URL's. Must be 0 for a cluster.
``key_prefix``
    Prepended to every key (a namespace inside a shared Redis); default ``""``.
``max_connections``
    Connections per server (per primary in a cluster), shared by the threads using this
    backend (default 8); a call waits for a free one within its ``timeout_s``.
``connect_timeout_s`` / ``timeout_s``
    Seconds allowed to open one connection, and for a whole call — connecting, waiting
    for a pooled connection, sending and every reply (defaults 2.0 and 5.0). Short on
    purpose: a slow store must turn into misses quickly, not stall the serving loop.
``ttl_s``
    Expiry of stored pages in seconds (``PX``, millisecond resolution); default none.
``cluster``
    ``True`` for Redis Cluster with a ``redis://``/``rediss://`` URL; the
    ``redis+cluster://`` scheme implies it.
``tls_ca_file`` / ``tls_cert_file`` / ``tls_key_file`` / ``tls_verify``
    TLS trust anchor, client certificate and key, and whether to verify the server's
    certificate and host name (default ``True``). Only with ``rediss://``.
``reuse_reply_buffers``
    On one server, read each ``MGET`` reply off the socket into a buffer kept for the
    next read (default ``True``): no new memory per value, no page faults per load, at
    the cost of the buffers kept (:mod:`kvconn_redis._reply`). ``False``: values come
    as redis-py parses them, new ``bytes`` each, and nothing is kept between calls.
    No effect in a cluster.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvconn.backend import Backend, Capabilities, ReadStatus
from kvconn.errors import BackendError, BackendUnavailable, ConfigError
from kvconn.redaction import redact_url
from kvconn_redis._config import DEFAULT_URL, RedisConfig, make_config

if TYPE_CHECKING:
    from kvconn_redis._client import Client

__all__ = ["DEFAULT_URL", "RedisBackend"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisBackend(Backend):
    name: ClassVar[str] = "redis"
    extra: ClassVar[str | None] = "redis"
    client_modules: ClassVar[tuple[str, ...]] = ("redis",)
    #: thread_safe: see the module docstring (Threads). borrowed_reads: the values of a
    #: read are this process's own ``bytes`` until the borrow ends (``_borrow``).
    capabilities: ClassVar[Capabilities] = Capabilities(
        delete=True, listing=True, thread_safe=True, borrowed_reads=True
    )

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        username: str | None = None,
        password: str | None = None,
        db: int | None = None,
        key_prefix: str = "",
        max_connections: int = 8,
        connect_timeout_s: float = 2.0,
        timeout_s: float = 5.0,
        ttl_s: float | None = None,
        cluster: bool = False,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_verify: bool = True,
        reuse_reply_buffers: bool = True,
    ) -> None:
        """Check the options, then connect once and probe what the server allows.

        Credentials, permissions, the database number, TLS trust and cluster mode can
        only be checked by the server, so one connection is tried now: a refusal is a
        :class:`ConfigError` at start-up. A server that cannot be reached is *not* an
        error here — it may come up later, and until then every call raises
        :class:`BackendUnavailable`, which the connector serves as misses.
        """
        self._closed = True
        self.config: RedisConfig = make_config(
            url=url,
            username=username,
            password=password,
            db=db,
            key_prefix=key_prefix,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            timeout_s=timeout_s,
            ttl_s=ttl_s,
            cluster=cluster,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            tls_verify=tls_verify,
            reuse_reply_buffers=reuse_reply_buffers,
        )
        # redis-py is imported only now: the class must load without it, so that a
        # missing client library is reported with the install hint (client_modules).
        from kvconn_redis import _client, _deadline, _errors, _transport

        self._client: Client = _client.make_client(self.config)
        self._client_errors = _client.CLIENT_ERRORS
        self._deadline = _deadline.deadline
        self._translate = _errors.translate
        self._transport_problem = _transport.transport_problem
        self._closed = False
        self._unreachable_at_start = False
        try:
            self._probe("")
        except BaseException:
            self.close()
            raise

    def check_access(self, key_prefix: str) -> None:
        """Refuse, at start-up, an ACL user whose key patterns exclude ``key_prefix``.

        The constructor's probe knows only the ``key_prefix`` option; kvconn's keys go on
        with the namespace and model (``kvconn/<model>/``), which only the caller knows.
        A user confined to ``~other/*`` would otherwise be refused on every call, each
        refusal a warning and a miss.
        """
        if not isinstance(key_prefix, str):
            raise ConfigError(f"key_prefix must be a string, got {key_prefix!r}")
        if not self._unreachable_at_start:  # said once already: no second warning
            self._probe(key_prefix)

    def _probe(self, key_prefix: str) -> None:
        """The start-up probe under ``key_prefix``; an unreachable server only warns."""
        try:
            self._call("connect", self._client.check_access, key_prefix, startup=True)
        except BackendUnavailable as exc:
            problem = self._transport_problem(self.config)
            if problem is not None:
                raise ConfigError(redact_url(problem)) from None
            self._unreachable_at_start = True
            log.warning("kvconn: %s; calls will fail until it answers", exc)

    def __repr__(self) -> str:
        return f"RedisBackend({self.config.where!r})"

    @property
    def where(self) -> str:
        """The server or cluster address (no password), for logs."""
        return self.config.where

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def _call(self, op: str, fn: Callable[..., T], *args: Any, startup: bool = False) -> T:
        """Run one operation within ``timeout_s``; redis-py's errors become kvconn's."""
        if self._closed:
            raise BackendError(f"redis at {self.config.where}: the backend is closed")
        try:
            with self._deadline(self.config.timeout_s):
                return fn(*args)
        except self._client_errors as exc:
            raise self._translate(exc, self.config, op, startup=startup) from exc
        except (BackendError, ConfigError) as exc:
            exc.args = (redact_url(str(exc)),)
            raise

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        return self._call("exists", self._client.exists, keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        return self._call("put", self._client.put, keys, values)

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        loaded = ReadStatus.LOADED
        statuses = self._call("get", self._client.read, keys, buffers, False)
        return [s is loaded for s in statuses]

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        """``MISSING`` (absent) or ``WRONG_SIZE`` (another length, or not a string) per
        key that did not load; a server that cannot be asked raises, as for every call."""
        return self._call("get", self._client.read, keys, buffers, True)

    @contextlib.contextmanager
    def _borrow(self, keys: list[str]) -> Iterator[list[memoryview | None]]:
        """Views of the values one ``MGET`` brought, lent until the block ends.

        The values are this call's copy (on one server, in a reply buffer taken for it,
        reused only once no view of it is left; in a cluster, ``bytes`` redis-py made),
        so nothing another client writes, deletes or evicts meanwhile can change them. A key
        holding no string is lent as an empty view: stored but never a page, so the
        load counts it as unreadable and the connector deletes it, as after a ``get``
        asked why. The views are released when the block ends, as LMDB's are, so that
        a caller keeping one finds out on either store.
        """
        lent = self._call("get", self._client.lend, keys, True)
        try:
            yield lent.views
        finally:
            lent.release()

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        return self._call("delete", self._client.delete, keys)

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """Keys under ``prefix``, a SCAN page per call (each within ``timeout_s``).

        Keys outside kvconn's alphabet (written by other programs: non-ASCII, spaces,
        binary) are skipped, never decoded into an error.
        """
        pages = self._call("list", self._client.scan, prefix)
        while True:
            page = self._call("list", next, pages, None)
            if page is None:
                return
            yield from page
