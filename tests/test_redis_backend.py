"""The Redis backend against real redis-server processes: one server and a 3-node cluster.

Every server here is started by the tests on a free loopback port and stopped at the
end; a missing redis-server skips locally and fails in CI (``require_or_skip``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconn.backend import Backend
from kvconn.errors import BackendError, BackendUnavailable, ConfigError
from kvconn.registry import load_backend
from kvconn.testing import BackendTests
from kvconn.testing.suite import require_or_skip
from kvconn.tools.devserver._ports import free_port
from kvconn.tools.devserver.redis import RedisCluster, RedisServer

pytestmark = pytest.mark.server


# ---------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    require_or_skip(RedisServer.available())
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    require_or_skip(RedisCluster.available())
    cluster = RedisCluster(3, node_timeout_ms=1000).start()
    try:
        yield cluster
    finally:
        cluster.stop()


class _RestartServer:
    """server_control for one server: crash it, then bring it back on the same port."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def stop(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.restart()


class _RestartCluster:
    """server_control for a cluster: every node down, then every node back (same ports)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.cluster = cluster

    def stop(self) -> None:
        for node in self.cluster.nodes:
            node.kill()

    def start(self) -> None:
        for node in self.cluster.nodes:
            node.restart()
        self.cluster.wait_ready()


def _open(options: dict[str, Any]) -> Backend:
    return load_backend("redis", options)


# ---------------------------------------------------------------- conformance
class TestRedisConformance(BackendTests):
    backend_name = "redis"

    @pytest.fixture
    def backend_options(self, redis_server: RedisServer) -> dict[str, Any]:
        return {**redis_server.options, "timeout_s": 2.0}

    @pytest.fixture
    def server_control(self, redis_server: RedisServer) -> _RestartServer:
        return _RestartServer(redis_server)


class TestRedisClusterConformance(BackendTests):
    backend_name = "redis"

    @pytest.fixture
    def backend_options(self, redis_cluster: RedisCluster) -> dict[str, Any]:
        return {**redis_cluster.options, "timeout_s": 2.0}

    @pytest.fixture
    def server_control(self, redis_cluster: RedisCluster) -> _RestartCluster:
        return _RestartCluster(redis_cluster)


# ---------------------------------------------------------------- behaviour
def _value(seed: int, size: int) -> bytes:
    block = bytes((seed * 7 + i) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


def test_eviction_under_maxmemory_never_yields_a_partial_value() -> None:
    require_or_skip(RedisServer.available())
    with RedisServer(maxmemory="4mb", maxmemory_policy="allkeys-lru") as server:
        backend = _open(server.options)
        size, count = 64 * 1024, 96  # 6 MiB into 4 MiB: most of it is evicted
        keys = [f"evict/{i}" for i in range(count)]
        for start in range(0, count, 8):
            batch = range(start, start + 8)
            backend.put([keys[i] for i in batch], [_value(i, size) for i in batch])
        buffers = [bytearray(b"\xee" * size) for _ in keys]
        found = backend.get(keys, buffers)
        for i, (ok, buf) in enumerate(zip(found, buffers)):
            assert bytes(buf) == (_value(i, size) if ok else b"\xee" * size)
        assert 0 < sum(found) < count
        backend.close()


def test_a_ttl_makes_stored_pages_expire(redis_server: RedisServer) -> None:
    expiring = _open({**redis_server.options, "ttl_s": 0.25, "key_prefix": "ttl/"})
    lasting = _open({**redis_server.options, "key_prefix": "ttl/"})
    expiring.put(["short"], [b"page"])
    lasting.put(["long"], [b"page"])
    pttl = redis_server.command("PTTL", "ttl/short")
    assert isinstance(pttl, int) and 0 < pttl <= 250
    assert redis_server.command("PTTL", "ttl/long") == -1
    time.sleep(0.35)
    assert lasting.exists(["short", "long"]) == [False, True]
    assert expiring.get(["short"], [bytearray(4)]) == [False]
    expiring.close()
    lasting.close()


def _make_certificates(directory: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI, EC keys)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=kvconn test CA",
    )
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    )
    return {name: str(directory / name) for name in ("ca.crt", "server.crt", "server.key")}


def test_a_rediss_url_talks_tls_and_rejects_an_untrusted_certificate(tmp_path: Path) -> None:
    """Skipped (even in CI) when openssl is missing or redis-server lacks TLS support."""
    require_or_skip(RedisServer.available())
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make test certificates")
    files = _make_certificates(tmp_path)
    tls_port = free_port()
    server = RedisServer(
        extra_args=[
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            files["server.crt"],
            "--tls-key-file",
            files["server.key"],
            "--tls-ca-cert-file",
            files["ca.crt"],
            "--tls-auth-clients",
            "no",
        ]
    )
    try:
        server.start()
    except RuntimeError as exc:
        if "TLS" in str(exc) or "tls" in str(exc):
            pytest.skip(f"redis-server without TLS support: {exc}")
        raise
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        backend = _open({"url": url, "tls_ca_file": files["ca.crt"]})
        value = _value(1, 300_000)
        assert backend.put(["tls/a"], [value]) == [True]
        buf = bytearray(len(value))
        assert backend.get(["tls/a"], [buf]) == [True] and bytes(buf) == value
        backend.close()
        unverified = _open({"url": url, "tls_verify": False})
        assert unverified.exists(["tls/a"]) == [True]
        unverified.close()
        with pytest.raises(ConfigError, match="not trusted"):
            _open({"url": url})  # the system CAs do not know our throwaway CA
    finally:
        server.stop()


def test_a_unix_socket_url_reaches_the_server() -> None:
    require_or_skip(RedisServer.available())
    directory = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")  # socket paths must be short
    path = os.path.join(directory, "redis.sock")
    try:
        with RedisServer(extra_args=["--unixsocket", path, "--unixsocketperm", "700"]) as server:
            backend = _open({"url": f"unix://{path}?db=2"})
            assert backend.put(["unix/a"], [b"over a unix socket"]) == [True]
            buf = bytearray(18)
            assert backend.get(["unix/a"], [buf]) == [True]
            assert bytes(buf) == b"over a unix socket"
            assert b"db2:keys=1" in _info(server, "keyspace")
            backend.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _info(server: RedisServer, section: str) -> bytes:
    reply = server.command("INFO", section)
    assert isinstance(reply, bytes)
    return reply


def test_the_db_option_selects_the_database(redis_server: RedisServer) -> None:
    backend = _open({**redis_server.options, "db": 5})
    backend.put(["db/a"], [b"x"])
    assert b"db5:keys=1" in _info(redis_server, "keyspace")
    backend.close()


def test_a_wrong_or_missing_password_is_a_clear_configuration_error() -> None:
    require_or_skip(RedisServer.available())
    with RedisServer(password="s3cret") as server:
        with pytest.raises(ConfigError, match=r"refused the credentials.*password"):
            _open({"url": server.url, "password": "wrong"})
        with pytest.raises(ConfigError, match=r"NOAUTH.*password"):
            _open({"url": server.url})
        backend = _open({"url": server.url, "password": "s3cret"})
        assert backend.put(["auth/a"], [b"x"]) == [True]
        backend.close()
        in_url = _open({"url": f"redis://:s3cret@127.0.0.1:{server.port}/0"})
        assert in_url.exists(["auth/a"]) == [True]
        in_url.close()


def test_an_acl_user_authenticates_with_username_and_password(redis_server: RedisServer) -> None:
    redis_server.command("ACL", "SETUSER", "kvapp", "on", ">app-pass", "~acl/*", "+@all")
    backend = _open({**redis_server.options, "username": "kvapp", "password": "app-pass"})
    assert backend.put(["acl/a"], [b"x"]) == [True]
    with pytest.raises(BackendError, match="NOPERM"):
        backend.put(["outside/a"], [b"x"])  # the ACL confines this user to acl/*
    backend.close()
    with pytest.raises(ConfigError, match="refused the credentials"):
        _open({**redis_server.options, "username": "kvapp", "password": "nope"})


def test_a_server_that_is_down_at_start_is_unavailable_not_misconfigured() -> None:
    backend = _open({"url": f"redis://127.0.0.1:{free_port()}/0", "connect_timeout_s": 0.5})
    with pytest.raises(BackendUnavailable, match="cannot connect"):
        backend.exists(["down/a"])
    backend.close()


_UNUSED = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"url": "http://localhost"}, "option 'url' must start with redis://"),
        ({"url": 6379}, "option 'url' must be a string"),
        ({"url": "redis://localhost:0"}, "option 'url' has a bad port"),
        ({"url": "redis://localhost:6379/x"}, "option 'url' has a bad database"),
        ({"url": "redis://localhost/0?socket_timeout=1"}, "option 'url' .*socket_timeout"),
        ({"url": "redis://a:1,b:2"}, "option 'url' lists several hosts"),
        ({"url": "unix://relative.sock"}, "option 'url' needs an absolute socket path"),
        ({"url": _UNUSED, "db": -1}, "option 'db'"),
        ({"url": _UNUSED, "db": "1"}, "option 'db'"),
        ({"url": _UNUSED, "db": True}, "option 'db'"),
        ({"url": _UNUSED, "username": ""}, "option 'username'"),
        ({"url": _UNUSED, "username": "app"}, "option 'username' needs a password"),
        ({"url": _UNUSED, "password": 5}, "option 'password'"),
        ({"url": _UNUSED, "key_prefix": "with space/"}, "option 'key_prefix'"),
        ({"url": _UNUSED, "key_prefix": 7}, "option 'key_prefix'"),
        ({"url": _UNUSED, "max_connections": 0}, "option 'max_connections'"),
        ({"url": _UNUSED, "max_connections": 2.5}, "option 'max_connections'"),
        ({"url": _UNUSED, "connect_timeout_s": 0}, "option 'connect_timeout_s'"),
        ({"url": _UNUSED, "timeout_s": -1.0}, "option 'timeout_s'"),
        ({"url": _UNUSED, "timeout_s": True}, "option 'timeout_s'"),
        ({"url": _UNUSED, "timeout_s": float("inf")}, "option 'timeout_s'"),
        ({"url": _UNUSED, "ttl_s": 0}, "option 'ttl_s'"),
        ({"url": _UNUSED, "timeout_s": 1e10}, "option 'timeout_s' must be at most 86400"),
        ({"url": _UNUSED, "connect_timeout_s": 1e12}, "option 'connect_timeout_s' must be at"),
        ({"url": _UNUSED, "ttl_s": 1e13}, "option 'ttl_s' must be at most"),
        ({"url": _UNUSED, "cluster": "yes"}, "option 'cluster'"),
        ({"url": "unix:///tmp/r.sock", "cluster": True}, "option 'cluster' cannot be used"),
        ({"url": "redis+cluster://127.0.0.1:1", "db": 2}, "option 'db' must be 0 in cluster"),
        ({"url": _UNUSED, "tls_verify": "no"}, "option 'tls_verify'"),
        ({"url": _UNUSED, "tls_verify": False}, "option 'tls_verify' only applies to TLS"),
        (
            {"url": "rediss://127.0.0.1:1", "tls_ca_file": "/nonexistent/ca.crt"},
            "option 'tls_ca_file'",
        ),
        ({"url": _UNUSED, "no_such_option": 1}, "unknown option.*no_such_option"),
    ],
)
def test_bad_options_are_rejected_naming_the_option(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _open(options)


def test_a_hung_server_times_out_and_its_connection_is_not_reused() -> None:
    require_or_skip(RedisServer.available())
    with RedisServer() as server:
        backend = _open({**server.options, "timeout_s": 0.3})
        backend.put(["hung/a"], [b"A"])
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(BackendUnavailable, match="timed out"):
                backend.get(["hung/a"], [bytearray(1)])
            assert time.monotonic() - started < 2.0
        finally:
            server.resume()
        # The late reply of the timed-out GET must not be read as this call's answer.
        assert backend.exists(["hung/zz", "hung/a"]) == [False, True]
        buf = bytearray(1)
        assert backend.get(["hung/a"], [buf]) == [True] and buf == b"A"
        backend.close()


def test_an_error_reply_in_the_middle_of_a_batch_raises_and_keeps_replies_in_step(
    redis_server: RedisServer,
) -> None:
    backend = _open({**redis_server.options, "max_connections": 1})
    backend.put(["mid/a", "mid/c"], [b"aaa", b"ccc"])
    redis_server.command("LPUSH", "mid/b", "not a string")
    bufs = [bytearray(3) for _ in range(3)]
    with pytest.raises(BackendError, match="WRONGTYPE"):
        backend.get(["mid/a", "mid/b", "mid/c"], bufs)
    # The one pooled connection read all three replies: the next batch is in step.
    assert backend.exists(["mid/zz", "mid/c"]) == [False, True]
    assert backend.get(["mid/c"], [bufs[0]]) == [True] and bufs[0] == b"ccc"
    backend.close()


class _TruncatingServer:
    """A fake Redis that cuts its first GET reply off mid-value, then answers properly."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        truncated = False
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while data := conn.recv(65536):
                    if b"PING" in data:
                        conn.sendall(b"+PONG\r\n")
                    elif b"GET" in data and not truncated:
                        truncated = True
                        conn.sendall(b"$6\r\nabc")  # half a value, then hang up
                        break
                    elif b"GET" in data:
                        conn.sendall(b"$6\r\nabcdef\r\n")

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=5)


