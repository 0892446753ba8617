"""The Redis backend against real redis-server processes: one server and a 3-node cluster.

Every server here is started by the tests on a free loopback port and stopped at the
end; a missing redis-server skips locally and fails in CI (``require_or_skip``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from redis.connection import AbstractConnection
from redis.crc import key_slot

from kvconn.backend import Backend, ReadStatus
from kvconn.errors import BackendDependencyMissing, BackendError, BackendUnavailable, ConfigError
from kvconn.keys import key_prefix
from kvconn.registry import load_backend
from kvconn.testing import BackendTests, ExactReadStatusTests
from kvconn.testing.suite import require_or_skip
from kvconn.tools.devserver._ports import free_port
from kvconn.tools.devserver.redis import RedisCluster, RedisServer

pytestmark = pytest.mark.server


# ---------------------------------------------------------------- servers
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


class _PausedWrites:
    """write_stall: ``CLIENT PAUSE … WRITE`` on every node; reads are still answered.

    A paused server parks each write command it receives, and counts the connections
    waiting so as ``blocked_clients``, until ``CLIENT UNPAUSE``.
    """

    def __init__(self, *nodes: RedisServer) -> None:
        self.nodes = nodes

    def hold(self) -> None:
        for node in self.nodes:
            node.command("CLIENT", "PAUSE", 60_000, "WRITE")

    def holding(self) -> int:
        return sum(_blocked_clients(node) for node in self.nodes)

    def release(self) -> None:
        for node in self.nodes:
            node.command("CLIENT", "UNPAUSE")


def _blocked_clients(node: RedisServer) -> int:
    reply = node.command("INFO", "clients")
    assert isinstance(reply, bytes)
    return int(reply.split(b"blocked_clients:")[1].split()[0])


def _open(options: dict[str, Any]) -> Backend:
    return load_backend("redis", options)


# ---------------------------------------------------------------- conformance
# Redis answers for every key it is asked about (an unreachable server raises)
class TestRedisConformance(BackendTests, ExactReadStatusTests):
    backend_name = "redis"
    # The held puts must outlast the test's look at the server on a busy machine.
    held_call_options: ClassVar[dict[str, Any]] = {"timeout_s": 60.0}

    @pytest.fixture
    def backend_options(self, redis_server: RedisServer) -> dict[str, Any]:
        return {**redis_server.options, "timeout_s": 2.0}

    @pytest.fixture
    def server_control(self, redis_server: RedisServer) -> _RestartServer:
        return _RestartServer(redis_server)

    @pytest.fixture
    def write_stall(self, redis_server: RedisServer) -> _PausedWrites:
        return _PausedWrites(redis_server)


class TestRedisClusterConformance(BackendTests, ExactReadStatusTests):
    backend_name = "redis"
    held_call_options: ClassVar[dict[str, Any]] = {"timeout_s": 60.0}

    @pytest.fixture
    def backend_options(self, redis_cluster: RedisCluster) -> dict[str, Any]:
        return {**redis_cluster.options, "timeout_s": 2.0}

    @pytest.fixture
    def server_control(self, redis_cluster: RedisCluster) -> _RestartCluster:
        return _RestartCluster(redis_cluster)

    @pytest.fixture
    def write_stall(self, redis_cluster: RedisCluster) -> _PausedWrites:
        return _PausedWrites(*redis_cluster.nodes)


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
    """The TTL is checked as a range of the server's PTTL, and expiry with a 1 ms TTL, so
    nothing depends on how fast the machine is (a 250 ms TTL could lapse before PTTL
    was even asked on a loaded machine)."""
    hourly = _open({**redis_server.options, "ttl_s": 3600.25, "key_prefix": "ttl/"})
    brief = _open({**redis_server.options, "ttl_s": 0.001, "key_prefix": "ttl/"})
    lasting = _open({**redis_server.options, "key_prefix": "ttl/"})
    assert hourly.put(["hour"], [b"page"]) == [True]
    assert lasting.put(["long"], [b"page"]) == [True]
    pttl = redis_server.command("PTTL", "ttl/hour")
    # milliseconds, fraction included; the lower bound only rules out a wrong unit
    assert isinstance(pttl, int) and 3_600_250 // 2 < pttl <= 3_600_250
    assert redis_server.command("PTTL", "ttl/long") == -1
    assert brief.put(["short"], [b"page"]) == [True]
    deadline = time.monotonic() + 30
    while lasting.exists(["short"]) != [False]:
        assert time.monotonic() < deadline, "a page with a 1 ms TTL never expired"
        time.sleep(0.01)
    assert lasting.exists(["short", "long", "hour"]) == [False, True, True]
    assert brief.get(["short"], [bytearray(4)]) == [False]
    for backend in (hourly, brief, lasting):
        backend.close()


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
    run("req", *ec, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=kvconn client")
    run(
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "client.crt",
        "-days",
        "1",
    )
    names = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    return {name: str(directory / name) for name in names}


@contextlib.contextmanager
def _tls_server(
    directory: Path, *, auth_clients: bool
) -> Iterator[tuple[RedisServer, int, dict[str, str]]]:
    """A redis-server with a plain port and a TLS port; skipped without openssl or TLS."""
    require_or_skip(RedisServer.available())
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make test certificates")
    files = _make_certificates(directory)
    tls_port = free_port()
    server = RedisServer(
        extra_args=[
            *("--tls-port", str(tls_port), "--tls-ca-cert-file", files["ca.crt"]),
            *("--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"]),
            *("--tls-auth-clients", "yes" if auth_clients else "no"),
        ]
    )
    try:
        server.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"redis-server without TLS support: {exc}")
        raise
    try:
        yield server, tls_port, files
    finally:
        server.stop()


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


def test_a_tls_server_that_wants_a_client_certificate_none_was_given_is_refused_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 15: the backend started with a warning, then every call failed with "Error 8
    while writing to socket", served as misses."""
    with _tls_server(tmp_path, auth_clients=True) as (_, tls_port, files):
        url = f"rediss://127.0.0.1:{tls_port}/0"
        with pytest.raises(
            ConfigError,
            match=r"requires a TLS client certificate and none is configured .*"
            r"CERTIFICATE_REQUIRED.*set tls_cert_file and tls_key_file",
        ):
            _open({"url": url, "tls_ca_file": files["ca.crt"]})
        certified = _open(
            {
                "url": url,
                "tls_ca_file": files["ca.crt"],
                "tls_cert_file": files["client.crt"],
                "tls_key_file": files["client.key"],
            }
        )
        assert certified.put(["tls/cert"], [b"x"]) == [True]
        certified.close()
    assert "calls will fail" not in caplog.text


