"""Redis Cluster through redis-py's ``RedisCluster``: the fallback for cluster mode.

Cluster routing (slot maps, ``MOVED``/``ASK`` redirections, topology refresh after a
failover) is the hard part of a cluster client and redis-py already does it well, so
cluster mode uses it instead of the hand-written single-node path. Its non-transactional
pipeline groups a batch by node and writes every node's share in one packed send before
reading any reply: one round trip per node, the nodes overlapping (the tests check it).

Every redis-py exception is translated here; nothing redis-specific leaves this module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvconn.errors import BackendError, BackendUnavailable
from kvconn_redis._config import RedisConfig
from kvconn_redis._resp import HandshakeError, glob_escape

__all__ = ["ClusterClient"]

_SCAN_COUNT = 1000
_AUTH_HINTS = ("auth", "wrongpass", "noperm", "username-password")


class ClusterClient:
    """Batched exists/put/get/delete/scan against a Redis Cluster."""

    def __init__(self, config: RedisConfig) -> None:
        import redis
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.config = config
        self.where = config.where
        self._exceptions = redis.exceptions
        self._catch: tuple[type[BaseException], ...] = (
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        self._prefix = config.key_prefix.encode("ascii")
        kwargs: dict[str, Any] = {
            "startup_nodes": [
                redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                for h, p in config.nodes
            ],
            "username": config.username,
            "password": config.password,
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "max_connections": config.max_connections,
            # One retry lets redis-py refresh its slot map after a failover; more would
            # only delay the error the connector needs to start serving without the cache.
            "retry": Retry(NoBackoff(), 1),
        }
        if config.tls:
            config.ssl_context()  # certificate problems surface now, as a ConfigError
            kwargs.update(
                ssl=True,
                ssl_ca_certs=config.tls_ca_file,
                ssl_certfile=config.tls_cert_file,
                ssl_keyfile=config.tls_key_file,
                ssl_cert_reqs="required" if config.tls_verify else "none",
                ssl_check_hostname=config.tls_verify,
            )
        self._factory: Callable[[], Any] = lambda: redis.cluster.RedisCluster(**kwargs)
        self._client: Any = None
        self._lock = threading.Lock()

    # RedisCluster() contacts a seed node at once to learn the slot map; done lazily,
    # so a cluster that is down when the backend is made only means errors until it is up.
    def _cluster(self, op: str) -> Any:
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    try:
                        self._client = self._factory()
                    except self._catch as exc:
                        raise self._translate(exc, op) from exc
                client = self._client
        return client

    def ping(self) -> None:
        self._cluster("connect")

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*self._catch):
                client.close()

    def _translate(self, exc: BaseException, op: str) -> BackendError:
        errors = self._exceptions
        text = f"redis cluster at {self.where}: {op} failed: {type(exc).__name__}: {exc}"
        lowered = str(exc).lower()
        if isinstance(exc, (errors.AuthenticationError, errors.AuthorizationError)) or any(
            hint in lowered for hint in _AUTH_HINTS
        ):
            return HandshakeError(f"{text} (check the username/password options)")
        transient = (
            errors.ConnectionError,
            errors.TimeoutError,
            errors.ClusterDownError,
            errors.TryAgainError,
            errors.RedisClusterException,
            OSError,
        )
        if isinstance(exc, transient):
            return BackendUnavailable(text)
        return BackendError(text)

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode("ascii")

    def _pipeline(self, op: str, fill: Callable[[Any], None]) -> list[Any]:
        """Run one non-transactional pipeline; per-command errors come back as values."""
        client = self._cluster(op)
        try:
            pipe = client.pipeline(transaction=False)
            fill(pipe)
            return list(pipe.execute(raise_on_error=False))
        except self._catch as exc:
            raise self._translate(exc, op) from exc

    def _check(self, op: str, result: Any) -> Any:
        if isinstance(result, BaseException):
            raise self._translate(result, op) from result
        return result

    def exists(self, keys: Sequence[str]) -> list[bool]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.exists(self._key(key))

        return [bool(self._check("exists", r)) for r in self._pipeline("exists", fill)]

    def delete(self, keys: Sequence[str]) -> list[bool]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.delete(self._key(key))

        return [bool(self._check("delete", r)) for r in self._pipeline("delete", fill)]

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        ttl_ms = self.config.ttl_ms

        def fill(pipe: Any) -> None:
            for key, value in zip(keys, values):
                pipe.set(self._key(key), value, nx=True, px=ttl_ms)

        out = []
        for result in self._pipeline("put", fill):
            if isinstance(result, self._exceptions.OutOfMemoryError):
                out.append(False)  # that node is full: the page is not saved
                continue
            self._check("put", result)
            out.append(True)  # True: stored; None: already present, left untouched
        return out

    def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.get(self._key(key))

        out = []
        results = [self._check("get", r) for r in self._pipeline("get", fill)]
        for value, buf in zip(results, buffers):
            if value is None or len(value) != buf.nbytes:
                out.append(False)  # absent, or another size: the buffer stays untouched
                continue
            buf[:] = value
            out.append(True)
        return out

    def scan(self, prefix: str) -> Iterator[tuple[str, int]]:
        """SCAN every primary, then STRLEN the keys found, one pipeline per chunk."""
        client = self._cluster("list")
        pattern = glob_escape(self._prefix + prefix.encode("ascii")) + b"*"
        seen: set[bytes] = set()
        chunk: list[bytes] = []
        try:
            for key in client.scan_iter(match=pattern, count=_SCAN_COUNT):
                if key in seen:
                    continue
                seen.add(key)
                chunk.append(key)
                if len(chunk) >= _SCAN_COUNT:
                    yield from self._sizes(chunk)
                    chunk = []
        except self._catch as exc:
            raise self._translate(exc, "list") from exc
        yield from self._sizes(chunk)

    def _sizes(self, keys: list[bytes]) -> Iterator[tuple[str, int]]:
        if not keys:
            return

        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.strlen(key)

        for key, size in zip(keys, self._pipeline("list", fill)):
            if isinstance(size, int) and size > 0:  # 0: deleted since SCAN; errors: not ours
                yield key[len(self._prefix) :].decode("ascii"), size
