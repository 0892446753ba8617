"""The Redis backend against real redis-server processes: one server and a 3-node cluster.

Every server here is started by the tests on a free loopback port and stopped at the
end; a missing redis-server skips locally and fails in CI (``require_or_skip``).
"""

from __future__ import annotations

import os
import shutil
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
from kvconn.devserver._ports import free_port
from kvconn.devserver.redis import RedisCluster, RedisServer
from kvconn.errors import BackendError, BackendUnavailable, ConfigError
from kvconn.registry import load_backend
from kvconn.testing import BackendTests
from kvconn.testing.suite import require_or_skip

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
def test_cluster_batches_spread_keys_across_nodes_in_one_round_trip_per_node(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.connection import AbstractConnection

    backend = _open(redis_cluster.options)
    # Learn the slot map and open a connection to every node outside the counted
    # calls: a new redis-py connection spends round trips of its own on setup.
    backend.exists([f"warm-up/{i}" for i in range(48)])
    sends: Counter[int] = Counter()
    original = AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sends[self.port] += 1
        original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    prefix = f"spread/{time.monotonic_ns()}"
    keys = [f"{prefix}/{i}" for i in range(48)]
    values = [_value(i, 4096) for i in range(48)]
    for op in ("put", "exists", "get"):
        sends.clear()
        if op == "put":
            assert backend.put(keys, values) == [True] * 48
        elif op == "exists":
            assert backend.exists(keys) == [True] * 48
        else:
            bufs = [bytearray(4096) for _ in keys]
            assert backend.get(keys, bufs) == [True] * 48
            assert [bytes(b) for b in bufs] == values
        assert sends == {port: 1 for port in redis_cluster.ports}, op
    for node in redis_cluster.nodes:
        stored = node.command("KEYS", f"{prefix}/*")
        assert isinstance(stored, list) and len(stored) >= 5
    backend.close()


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