def test_a_url_whose_scheme_does_not_match_the_ports_transport_is_refused_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 15: ``redis://`` at a TLS port was "Connection reset by peer" on every call;
    ``rediss://`` at a plain port a handshake timing out on every call."""
    with _tls_server(tmp_path, auth_clients=False) as (server, tls_port, files):
        with pytest.raises(ConfigError, match=rf"speaks TLS on port {tls_port}.*use a rediss://"):
            _open({"url": f"redis://127.0.0.1:{tls_port}/0"})
        with pytest.raises(
            ConfigError, match=rf"speaks plain TCP on port {server.port}, not TLS; use a redis://"
        ):
            _open(
                {
                    "url": f"rediss://127.0.0.1:{server.port}/0",
                    "tls_ca_file": files["ca.crt"],
                    "timeout_s": 1.0,
                }
            )
    assert "calls will fail" not in caplog.text


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
    # The user may write mid/ok/* only: the middle key of the put is refused (NOPERM).
    redis_server.command("ACL", "SETUSER", "kvmid", "on", ">mid-pass", "~mid/ok/*", "+@all")
    try:
        options = {**redis_server.options, "username": "kvmid", "password": "mid-pass"}
        backend = _open({**options, "max_connections": 1})
        with pytest.raises(BackendError, match=r"NOPERM.*'kvmid'"):
            backend.put(["mid/ok/a", "mid/no/b", "mid/ok/c"], [b"aaa", b"bbb", b"ccc"])
        # The one pooled connection read all three replies: the next batch is in step.
        assert backend.exists(["mid/ok/zz", "mid/ok/c", "mid/ok/a"]) == [False, True, True]
        buf = bytearray(3)
        assert backend.get(["mid/ok/c"], [buf]) == [True] and buf == b"ccc"
        backend.close()
    finally:
        redis_server.command("ACL", "DELUSER", "kvmid")


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_a_key_that_holds_no_string_fails_as_unreadable_and_the_rest_of_the_batch_loads(
    cluster: bool, request: pytest.FixtureRequest
) -> None:
    """A list under a page's key is stored but can never load: ``WRONG_SIZE``, so the
    connector deletes it and the next save writes the page. Borrowed, it is an empty
    view (stored, never a page), not ``None`` (absent), for the same reason."""
    store: Any = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"wrongtype/{time.monotonic_ns()}/"
    backend = _open({**store.options, "key_prefix": prefix})
    backend.put(["a", "c"], [b"aaa", b"ccc"])
    raw = redis.Redis(port=_node_for(store, prefix + "b").port)
    raw.lpush(prefix + "b", "not a page")
    raw.close()
    bufs = [bytearray(b"\xee" * 3) for _ in range(3)]
    assert backend.get(["a", "b", "c"], bufs) == [True, False, True]
    assert bufs == [b"aaa", b"\xee" * 3, b"ccc"]
    bufs = [bytearray(b"\xee" * 3) for _ in range(3)]
    assert backend.read(["a", "b", "c"], bufs, scratch=True) == [
        ReadStatus.LOADED,
        ReadStatus.WRONG_SIZE,
        ReadStatus.LOADED,
    ]
    assert bufs == [b"aaa", b"\xee" * 3, b"ccc"]
    with backend.borrow(["a", "b", "c", "absent"]) as views:
        assert [None if v is None else bytes(v) for v in views] == [b"aaa", b"", b"ccc", None]
    backend.close()


