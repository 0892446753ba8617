"""Redis backend: one server, or a Redis Cluster, holding KV pages as plain strings.

Redis is the development and fallback store: easy to run anywhere, shared by every
process and machine that can reach it. Pages are stored with ``SET key value NX`` —
content-addressed keys make "first writer wins" the right rule — and an optional TTL
(``ttl_s``) lets a shared deployment bound how long pages live, on top of whatever
``maxmemory-policy`` evicts.

Every batched call is one round trip per server. A small built-in RESP client
(:mod:`kvconn_redis._resp`) sends values from the caller's memory and receives them
straight into the caller's buffers, after checking each value's size. A cluster uses the
same client once per primary (:mod:`kvconn_redis._cluster`): keys are routed by slot from
the map ``CLUSTER SLOTS`` gives, every node's share is sent before any reply is read so
the nodes work at the same time, and ``MOVED``/``ASK`` redirections are followed. No
third-party client is involved in either mode.

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
    Connections per server, shared by the threads using this backend (default 8).
``connect_timeout_s`` / ``timeout_s``
    Connect and per-read/write timeouts in seconds (defaults 2.0 and 5.0). Short on
    purpose: a slow store must turn into misses quickly, not stall the serving loop.
``ttl_s``
    Expiry of stored pages in seconds (``PX``, millisecond resolution); default none.
``cluster``
    ``True`` for Redis Cluster with a ``redis://``/``rediss://`` URL; the
    ``redis+cluster://`` scheme implies it.
``tls_ca_file`` / ``tls_cert_file`` / ``tls_key_file`` / ``tls_verify``
    TLS trust anchor, client certificate and key, and whether to verify the server's
    certificate and host name (default ``True``). Only with ``rediss://``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import ClassVar, Protocol

from kvconn.backend import Backend, Capabilities
from kvconn.errors import BackendError, BackendUnavailable, ConfigError
from kvconn_redis._config import DEFAULT_URL, RedisConfig, make_config
from kvconn_redis._resp import HandshakeError

__all__ = ["DEFAULT_URL", "RedisBackend"]

log = logging.getLogger(__name__)


class _Client(Protocol):
    """What the backend needs from the single-node and the cluster client alike."""

    where: str

    def ping(self) -> None: ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]: ...

    def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]: ...

    def delete(self, keys: Sequence[str]) -> list[bool]: ...

    def scan(self, prefix: str) -> Iterator[tuple[str, int]]: ...

    def close(self) -> None: ...


class RedisBackend(Backend):
    name: ClassVar[str] = "redis"
    extra: ClassVar[str | None] = "redis"
    # Both modes speak RESP themselves: redis-py (the ``redis`` extra) is not needed.
    client_modules: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities] = Capabilities(delete=True, listing=True)

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
    ) -> None:
        """Check the options, then try one connection.

        Credentials, the database number and cluster mode can only be checked by the
        server, so one connection is tried now (in cluster mode: reading the slot map
        from a seed): a refusal is a :class:`ConfigError` at start-up. A server that
        cannot be reached is *not* an error here — it may come up later,
        and until then every call raises :class:`BackendUnavailable`, which the
        connector serves as misses.
        """
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
        )
        self._client: _Client
        if self.config.cluster:
            from kvconn_redis._cluster import ClusterClient

            self._client = ClusterClient(self.config)
        else:
            from kvconn_redis._resp import RespClient

            self._client = RespClient(self.config)
        self._closed = False
        try:
            self._client.ping()
        except HandshakeError as exc:
            self._client.close()
            raise ConfigError(f"redis: {exc}") from exc
        except BackendUnavailable as exc:
            log.warning("kvconn: %s; calls will fail until it answers", exc)
        except BaseException:
            self._client.close()
            raise

    def __repr__(self) -> str:
        return f"RedisBackend({self.config.where!r})"

    @property
    def where(self) -> str:
        """The server or cluster address (no password), for logs."""
        return self.config.where

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            self._client.close()

    def _live(self) -> _Client:
        if self._closed:
            raise BackendError(f"redis at {self.config.where}: the backend is closed")
        return self._client

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        return self._live().exists(keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        return self._live().put(keys, values)

    def _get(self, keys: list[str], buffers: list[memoryview]) -> Sequence[bool]:
        return self._live().get(keys, buffers)

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        return self._live().delete(keys)

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        return self._live().scan(prefix)