def test_a_reply_cut_off_mid_value_is_an_error_and_the_connection_is_dropped() -> None:
    server = _TruncatingServer()
    try:
        backend = _open({"url": f"redis://127.0.0.1:{server.port}/0", "timeout_s": 2.0})
        with pytest.raises(BackendUnavailable, match="mid-value"):
            backend.get(["cut/a"], [bytearray(6)])
        buf = bytearray(6)
        assert backend.get(["cut/a"], [buf]) == [True] and buf == b"abcdef"
        assert server.connections == 2  # the broken connection was not reused
        backend.close()
    finally:
        server.close()


def test_connections_the_server_closed_are_replaced_without_an_error(
    redis_server: RedisServer,
) -> None:
    backend = _open({**redis_server.options, "key_prefix": "kill/"})
    backend.put(["a"], [b"A"])
    redis_server.command("CLIENT", "KILL", "TYPE", "normal")  # as an idle timeout would
    assert backend.exists(["a"]) == [True]
    buf = bytearray(1)
    assert backend.get(["a"], [buf]) == [True] and buf == b"A"
    backend.close()


def test_each_single_server_batch_is_one_send_and_one_read_pass(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvconn_redis._resp import RespConnection

    sends: list[int] = []
    original = RespConnection.send

    def counting(self: RespConnection, parts: Any) -> None:
        sends.append(len(parts))
        original(self, parts)

    backend = _open(redis_server.options)
    monkeypatch.setattr(RespConnection, "send", counting)
    keys = [f"rtt/{i}" for i in range(64)]
    backend.put(keys, [_value(i, 256 * 1024) for i in range(64)])
    backend.exists(keys)
    backend.get(keys, [bytearray(256 * 1024) for _ in keys])
    assert len(sends) == 3
    backend.close()


def test_a_batch_larger_than_one_sendmsg_can_carry_arrives_whole(
    redis_server: RedisServer,
) -> None:
    backend = _open({**redis_server.options, "key_prefix": "iov/"})
    count, size = 1100, 20 * 1024  # > IOV_MAX separately sent value buffers
    keys = [str(i) for i in range(count)]
    arena = bytearray(_value(3, count * size))
    views = [memoryview(arena)[i * size : (i + 1) * size] for i in range(count)]
    assert backend.put(keys, views) == [True] * count
    out = bytearray(count * size)
    assert backend.get(keys, [memoryview(out)[i * size : (i + 1) * size] for i in range(count)])
    assert out == arena
    backend.close()


def test_the_key_prefix_namespaces_keys_and_listing_strips_it(redis_server: RedisServer) -> None:
    backend = _open({**redis_server.options, "key_prefix": "tenant[1]*/"})
    other = _open({**redis_server.options, "key_prefix": "tenant[1]x/"})
    backend.put(["p/a", "p/b"], [b"1", b"22"])
    other.put(["p/c"], [b"333"])  # would match an unescaped glob of the first prefix
    assert redis_server.command("EXISTS", "tenant[1]*/p/a") == 1
    assert sorted(backend.list_keys("p/")) == [("p/a", 1), ("p/b", 2)]
    assert other.exists(["p/a"]) == [False]
    backend.close()
    other.close()


# ---------------------------------------------------------------- cluster behaviour
class _Wire:
    """What the RESP client's sockets did: batches sent, and whose memory bytes moved from/to.

    Events are ``(kind, peer port, detail, bytes)``: ``batch`` (one ``RespConnection.send``;
    detail: the start of the request), ``sent`` and ``recv`` (detail: the object that owns
    the memory the socket read from or wrote into).
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, int, Any, int]] = []

    def batches(self) -> Counter[int]:
        return Counter(port for kind, port, _, _ in self.events if kind == "batch")

    def requests_to(self, port: int) -> list[bytes]:
        """Starts of the batches sent to ``port``, slot-map reads left out."""
        return [
            head
            for kind, p, head, _ in self.events
            if kind == "batch" and p == port and b"CLUSTER\r\n$5\r\nSLOTS" not in head
        ]

    def slot_map_reads(self) -> int:
        return sum(
            b"CLUSTER\r\n$5\r\nSLOTS" in head for kind, _, head, _ in self.events if kind == "batch"
        )

    def bytes_between(self, kind: str, owners: list[bytearray]) -> int:
        """Bytes that went straight between a socket and one of ``owners``."""
        ids = {id(owner) for owner in owners}
        return sum(n for k, _, owner, n in self.events if k == kind and id(owner) in ids)


class _SpiedSocket:
    """A socket that logs, for each send and receive, whose memory the bytes used."""

    def __init__(self, sock: socket.socket, wire: _Wire) -> None:
        self._sock = sock
        self._wire = wire
        self.port: int = sock.getpeername()[1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        views = [memoryview(b) for b in buffers]
        sent = left = self._sock.sendmsg(views, *args)
        for view in views:
            n = min(left, view.nbytes)
            if n:
                self._wire.events.append(("sent", self.port, view.obj, n))
            left -= n
        return sent

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        got = self._sock.recv_into(buffer, nbytes)
        self._wire.events.append(("recv", self.port, memoryview(buffer).obj, got))
        return got


def _spy_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> _Wire:
    """Wrap every socket the RESP client opens from now on (open the backend after this)."""
    from kvconn_redis._resp import RespConnection

    wire = _Wire()
    init, send = RespConnection.__init__, RespConnection.send

    def spied_init(self: RespConnection, sock: Any, where: str, *, use_sendmsg: bool) -> None:
        spied: Any = _SpiedSocket(sock, wire)
        init(self, spied, where, use_sendmsg=use_sendmsg)

    def spied_send(self: RespConnection, parts: Any) -> None:
        head = bytes(memoryview(parts[0])[:96])
        port = getattr(self.sock, "port", 0)
        wire.events.append(("batch", port, head, sum(len(p) for p in parts)))
        send(self, parts)

    monkeypatch.setattr(RespConnection, "__init__", spied_init)
    monkeypatch.setattr(RespConnection, "send", spied_send)
    return wire


def _forbid_redis_py(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any use of redis-py's connections fail the test (when redis-py is installed)."""
    try:
        from redis.connection import AbstractConnection
    except ImportError:
        return

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("redis-py was used on the data path")

    monkeypatch.setattr(AbstractConnection, "send_packed_command", refuse)
    monkeypatch.setattr(AbstractConnection, "connect", refuse)


def test_cluster_batches_spread_keys_across_nodes_in_one_round_trip_per_node(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _spy_on_the_wire(monkeypatch)
    backend = _open(redis_cluster.options)
    # Learn the slot map and open a connection to every node outside the counted calls.
    backend.exists([f"warm-up/{i}" for i in range(48)])
    prefix = f"spread/{time.monotonic_ns()}"
    keys = [f"{prefix}/{i}" for i in range(48)]
    values = [_value(i, 4096) for i in range(48)]
    for op in ("put", "exists", "get"):
        wire.events.clear()
        if op == "put":
            assert backend.put(keys, values) == [True] * 48
        elif op == "exists":
            assert backend.exists(keys) == [True] * 48
        else:
            bufs = [bytearray(4096) for _ in keys]
            assert backend.get(keys, bufs) == [True] * 48
            assert [bytes(b) for b in bufs] == values
        assert wire.batches() == {port: 1 for port in redis_cluster.ports}, op
        # Every node's request went out before any reply was read: the round trips overlap.
        kinds = [kind for kind, _, _, _ in wire.events]
        last_batch = len(kinds) - 1 - kinds[::-1].index("batch")
        assert last_batch < kinds.index("recv"), op
    for node in redis_cluster.nodes:
        stored = node.command("KEYS", f"{prefix}/*")
        assert isinstance(stored, list) and len(stored) >= 5
    backend.close()


def test_cluster_values_move_between_the_callers_buffers_and_the_sockets_without_copies(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _spy_on_the_wire(monkeypatch)
    _forbid_redis_py(monkeypatch)
    backend = _open({**redis_cluster.options, "key_prefix": f"zc/{time.monotonic_ns()}/"})
    size, count = 256 * 1024, 24
    keys = [f"page/{i}" for i in range(count)]
    values = [bytearray(_value(i, size)) for i in range(count)]
    assert backend.put(keys, values) == [True] * count
    # Every value byte left from the caller's own memory (sendmsg of its buffers).
    assert wire.bytes_between("sent", values) == count * size
    assert len({port for kind, port, _, _ in wire.events if kind == "batch"}) == 3
    buffers = [bytearray(size) for _ in keys]
    wire.events.clear()
    assert backend.get(keys, buffers) == [True] * count
    assert [bytes(b) for b in buffers] == [bytes(v) for v in values]
    # recv_into straight into the caller's buffers; the rest is the start of a value that
    # arrived in the same read as its $<len> header (at most one 8 KiB read per value).
    direct = wire.bytes_between("recv", buffers)
    assert direct >= count * (size - 8192), (direct, count * size)
    backend.close()


def _text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _owner(cluster: RedisCluster, slot: int) -> int:
    """Index of the node serving ``slot``, as node 0 sees it."""
    ranges: Any = cluster.nodes[0].command("CLUSTER", "SLOTS")
    for first, last, primary, *_ in ranges:
        if first <= slot <= last:
            return cluster.ports.index(primary[1])
    raise AssertionError(f"slot {slot} has no owner")


def _begin_migration(cluster: RedisCluster, slot: int, source: int, target: int) -> None:
    src, dst = cluster.nodes[source], cluster.nodes[target]
    dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", _text(src.command("CLUSTER", "MYID")))
    src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", _text(dst.command("CLUSTER", "MYID")))


def _move_keys(cluster: RedisCluster, source: int, target: int, keys: list[str]) -> None:
    dst = cluster.nodes[target]
    reply = cluster.nodes[source].command(
        "MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys
    )
    assert reply == b"OK", reply


def _finish_migration(cluster: RedisCluster, slot: int, target: int) -> None:
    dst = cluster.nodes[target]
    target_id = _text(dst.command("CLUSTER", "MYID"))
    for node in [dst, *(n for n in cluster.nodes if n is not dst)]:  # the new owner first
        node.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


@pytest.fixture
def own_cluster() -> Iterator[RedisCluster]:
    """A cluster of its own, for tests that move slots around."""
    require_or_skip(RedisCluster.available())
    with RedisCluster(3, node_timeout_ms=1000) as cluster:
        yield cluster


def _one_slot_keys(tag: str, count: int) -> list[str]:
    return [f"mig/{{{tag}}}/{i}" for i in range(count)]


def test_keys_of_a_slot_moved_after_the_map_was_learned_follow_moved_once(
    own_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _spy_on_the_wire(monkeypatch)
    backend = _open(own_cluster.options)
    keys = _one_slot_keys("moved", 8)
    values = [_value(i, 70_000) for i in range(8)]
    assert backend.put(keys[:4], values[:4]) == [True] * 4  # the backend learned the map
    slot = own_cluster.nodes[0].command("CLUSTER", "KEYSLOT", keys[0])
    assert isinstance(slot, int)
    source = _owner(own_cluster, slot)
    target = (source + 1) % 3
    _begin_migration(own_cluster, slot, source, target)
    _move_keys(own_cluster, source, target, keys[:4])
    _finish_migration(own_cluster, slot, target)

    wire.events.clear()
    assert backend.exists(keys) == [True] * 4 + [False] * 4
    # MOVED from the old owner, one map read, then the keys again at the new owner.
    assert len(wire.requests_to(own_cluster.ports[source])) == 1
    assert len(wire.requests_to(own_cluster.ports[target])) == 1
    assert wire.slot_map_reads() == 1
    wire.events.clear()
    bufs = [bytearray(70_000) for _ in range(4)]
    assert backend.get(keys[:4], bufs) == [True] * 4  # straight to the new owner now
    assert [bytes(b) for b in bufs] == values[:4]
    assert wire.batches() == {own_cluster.ports[target]: 1}
    assert backend.put(keys[4:], values[4:]) == [True] * 4
    assert own_cluster.nodes[target].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 8
    assert own_cluster.nodes[source].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    backend.close()


def test_keys_of_a_slot_half_way_through_a_migration_follow_ask_to_the_importing_node(
    own_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = _spy_on_the_wire(monkeypatch)
    backend = _open(own_cluster.options)
    keys = _one_slot_keys("asked", 8)
    values = [_value(i, 50_000) for i in range(8)]
    assert backend.put(keys[:4], values[:4]) == [True] * 4
    slot = own_cluster.nodes[0].command("CLUSTER", "KEYSLOT", keys[0])
    assert isinstance(slot, int)
    source = _owner(own_cluster, slot)
    target = (source + 2) % 3
    _begin_migration(own_cluster, slot, source, target)
    _move_keys(own_cluster, source, target, keys[:2])  # keys 0-1 moved, 2-3 not yet

    wire.events.clear()
    assert backend.exists(keys) == [True] * 4 + [False] * 4
    bufs = [bytearray(50_000) for _ in range(4)]
    assert backend.get(keys[:4], bufs) == [True] * 4
    assert [bytes(b) for b in bufs] == values[:4]
    assert backend.put(keys[2:], values[2:]) == [True] * 6  # 2-3 exist at the source
    asked = [head for head in wire.requests_to(own_cluster.ports[target])]
    assert asked and all(head.startswith(b"*1\r\n$6\r\nASKING\r\n") for head in asked)
    assert wire.slot_map_reads() == 0  # ASK is no sign of a stale map
    # New keys were created where the slot is going; existing ones stayed put.
    assert own_cluster.nodes[target].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 6
    assert own_cluster.nodes[source].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 2

    _move_keys(own_cluster, source, target, keys[2:4])
    _finish_migration(own_cluster, slot, target)
    bufs = [bytearray(50_000) for _ in keys]
    assert backend.get(keys, bufs) == [True] * 8  # MOVED, then the new owner
    assert [bytes(b) for b in bufs] == values
    backend.close()


def _pipelined(port: int, commands: list[list[str | int]]) -> list[bytes]:
    """Send many commands on one connection; the first line of each reply."""
    payload = b"".join(
        f"*{len(c)}\r\n".encode() + b"".join(f"${len(str(a))}\r\n{a}\r\n".encode() for a in c)
        for c in commands
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(payload)
        data = b""
        while data.count(b"\r\n") < len(commands):
            chunk = sock.recv(1 << 16)
            assert chunk, "the server closed the connection"
            data += chunk
    return data.split(b"\r\n")[: len(commands)]


def _slot(cluster: RedisCluster, key: str) -> int:
    slot = cluster.nodes[0].command("CLUSTER", "KEYSLOT", key)
    assert isinstance(slot, int)
    return slot


def _client_connections(node: Any, *, settle: int | None = None) -> int:
    """Connections to ``node`` other than the one asking.

    ``settle``: the count expected once the server has handled closes already sent;
    it is waited for (up to 5 s), since the server sees a close only on its next pass.
    """
    deadline = time.monotonic() + 5
    while True:
        listing = _text(node.command("CLIENT", "LIST", "TYPE", "normal"))
        count = len([line for line in listing.splitlines() if line.strip()]) - 1
        if settle is None or count == settle or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def test_connections_to_a_node_that_left_the_slot_map_are_closed(
    own_cluster: RedisCluster,
) -> None:
    backend = _open({**own_cluster.options, "max_connections": 4})
    source, target = 2, 1  # not node 0: that is the seed the map is read from
    ranges: Any = own_cluster.nodes[0].command("CLUSTER", "SLOTS")
    slots = [
        slot
        for first, last, primary, *_ in ranges
        if primary[1] == own_cluster.ports[source]
        for slot in range(first, last + 1)
    ]
    tag = next(
        f"t{i}" for i in range(1000) if _owner(own_cluster, _slot(own_cluster, f"t{i}")) == source
    )
    keys = _one_slot_keys(tag, 16) + [f"leave/{i}" for i in range(48)]
    assert backend.put(keys, [b"v"] * 64) == [True] * 64
    assert _client_connections(own_cluster.nodes[source]) >= 1
    # Every key of the leaving node goes to the target, then every one of its slots.
    held: dict[int, list[str]] = {}
    for key in keys:
        held.setdefault(_slot(own_cluster, key), []).append(key)
    for slot, slot_keys in held.items():
        if slot in slots:
            _begin_migration(own_cluster, slot, source, target)
            _move_keys(own_cluster, source, target, slot_keys)
    target_id = _text(own_cluster.nodes[target].command("CLUSTER", "MYID"))
    # An emptied master would otherwise turn itself into a replica of the new owner as
    # soon as gossip tells it, refusing the SETSLOTs still on their way to it.
    own_cluster.nodes[source].command("CONFIG", "SET", "cluster-allow-replica-migration", "no")
    for node in (target, source, 0):
        replies = _pipelined(
            own_cluster.ports[node], [["CLUSTER", "SETSLOT", s, "NODE", target_id] for s in slots]
        )
        assert set(replies) == {b"+OK"}, set(replies)

    assert backend.exists(keys) == [True] * 64  # MOVED, a new map without the node
    assert _client_connections(own_cluster.nodes[source], settle=0) == 0
    bufs = [bytearray(1) for _ in keys]
    assert backend.get(keys, bufs) == [True] * 64
    assert _client_connections(own_cluster.nodes[source], settle=0) == 0
    backend.close()


def test_slots_computed_locally_agree_with_the_servers_keyslot(redis_cluster: RedisCluster) -> None:
    from kvconn_redis._cluster import key_slot

    node = redis_cluster.nodes[0]
    keys = [
        "a",
        "kvconn/mm3/w8r3/lg0/t32b262144/0123456789abcdef",
        "{user1000}.following",
        "{user1000}.followers",
        "foo{}{bar}",
        "foo{{bar}}zap",
        "foo{bar}{zap}",
        "{}",
        "}{",
        "x{",
        *(f"k/{i}/{i * 7919 % 1000}" for i in range(40)),
    ]
    for key in keys:
        assert key_slot(key.encode()) == node.command("CLUSTER", "KEYSLOT", key), key


def test_cluster_mode_aimed_at_a_plain_server_is_a_configuration_error(
    redis_server: RedisServer,
) -> None:
    with pytest.raises(ConfigError, match="not a cluster node"):
        _open({"url": redis_server.url, "cluster": True})


def test_a_cluster_acl_user_authenticates_on_every_node(redis_cluster: RedisCluster) -> None:
    for node in redis_cluster.nodes:
        node.command("ACL", "SETUSER", "kvclu", "on", ">clu-pass", "~acl/*", "+@all")
    try:
        options = {**redis_cluster.options, "username": "kvclu", "password": "clu-pass"}
        backend = _open(options)
        keys = [f"acl/{i}" for i in range(24)]  # on every node
        assert backend.put(keys, [b"v"] * 24) == [True] * 24
        assert backend.exists(keys) == [True] * 24
        with pytest.raises(BackendError, match="NOPERM"):
            backend.put([f"outside/{i}" for i in range(24)], [b"v"] * 24)
        backend.close()
        with pytest.raises(ConfigError, match="refused the credentials"):
            _open({**options, "password": "wrong"})
    finally:
        for node in redis_cluster.nodes:
            node.command("ACL", "DELUSER", "kvclu")


def test_cluster_mode_applies_the_key_prefix_and_ttl_on_every_node(
    redis_cluster: RedisCluster,
) -> None:
    prefix = f"pt{time.monotonic_ns()}/"
    backend = _open({**redis_cluster.options, "key_prefix": prefix, "ttl_s": 60})
    keys = [f"p/{i}" for i in range(30)]
    assert backend.put(keys, [b"x" * (i + 1) for i in range(30)]) == [True] * 30
    seen = 0
    for node in redis_cluster.nodes:
        stored = node.command("KEYS", f"{prefix}p/*")
        assert isinstance(stored, list) and stored  # every node holds some
        for key in stored:
            pttl = node.command("PTTL", _text(key))
            assert isinstance(pttl, int) and 0 < pttl <= 60_000
        seen += len(stored)
    assert seen == 30
    assert sorted(backend.list_keys("p/")) == sorted((k, i + 1) for i, k in enumerate(keys))
    assert backend.delete([*keys[:10], "p/absent"]) == [True] * 10 + [False]
    assert backend.exists(keys) == [False] * 10 + [True] * 20
    backend.close()


def test_an_oom_reply_from_one_cluster_node_fails_only_its_keys(
    redis_cluster: RedisCluster,
) -> None:
    backend = _open(redis_cluster.options)
    keys = [f"oom/{time.monotonic_ns()}/{i}" for i in range(30)]
    backend.exists(keys)  # learn the map before the node fills up
    full = redis_cluster.nodes[1]
    full.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    full.command("CONFIG", "SET", "maxmemory", "1")
    try:
        saved = backend.put(keys, [b"v"] * 30)
    finally:
        full.command("CONFIG", "SET", "maxmemory", "0")
    on_full = [full.command("CLUSTER", "KEYSLOT", k) for k in keys]
    expected = [_owner(redis_cluster, int(str(s))) != 1 for s in on_full]
    assert saved == expected and 0 < sum(saved) < 30
    assert backend.exists(keys) == expected
    backend.close()


def test_threads_sharing_a_cluster_backend_with_small_pools_all_finish(
    redis_cluster: RedisCluster,
) -> None:
    # Two connections per node for eight threads: batches wait for each other's nodes, and
    # must neither deadlock nor read each other's replies.
    backend = _open({**redis_cluster.options, "max_connections": 2})
    problems: list[str] = []

    def work(t: int) -> None:
        try:
            for r in range(6):
                keys = [f"threads/{t}/{r}/{i}" for i in range(12)]
                values = [_value(t * 100 + r * 12 + i, 3000 + i) for i in range(12)]
                assert backend.put(keys, values) == [True] * 12
                bufs = [bytearray(3000 + i) for i in range(12)]
                assert backend.get(keys, bufs) == [True] * 12
                assert [bytes(b) for b in bufs] == values
        except BaseException as exc:
            problems.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not problems and not any(t.is_alive() for t in threads), problems
    backend.close()


def test_a_cluster_backend_used_before_a_fork_works_in_the_child_and_the_parent(
    redis_cluster: RedisCluster,
) -> None:
    backend = _open(redis_cluster.options)
    keys = [f"fork/{time.monotonic_ns()}/{i}" for i in range(24)]
    assert backend.put(keys, [b"parent"] * 24) == [True] * 24  # pooled connections now
    pid = os.fork()
    if pid == 0:  # the child must not read replies meant for the parent, nor hang on a lock
        code = 1
        try:
            bufs = [bytearray(6) for _ in keys]
            if backend.get(keys, bufs) == [True] * 24 and all(b == b"parent" for b in bufs):
                code = (
                    0
                    if backend.put([f"{k}/child" for k in keys], [b"c"] * 24) == [True] * 24
                    else 1
                )
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.exists([f"{k}/child" for k in keys]) == [True] * 24
    backend.close()


def test_a_hung_cluster_node_times_out_and_the_other_nodes_stay_in_step(
    redis_cluster: RedisCluster,
) -> None:
    backend = _open({**redis_cluster.options, "timeout_s": 0.3})
    keys = [f"hung/{time.monotonic_ns()}/{i}" for i in range(24)]
    assert backend.put(keys, [b"v%d" % i for i in range(24)]) == [True] * 24
    hung = redis_cluster.nodes[2]
    hung.pause()  # shorter than the node timeout: the cluster itself does not notice
    try:
        with pytest.raises(BackendUnavailable, match=f"{hung.port}: get timed out"):
            backend.get(keys, [bytearray(3) for _ in keys])
    finally:
        hung.resume()
    bufs = [bytearray(len(b"v%d" % i)) for i in range(24)]
    assert backend.get(keys, bufs) == [True] * 24
    assert [bytes(b) for b in bufs] == [b"v%d" % i for i in range(24)]
    backend.close()


def test_a_cluster_node_that_is_down_makes_batches_unavailable_until_it_returns(
    redis_cluster: RedisCluster,
) -> None:
    backend = _open({**redis_cluster.options, "connect_timeout_s": 0.5})
    keys = [f"down/{time.monotonic_ns()}/{i}" for i in range(24)]
    assert backend.put(keys, [b"v"] * 24) == [True] * 24
    dead = redis_cluster.nodes[2]
    redis_cluster.kill_node(2)
    try:
        with pytest.raises(BackendUnavailable, match=f"{dead.port}: cannot connect"):
            backend.exists(keys)
    finally:
        redis_cluster.restart_node(2)  # back empty, on the same port
    # The same backend object recovers: node 2's keys are gone, the others' are not.
    present = backend.exists(keys)
    assert 0 < sum(present) < 24
    assert backend.put(keys, [b"v"] * 24) == [True] * 24
    assert backend.exists(keys) == [True] * 24
    backend.close()


def test_a_rediss_cluster_url_reaches_every_node_over_tls(tmp_path: Path) -> None:
    """Skipped (even in CI) when openssl is missing or redis-server lacks TLS support."""
    require_or_skip(RedisCluster.available())
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make test certificates")
    files = _make_certificates(tmp_path)
    cluster = RedisCluster(3, node_timeout_ms=1000)
    tls_ports = []
    for node in cluster.nodes:
        tls_ports.append(free_port())
        node.extra_args += (
            *("--tls-port", str(tls_ports[-1]), "--tls-cluster", "yes"),
            *("--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"]),
            *("--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "no"),
            # The bus stays on port + 10000, the pair the dev server checked was free.
            *("--cluster-port", str(node.port + 10000)),
        )
    try:
        cluster.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower() or "cluster-port" in str(exc):
            pytest.skip(f"redis-server without TLS or cluster-port support: {exc}")
        raise
    try:
        # Only one node's TLS port is given: the others come from CLUSTER SLOTS, which
        # over TLS names their TLS ports.
        url = f"rediss+cluster://127.0.0.1:{tls_ports[1]}"
        backend = _open({"url": url, "tls_ca_file": files["ca.crt"]})
        keys = [f"tls/{i}" for i in range(24)]
        values = [_value(i, 100_000) for i in range(24)]
        assert backend.put(keys, values) == [True] * 24
        bufs = [bytearray(100_000) for _ in keys]
        assert backend.get(keys, bufs) == [True] * 24
        assert [bytes(b) for b in bufs] == values
        for node in cluster.nodes:
            assert node.command("DBSIZE") not in (0, None)
        backend.close()
        with pytest.raises(ConfigError, match="not trusted"):
            _open({"url": url})  # the system CAs do not know our throwaway CA
    finally:
        cluster.stop()


def test_a_cluster_url_scheme_implies_cluster_mode(redis_cluster: RedisCluster) -> None:
    host, port = "127.0.0.1", redis_cluster.ports[1]
    backend = _open({"url": f"redis+cluster://{host}:{port}"})
    assert "redis+cluster://" in repr(backend)
    keys = [f"scheme/{i}" for i in range(12)]
    assert backend.put(keys, [b"v"] * 12) == [True] * 12
    assert backend.exists(keys) == [True] * 12
    backend.close()


def test_the_single_server_client_aimed_at_a_cluster_node_says_to_use_cluster_mode(
    redis_cluster: RedisCluster,
) -> None:
    backend = _open({"url": f"redis://127.0.0.1:{redis_cluster.ports[0]}/0"})
    with pytest.raises(BackendError, match="cluster=True"):
        backend.put([f"moved/{i}" for i in range(12)], [b"v"] * 12)
    backend.close()


def test_runs_of_exists_replies_decode_around_errors_and_split_reads() -> None:
    from kvconn_redis._resp import ErrorReply, RespConnection

    replies = [b":1\r\n", b":0\r\n"] * 3000 + [b"-NOPERM no\r\n", b":1\r\n", b":0\r\n"] * 5
    expected = [True, False] * 3000 + ["NOPERM no", True, False] * 5
    ours, theirs = socket.socketpair()
    with ours, theirs:
        conn = RespConnection(ours, "socketpair", use_sendmsg=True)
        data = b"".join(replies)

        def deliver() -> None:
            # Odd-sized pieces, so runs break mid-reply at buffer refills.
            for i in range(0, len(data), 777):
                theirs.sendall(data[i : i + 777])

        sender = threading.Thread(target=deliver)
        sender.start()
        got = conn.read_flags(len(replies))
        sender.join()
    decoded = [r.message if isinstance(r, ErrorReply) else r for r in got]
    assert decoded == expected


def test_a_retired_pool_serves_callers_but_keeps_no_connection_open() -> None:
    from kvconn_redis._resp import ConnectionPool

    class Conn:
        def __init__(self) -> None:
            self.pid = os.getpid()
            self.closed = False

        def close(self) -> None:
            self.closed = True

    made: list[Conn] = []

    def connect() -> Any:
        made.append(Conn())
        return made[-1]

    pool = ConnectionPool(connect, 4, 1.0, "test")
    idle: Any
    busy: Any
    late: Any
    idle, _ = pool.acquire()
    busy, _ = pool.acquire()
    pool.release(idle)
    pool.retire()
    assert idle.closed and not busy.closed  # the idle one at once; the busy one is in use
    pool.release(busy)
    assert busy.closed
    late, reused = pool.acquire()  # a batch routed by an older map is still served
    assert not reused and not late.closed
    pool.release(late)
    assert late.closed and len(made) == 3


# ---------------------------------------------------------------- second review
def _raw_command(sock: socket.socket, *args: bytes) -> bytes:
    sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
    return sock.recv(1000)


@pytest.mark.parametrize("password", [None, "s3cret"])
def test_a_server_at_its_client_limit_is_unavailable_not_misconfigured(
    password: str | None,
) -> None:
    """``-ERR max number of clients reached`` is sent on accept and goes away when other
    clients leave: the same "may come up later" case as a server that is down. It must
    neither stop start-up (a BackendError escaping the constructor, or a ConfigError
    when a password makes the first reply a handshake reply) nor read as a permanent
    error later."""
    require_or_skip(RedisServer.available())
    with RedisServer(password=password) as server:
        holder = socket.create_connection(("127.0.0.1", server.port))
        with holder:
            if password is not None:
                assert _raw_command(holder, b"AUTH", password.encode()) == b"+OK\r\n"
            assert _raw_command(holder, b"CONFIG", b"SET", b"maxclients", b"1") == b"+OK\r\n"
            try:
                backend = _open({**server.options, "timeout_s": 2.0})  # must not raise
                with pytest.raises(BackendUnavailable):
                    backend.exists(["full/a"])
            finally:
                _raw_command(holder, b"CONFIG", b"SET", b"maxclients", b"1000")
        assert backend.put(["full/a"], [b"x"]) == [True]
        backend.close()


def test_a_cluster_that_requires_a_password_given_none_is_a_configuration_error() -> None:
    """The single-server client turns NOAUTH into a ConfigError at start-up; in cluster
    mode the NOAUTH reply to CLUSTER SLOTS must do the same, not read as an outage that
    only logs a warning and makes every later call BackendUnavailable."""
    require_or_skip(RedisCluster.available())
    cluster = RedisCluster(3).start()
    try:
        for node in cluster.nodes:
            node.command("CONFIG", "SET", "requirepass", "clu-pass")
            node.password = "clu-pass"
        with pytest.raises(ConfigError, match="NOAUTH"):
            _open(cluster.options)
        backend = _open({**cluster.options, "password": "clu-pass"})
        assert backend.put(["auth/a"], [b"x"]) == [True]
        backend.close()
    finally:
        cluster.stop()


def test_closing_an_inherited_backend_in_a_forked_child_never_hangs_on_the_parents_lock(
    redis_server: RedisServer,
) -> None:
    """A serving process's threads take the pool's lock on every batch; a child forked
    while one of them held it inherits a lock nobody will release. ``acquire`` replaces
    it after a fork, but ``close`` (and ``retire``) take it first and hang forever."""
    backend = _open(redis_server.options)
    assert backend.exists(["fork-close/a"]) == [False]  # a pooled connection now
    pool = backend._client._node.pool  # type: ignore[attr-defined]
    held, forked = threading.Event(), threading.Event()

    def hold() -> None:  # a parent thread in the middle of acquire/release
        with pool._cond:
            held.set()
            forked.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    pid = os.fork()
    if pid == 0:
        try:
            backend.close()
        finally:
            os._exit(0)
    forked.set()
    thread.join()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("close() in the forked child hung on a lock a parent thread held")
    assert backend.exists(["fork-close/a"]) == [False]  # the parent is unaffected
    backend.close()