def _node_for(store: Any, key: str) -> RedisServer:
    """The server that holds ``key``: the server itself, or the cluster node of its slot."""
    if isinstance(store, RedisServer):
        return store
    slot = store.nodes[0].command("CLUSTER", "KEYSLOT", key)
    return store.nodes[_owner(store, int(str(slot)))]  # type: ignore[no-any-return]


def _commands(data: bytes) -> tuple[list[list[bytes]], bytes]:
    """The complete RESP commands at the start of ``data``, and the rest."""
    commands: list[list[bytes]] = []
    while data.startswith(b"*") and b"\r\n" in data:
        head, rest = data.split(b"\r\n", 1)
        args: list[bytes] = []
        for _ in range(int(head[1:])):
            if b"\r\n" not in rest:
                return commands, data
            length_line, rest = rest.split(b"\r\n", 1)
            length = int(length_line[1:])
            if len(rest) < length + 2:
                return commands, data
            args.append(rest[:length])
            rest = rest[length + 2 :]
        commands.append(args)
        data = rest
    return commands, data


class _TruncatingServer:
    """A fake Redis that cuts its first MGET reply off mid-value, then answers properly."""

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
                pending = b""
                while data := conn.recv(65536):
                    commands, pending = _commands(pending + data)
                    for command in commands:
                        name = command[0].upper()
                        if name == b"MGET" and not truncated:
                            truncated = True
                            conn.sendall(b"*1\r\n$6\r\nabc")  # half a value, then hang up
                            break
                        conn.sendall(_FAKE_REPLIES.get(name, b"+OK\r\n"))
                    else:
                        continue
                    break

    def close(self) -> None:
        # Closing alone does not wake an accept() blocked in another thread on Linux;
        # shutting the listener down does.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=5)


_FAKE_REPLIES = {
    b"PING": b"+PONG\r\n",
    b"INFO": b"$0\r\n\r\n",
    b"SET": b"$-1\r\n",
    b"GET": b"$-1\r\n",
    b"EXISTS": b":0\r\n",
    b"MGET": b"*1\r\n$6\r\nabcdef\r\n",
}


def test_a_reply_cut_off_mid_value_is_an_error_and_the_connection_is_dropped() -> None:
    server = _TruncatingServer()
    try:
        backend = _open({"url": f"redis://127.0.0.1:{server.port}/0", "timeout_s": 2.0})
        with pytest.raises(BackendUnavailable, match=r"get failed: .*closed"):
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


class _Sends:
    """Every request redis-py writes, and when replies are read: (kind, port, parts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int, list[Any]]] = []
        send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response
        events = self.events

        def spied_send(conn: Any, command: Any, *args: Any, **kwargs: Any) -> None:
            parts = [command] if isinstance(command, (bytes, str)) else list(command)
            events.append(("send", getattr(conn, "port", 0), parts))
            send(conn, command, *args, **kwargs)

        def spied_read(conn: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(("read", getattr(conn, "port", 0), []))
            return read(conn, *args, **kwargs)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", spied_send)
        monkeypatch.setattr(AbstractConnection, "read_response", spied_read)

    def sends(self) -> Counter[int]:
        return Counter(port for kind, port, _ in self.events if kind == "send")

    def sent_objects(self) -> set[int]:
        """Whose memory the requests' memoryviews point at (ids of the owners)."""
        return {
            id(part.obj)
            for kind, _, parts in self.events
            if kind == "send"
            for part in parts
            if isinstance(part, memoryview)
        }


def test_each_batch_is_one_request_and_values_go_out_from_the_callers_memory(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _open(redis_server.options)
    backend.exists(["rtt/warm-up"])  # a pooled connection: no handshake in the counts
    spy = _Sends(monkeypatch)
    keys = [f"rtt/{i}" for i in range(64)]
    values = [bytearray(_value(i, 256 * 1024)) for i in range(64)]
    backend.put(keys, values)
    # Every page went out as a view of the caller's buffer: no join, no copy.
    assert spy.sent_objects() >= {id(v) for v in values}
    backend.exists(keys)
    bufs = [bytearray(256 * 1024) for _ in keys]
    assert backend.get(keys, bufs) == [True] * 64
    assert bufs == values
    assert sum(spy.sends().values()) == 3
    backend.close()


def test_a_batch_of_a_thousand_values_arrives_whole(redis_server: RedisServer) -> None:
    backend = _open({**redis_server.options, "key_prefix": "iov/"})
    count, size = 1100, 20 * 1024
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
    backend = _open(redis_cluster.options)
    # Learn the slot map and open a connection to every node outside the counted calls.
    backend.exists([f"warm-up/{i}" for i in range(48)])
    spy = _Sends(monkeypatch)
    prefix = f"spread/{time.monotonic_ns()}"
    keys = [f"{prefix}/{i}" for i in range(48)]
    values = [bytearray(_value(i, 70_000)) for i in range(48)]  # sent as they are
    for op in ("put", "exists", "get"):
        spy.events.clear()
        if op == "put":
            assert backend.put(keys, values) == [True] * 48
            assert spy.sent_objects() >= {id(v) for v in values}
        elif op == "exists":
            assert backend.exists(keys) == [True] * 48
        else:
            bufs = [bytearray(70_000) for _ in keys]
            assert backend.get(keys, bufs) == [True] * 48
            assert bufs == values
        assert spy.sends() == {port: 1 for port in redis_cluster.ports}, op
        # Every node's request went out before any reply was read: the round trips overlap.
        kinds = [kind for kind, _, _ in spy.events]
        assert kinds.index("read") > len(kinds) - 1 - kinds[::-1].index("send"), op
    for node in redis_cluster.nodes:
        stored = node.command("KEYS", f"{prefix}/*")
        assert isinstance(stored, list) and len(stored) >= 5
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


def test_keys_of_a_slot_moved_after_the_map_was_learned_are_followed_to_the_new_owner(
    own_cluster: RedisCluster,
) -> None:
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

    assert backend.exists(keys) == [True] * 4 + [False] * 4  # MOVED, then the new owner
    bufs = [bytearray(70_000) for _ in range(4)]
    assert backend.get(keys[:4], bufs) == [True] * 4
    assert [bytes(b) for b in bufs] == values[:4]
    assert backend.put(keys[4:], values[4:]) == [True] * 4
    assert own_cluster.nodes[target].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 8
    assert own_cluster.nodes[source].command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    backend.close()


def test_keys_of_a_slot_half_way_through_a_migration_follow_ask_to_the_importing_node(
    own_cluster: RedisCluster,
) -> None:
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

    assert backend.exists(keys) == [True] * 4 + [False] * 4
    bufs = [bytearray(50_000) for _ in range(4)]
    assert backend.get(keys[:4], bufs) == [True] * 4
    assert [bytes(b) for b in bufs] == values[:4]
    assert backend.put(keys[2:], values[2:]) == [True] * 6  # 2-3 exist at the source
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


def _slots_of(cluster: RedisCluster, node: int) -> list[int]:
    ranges: Any = cluster.nodes[0].command("CLUSTER", "SLOTS")
    return [
        slot
        for first, last, primary, *_ in ranges
        if primary[1] == cluster.ports[node]
        for slot in range(first, last + 1)
    ]


def _hand_over_empty_slots(
    cluster: RedisCluster, slots: list[int], source: int, target: int
) -> None:
    """Give ``source``'s ``slots`` (holding no keys) to ``target``, telling every node.

    One slot goes through IMPORTING first: the target then takes a new configuration
    epoch when it is told it owns it, so a ping the source sent before it was told (still
    claiming the slots, under its older epoch) cannot give them back to it.
    """
    _begin_migration(cluster, slots[0], source, target)
    target_id = _text(cluster.nodes[target].command("CLUSTER", "MYID"))
    # An emptied master would otherwise turn itself into a replica of the new owner as
    # soon as gossip tells it, refusing the SETSLOTs still on their way to it.
    cluster.nodes[source].command("CONFIG", "SET", "cluster-allow-replica-migration", "no")
    for node in (target, source, *(i for i in range(3) if i not in (source, target))):
        replies = _pipelined(
            cluster.ports[node], [["CLUSTER", "SETSLOT", s, "NODE", target_id] for s in slots]
        )
        assert set(replies) == {b"+OK"}, set(replies)


def _keys_in(slots: set[int], count: int, tag: str) -> list[str]:
    keys = (f"{tag}/{i}" for i in range(100_000))
    return [k for k in keys if key_slot(k.encode()) in slots][:count]


def test_a_connection_another_thread_had_out_when_its_node_left_the_map_is_closed_on_return(
    own_cluster: RedisCluster,
) -> None:
    """The node table changes while a batch routed by the old one is still on the node.

    That batch's connection is in use when the batch that sees the new table closes the
    departed node's idle ones; it must be closed once it comes back, not left open for
    the life of the process (redis-py marks it for reconnection only when the departed
    node happens to be the one it re-read the map from).
    """
    backend = _open({**own_cluster.options, "timeout_s": 60.0})
    source, target = 2, 1  # not node 0: that is the seed the map is read from
    slots = _slots_of(own_cluster, source)
    leaving = _keys_in(set(slots), 40, "retire")
    assert backend.exists([f"warm-up/{i}" for i in range(48)]) == [False] * 48  # every node
    held: list[object] = []
    writes = _PausedWrites(own_cluster.nodes[source])
    writes.hold()
    try:
        # A put to the leaving node, parked there: its connection stays out until released.
        putter = threading.Thread(target=lambda: held.append(backend.put(leaving[:1], [b"held"])))
        putter.start()
        deadline = time.monotonic() + 30
        while writes.holding() < 1:
            assert putter.is_alive() and time.monotonic() < deadline, held
            time.sleep(0.005)
        _hand_over_empty_slots(own_cluster, slots, source, target)  # none holds a key yet
        # Reads are not paused: MOVED replies make this batch read the new map, without
        # the source node, and close the source node's idle connections.
        assert backend.exists(leaving[1:]) == [False] * 39
        assert putter.is_alive()
        assert _client_connections(own_cluster.nodes[source], settle=1) == 1  # the held one
    finally:
        writes.release()
    putter.join(timeout=60)
    assert held == [[True]]  # MOVED on release: stored where the slot went
    assert own_cluster.nodes[target].command("GET", leaving[0]) == b"held"
    assert _client_connections(own_cluster.nodes[source], settle=0) == 0
    buf = bytearray(4)
    assert backend.get(leaving[:1], [buf]) == [True] and buf == b"held"
    assert _client_connections(own_cluster.nodes[source], settle=0) == 0
    backend.close()


def test_threads_get_right_answers_while_a_node_hands_all_its_slots_over(
    own_cluster: RedisCluster,
) -> None:
    """MOVED, ASK and re-reads of the slot map, raced by batches from several threads.

    The keys read are moved while threads read them (ASK, then MOVED); the keys written
    stay on the other nodes, since a key created mid-migration on the leaving node would
    not be in the MIGRATE list. Every answer must be right and no call may fail, and the
    node that left ends with no connection from the backend.
    """
    backend = _open({**own_cluster.options, "timeout_s": 30.0})
    source, target = 2, 1
    slots = _slots_of(own_cluster, source)
    moving = _keys_in(set(slots), 30, "moving")
    staying_slots = set(range(16384)) - set(slots)
    values = [_value(i, 3000 + 100 * i) for i in range(len(moving))]
    assert backend.put(moving, values) == [True] * len(moving)
    done = threading.Event()
    problems: list[str] = []
    rounds = [0] * 4
    finish_at: dict[int, int] = {}  # each thread's last round: a few after the move

    def work(t: int) -> None:
        try:
            r = 0
            while not done.is_set() or r < finish_at.get(t, 0):
                own = _keys_in(staying_slots, 12, f"stay/{t}/{r}")
                own_values = [_value(t * 1000 + r * 12 + i, 2000 + i) for i in range(12)]
                assert backend.put(own, own_values) == [True] * 12
                batch = own + moving
                expected = own_values + values
                assert backend.exists(batch) == [True] * len(batch)
                bufs = [bytearray(len(v)) for v in expected]
                assert backend.get(batch, bufs, scratch=r % 2 == 0) == [True] * len(batch)
                assert [bytes(b) for b in bufs] == expected, f"round {r}: a value crossed"
                r += 1
                rounds[t] = r
        except BaseException as exc:
            problems.append(f"thread {t}: {exc!r}\n{traceback.format_exc()}")

    workers = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for worker in workers:
        worker.start()
    try:
        by_slot: dict[int, list[str]] = {}
        for key in moving:
            by_slot.setdefault(key_slot(key.encode()), []).append(key)
        for slot, slot_keys in by_slot.items():
            _begin_migration(own_cluster, slot, source, target)
            _move_keys(own_cluster, source, target, slot_keys)
        _hand_over_empty_slots(own_cluster, slots, source, target)
        finish_at.update({t: r + 3 for t, r in enumerate(rounds)})
    finally:
        done.set()
        for worker in workers:
            worker.join(timeout=120)
    assert not problems, problems
    assert not any(w.is_alive() for w in workers)
    assert own_cluster.nodes[source].command("DBSIZE") == 0
    # Connections to the node that left are closed by later batches once their pool is
    # retired (test_connections_to_a_node_that_left_the_slot_map_are_closed); under this
    # storm of MOVEDs from four threads, redis-py may still open one to it for a re-read
    # of the map after the last batch, so here they are only required gone at close.
    backend.close()
    assert _client_connections(own_cluster.nodes[source], settle=0) == 0


def test_closing_a_cluster_backend_closes_its_connections_and_a_late_call_opens_none(
    own_cluster: RedisCluster,
) -> None:
    """close() leaves no connection open, and a call already past the backend's closed
    check when it ran must not build a new cluster client, which nothing would close.

    (redis-py's ``RedisCluster.close`` leaves the node pools it was given open.)
    """
    backend: Any = _open(own_cluster.options)
    assert backend.exists([f"close/{i}" for i in range(48)]) == [False] * 48  # every node
    assert all(_client_connections(node) >= 1 for node in own_cluster.nodes)
    client = backend._client  # where a call goes once past RedisBackend's check
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        client.exists(["late/call"])
    assert client._cluster is None
    assert [_client_connections(node, settle=0) for node in own_cluster.nodes] == [0, 0, 0]


def test_cluster_mode_aimed_at_a_plain_server_is_a_configuration_error(
    redis_server: RedisServer,
) -> None:
    with pytest.raises(ConfigError, match="not a Redis Cluster node"):
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
        with pytest.raises(BackendUnavailable, match=r"get timed out after 0\.3 s"):
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
        with pytest.raises(BackendUnavailable, match=f"cannot connect .*:{dead.port}"):
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
    with pytest.raises(ConfigError, match="cluster=True"):
        _open({"url": f"redis://127.0.0.1:{redis_cluster.ports[0]}/0"})


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


def test_a_backend_forked_while_other_threads_use_it_works_and_closes_in_the_child(
    redis_server: RedisServer,
) -> None:
    """A serving process's threads hold the pool's locks and connections all the time; a
    child forked meanwhile must neither read their replies nor hang on their locks."""
    backend = _open(redis_server.options)
    assert backend.put(["fork-close/a"], [b"parent"]) == [True]
    stop = threading.Event()
    problems: list[BaseException] = []

    def busy() -> None:
        while not stop.is_set():
            try:
                assert backend.exists(["fork-close/a"] * 16) == [True] * 16
            except BaseException as exc:
                problems.append(exc)
                return

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(8):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    buf = bytearray(6)
                    if backend.get(["fork-close/a"], [buf]) == [True] and buf == b"parent":
                        backend.close()
                        code = 0
                finally:
                    os._exit(code)
            deadline = time.monotonic() + 10.0
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pytest.fail("the forked child hung using or closing the inherited backend")
                time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
    assert not problems, problems
    assert backend.exists(["fork-close/a"]) == [True]  # the parent is unaffected
    backend.close()


# ---------------------------------------------------------------- issue 11 and 12
class _DripProxy:
    """A TCP proxy to a real server that, while ``drip`` is set, forwards the server's
    replies one byte every ``interval_s`` — a server that is alive but crawls."""

    def __init__(self, port: int, interval_s: float = 0.3) -> None:
        self.target = port
        self.interval_s = interval_s
        self.drip = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                while data and replies and self.drip.is_set():
                    sink.sendall(data[:1])
                    data = data[1:]
                    time.sleep(self.interval_s)
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def test_a_server_that_trickles_its_replies_cannot_stretch_a_call_past_timeout_s(
    redis_server: RedisServer,
) -> None:
    """Issue 11: ``timeout_s`` bounded each socket read, so a reply trickling in one byte
    every 0.3 s kept a call waiting for the whole reply (25 s with ``timeout_s=1``)."""
    value = _value(7, 200)  # 200 bytes: a minute of trickle
    seed = _open(redis_server.options)
    seed.put(["drip/a"], [value])
    seed.close()
    proxy = _DripProxy(redis_server.port)
    try:
        backend = _open({"url": f"redis://127.0.0.1:{proxy.port}/0", "timeout_s": 1.0})
        proxy.drip.set()
        calls = {
            "get": lambda: backend.get(["drip/a"], [bytearray(200)]),
            "exists": lambda: backend.exists(["drip/a"] * 50),
            "put": lambda: backend.put([f"drip/new/{i}" for i in range(50)], [b"v"] * 50),
        }
        for op, call in calls.items():
            started = time.monotonic()
            with pytest.raises(BackendUnavailable, match=f"{op} timed out after 1 s"):
                call()
            assert time.monotonic() - started < 2.5, op  # ends near timeout_s, not minutes
        proxy.drip.clear()
        # The connections whose replies were cut short were dropped, not pooled: these
        # calls read their own replies, not the rest of the old ones.
        buf = bytearray(200)
        assert backend.get(["drip/a"], [buf]) == [True] and buf == value
        assert backend.exists(["drip/zz", "drip/a"]) == [False, True]
        backend.close()
    finally:
        proxy.close()


def _shown(exc: BaseException) -> str:
    """Everything an exception would print: its text, repr and whole traceback chain."""
    return str(exc) + repr(exc) + "".join(traceback.format_exception(exc))


def test_no_error_repr_or_log_line_of_the_backend_shows_a_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_or_skip(RedisServer.available())
    secret, wrong = f"right-{uuid.uuid4().hex}", f"wrong-{uuid.uuid4().hex}"
    caplog.set_level(logging.DEBUG)  # every logger, redis-py's own debug lines too
    shown: list[str] = []
    bad_urls = [
        f"http://:{wrong}@127.0.0.1:1/0",
        f"redis://:{wrong}@",
        f"unix://:{wrong}@relative.sock",
        f"redis://alice:{wrong}@127.0.0.1:0/0",
        f"redis://:{wrong}@127.0.0.1:1/x",
    ]
    for url in bad_urls:
        with pytest.raises(ConfigError) as bad:
            _open({"url": url})
        shown.append(_shown(bad.value))
    down: Any = _open({"url": f"redis://alice:{wrong}@127.0.0.1:{free_port()}/0"})
    shown += [repr(down), repr(down.config), str(down.config), down.where]
    with pytest.raises(BackendUnavailable) as unreachable:
        down.exists(["k"])
    shown.append(_shown(unreachable.value))
    down.close()
    with RedisServer(password=secret) as server:
        for options in (
            {"url": f"redis://:{wrong}@127.0.0.1:{server.port}/0"},
            {"url": server.url, "password": wrong},
            {"url": server.url, "username": "nobody", "password": wrong},
        ):
            with pytest.raises(ConfigError) as refused:
                _open(options)
            shown.append(_shown(refused.value))
        good: Any = _open({"url": f"redis://:{secret}@127.0.0.1:{server.port}/0"})
        assert good.put(["redact/a"], [b"x"]) == [True]
        shown += [repr(good), repr(good.config), str(good.config), good.where]
        good.close()
    for text in [*shown, caplog.text]:
        assert secret not in text and wrong not in text, text


def test_listing_skips_keys_other_programs_wrote_outside_kvconns_alphabet(
    redis_server: RedisServer,
) -> None:
    """Issue 11: ``kvconn inspect`` died with UnicodeDecodeError on such keys."""
    prefix = f"foreign{time.monotonic_ns()}/"
    backend = _open({**redis_server.options, "key_prefix": prefix})
    assert backend.put(["a/1", "a/2"], [b"x", b"yy"]) == [True, True]
    raw = redis.Redis(port=redis_server.port)
    raw.set(prefix.encode() + b"a/\xff\xfe", b"binary, not UTF-8")
    raw.set(f"{prefix}a/caf\u00e9".encode(), b"UTF-8, not ASCII")
    raw.set(f"{prefix}a/with space", b"printable, but no key of ours")
    raw.lpush(f"{prefix}a/list", b"not a string")
    raw.close()
    assert sorted(backend.list_keys("a/")) == [("a/1", 1), ("a/2", 2)]
    backend.close()
    everything = _open(redis_server.options)  # no prefix: the whole keyspace
    assert (f"{prefix}a/2", 2) in set(everything.list_keys(""))
    everything.close()


def test_a_user_who_may_not_write_or_read_is_refused_at_start_up(
    redis_server: RedisServer,
) -> None:
    """Issue 11: such a user only produced warnings; every save then failed."""
    users = {
        "kvread": ["~*", "+@read", "+ping"],
        "kvwrite": ["~*", "+set", "+exists", "+ping"],
        "kvother": ["~other/*", "+@all"],
    }
    for user, rules in users.items():
        redis_server.command("ACL", "SETUSER", user, "reset", "on", ">pass", *rules)
    try:
        options = {**redis_server.options, "password": "pass"}
        with pytest.raises(ConfigError, match="user 'kvread' has no permission for the SET"):
            _open({**options, "username": "kvread"})
        with pytest.raises(ConfigError, match="user 'kvwrite' has no permission for the GET"):
            _open({**options, "username": "kvwrite"})
        with pytest.raises(
            ConfigError, match="'kvother' has no permission for keys under key_prefix 'mine/'"
        ):
            _open({**options, "username": "kvother", "key_prefix": "mine/"})
        allowed = _open({**options, "username": "kvother", "key_prefix": "other/"})
        assert allowed.put(["a"], [b"x"]) == [True]
        allowed.close()
    finally:
        for user in users:
            redis_server.command("ACL", "DELUSER", user)


def test_an_acl_user_confined_to_other_keys_than_the_connectors_is_refused_at_start_up(
    redis_server: RedisServer,
) -> None:
    """Issue 15: without a key_prefix the probe could not tell which keys kvconn would
    use, so a user confined to ``~other/*`` started, and every call was then refused
    (a warning and a miss each). Told the connector's namespace and model, the probe
    uses a key of that shape."""
    redis_server.command("ACL", "SETUSER", "kvelse", "reset", "on", ">pass", "~other/*", "+@all")
    try:
        options = {**redis_server.options, "username": "kvelse", "password": "pass"}
        with pytest.raises(
            ConfigError,
            match=r"ACL user 'kvelse' has no permission for keys under 'kvconn/m%C3%A8le/' "
            r"\(key_prefix '', then kvconn's namespace and model 'kvconn/m%C3%A8le/'\)"
            r".*key patterns",
        ):
            load_backend("redis", options, key_prefix=key_prefix("kvconn", "m\u00e8le"))
        with pytest.raises(ConfigError, match="under key_prefix 'tenant/'"):
            load_backend(
                "redis", {**options, "key_prefix": "tenant/"}, key_prefix=key_prefix("kvconn", "m")
            )
        # The same user, in the namespace its patterns allow, or with a key_prefix that
        # puts kvconn's keys there
        for extra, namespace in (({}, "other"), ({"key_prefix": "other/"}, "kvconn")):
            allowed = load_backend(
                "redis", {**options, **extra}, key_prefix=key_prefix(namespace, "m")
            )
            assert allowed.put([f"{key_prefix(namespace, 'm')}a"], [b"x"]) == [True]
            allowed.close()
    finally:
        redis_server.command("ACL", "DELUSER", "kvelse")


def test_kvconn_simulate_refuses_an_acl_user_confined_to_other_keys_before_any_rank_starts(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvconn.tools.cli import main

    redis_server.command("ACL", "SETUSER", "kvsim", "reset", "on", ">pass", "~other/*", "+@all")
    try:
        monkeypatch.setenv("KVCONN_OPTION_PASSWORD", "pass")
        argv = ["simulate", "--backend", "redis", "-o", f"url={redis_server.url}"]
        assert main([*argv, "-o", "username=kvsim", "--tp", "1", "--layers", "1"]) == 2
        err = capsys.readouterr().err
        assert "ACL user 'kvsim' has no permission for keys under 'kvconn/minimax-m3/'" in err
        assert len(err.strip().splitlines()) == 1, err
    finally:
        redis_server.command("ACL", "DELUSER", "kvsim")


def test_without_redis_py_the_backend_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now fails
    with pytest.raises(BackendDependencyMissing, match=r"pip install 'kvconn\[redis\]'"):
        load_backend("redis", {"url": "redis://127.0.0.1:1/0"})


def test_a_connector_for_an_acl_user_confined_to_other_keys_fails_at_start_up(
    redis_server: RedisServer,
) -> None:
    """Issue 15: an engine builds a Connector (and its scheduler a Lookup) from config;
    both must refuse the user at start-up, not serve every call as a miss."""
    from kvconn.connector import Connector
    from kvconn.lookup import Lookup
    from kvconn.tools.models import minimax_m3

    redis_server.command("ACL", "SETUSER", "kvother", "reset", "on", ">pass", "~other/*", "+@all")
    try:
        config = {
            "model": "m",
            "backend": "redis",
            "options": {**redis_server.options, "username": "kvother", "password": "pass"},
        }
        layout = minimax_m3(tp_size=2)
        for build in (lambda: Connector(config, layout), lambda: Lookup(config, layout)):
            with pytest.raises(ConfigError, match=r"ACL user 'kvother'.*'kvconn/m/'"):
                build()
        Connector({**config, "namespace": "other"}, layout).close()  # its patterns allow it
    finally:
        redis_server.command("ACL", "DELUSER", "kvother")
