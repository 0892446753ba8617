"""Throwaway Redis servers and Redis Clusters on loopback, for tests and dev use.

The Redis backend must be tested against a real ``redis-server``, never against a
user's own Redis and never leaving a process behind. :class:`RedisServer` starts
one server on a free ``127.0.0.1`` port with persistence off, in its own
temporary directory; :class:`RedisCluster` starts several cluster-enabled servers
and joins them itself (slot assignment and ``CLUSTER MEET`` over the wire), so
it does not depend on ``redis-cli --cluster create`` and its prompts.

Setup talks RESP through a tiny built-in client, so these helpers work without
redis-py installed (``kvconn dev-server`` may run where only the server is).
Every started server is recorded; an ``atexit`` hook kills whatever a test forgot
to stop. A process killed with SIGKILL cannot run that hook: its servers live on
in their own session until killed by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeAlias

from kvconn.tools.devserver import _live
from kvconn.tools.devserver._ports import free_port, log_tail, wait_for_port

__all__ = ["RedisCluster", "RedisServer"]

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384

_INSTALL_HINT = "apt-get install redis-server"
_LOG_NAME = "redis.log"
_NODES_CONF = "nodes.conf"
_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 5.0
_PORT_ATTEMPTS = 5
_ADDRESS_IN_USE = "Address already in use"


class _ReplyError(Exception):
    """An error reply (``-ERR ...``) from the server, as opposed to a broken connection."""


RespValue: TypeAlias = "str | int | bytes | list[RespValue] | None"


def _read_reply(stream: BinaryIO) -> RespValue:
    """Parse one RESP2 reply; enough for setup commands, not a general client."""
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed in the middle of a reply")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body.decode()
    if kind == b"-":
        raise _ReplyError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        length = int(body)
        if length < 0:
            return None
        data = stream.read(length + 2)
        if len(data) != length + 2:
            raise ConnectionError("connection closed in the middle of a bulk string")
        return data[:-2]
    if kind == b"*":
        count = int(body)
        if count < 0:
            return None
        return [_read_reply(stream) for _ in range(count)]
    raise ConnectionError(f"unexpected RESP reply type {kind!r}")


def _encode_command(args: Sequence[str | int]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


def _command(
    port: int,
    *args: str | int,
    password: str | None = None,
    timeout: float = 5.0,
) -> RespValue:
    """Send one command to ``127.0.0.1:port`` on a fresh connection and return the reply.

    A connection per command is slow but stateless, which is what setup and
    health checks want: no pool to invalidate when a server is killed.
    """
    with (
        socket.create_connection((HOST, port), timeout=timeout) as sock,
        sock.makefile("rb") as stream,
    ):
        if password is not None:
            sock.sendall(_encode_command(["AUTH", password]))
            _read_reply(stream)
        sock.sendall(_encode_command(args))
        return _read_reply(stream)


def _text(reply: RespValue) -> str:
    if isinstance(reply, bytes):
        return reply.decode(errors="replace")
    if isinstance(reply, str):
        return reply
    raise RuntimeError(f"expected a string reply, got {reply!r}")


def _info_fields(text: str) -> dict[str, str]:
    """Turn ``INFO`` / ``CLUSTER INFO`` text (``key:value`` lines) into a dict."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _flags(config: dict[str, str | None]) -> list[str]:
    """Turn ``{"port": "7000"}`` into ``["--port", "7000"]``, skipping None values."""
    return [
        item for name, value in config.items() if value is not None for item in (f"--{name}", value)
    ]


def _server_version(binary: str) -> tuple[int, ...] | str:
    """Return the server's version tuple, or a reason why it cannot be used."""
    path = shutil.which(binary)
    if path is None:
        return f"{binary} not found: {_INSTALL_HINT}"
    try:
        result = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} cannot run: {exc}"
    output = result.stdout.decode(errors="replace")
    match = re.search(r"v=(\d+(?:\.\d+)*)", output)
    if result.returncode != 0 or match is None:
        return f"{binary} --version failed ({result.returncode}): {output.strip()!r}"
    return tuple(int(part) for part in match.group(1).split("."))


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1``, empty, with persistence off.

    The port is chosen at construction (a free one when ``port`` is None), so
    :attr:`url` and :attr:`options` can go into a config before :meth:`start`,
    and it stays the same across :meth:`kill` / :meth:`restart`, which is what a
    test of "the backend recovers when the server returns" needs.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        binary: str = "redis-server",
    ) -> None:
        self.port: int = port if port is not None else free_port(HOST)
        self.host: str = HOST
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.password = password
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.binary = binary
        # A port we picked may be taken by the time the server binds it; then we
        # may pick another. A port the caller chose is never silently replaced.
        self._port_picker: Callable[[], int] | None = (
            None if port is not None else lambda: free_port(HOST)
        )
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self.port}, {state})"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``; the password, if any, is in :attr:`options`."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def options(self) -> dict[str, object]:
        """Backend options for kvconn's ``redis`` backend pointing at this server.

        The password travels as its own option rather than inside the URL, so
        logging the URL never leaks it.
        """
        options: dict[str, object] = {"url": self.url}
        if self.password is not None:
            options["password"] = self.password
        return options

    @property
    def running(self) -> bool:
        """Whether the server process is alive (a paused one counts as alive)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the running server, for tests that signal it themselves."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def directory(self) -> Path | None:
        """The server's private temp dir (log, cluster config), None when stopped."""
        return self._dir

    @property
    def log_path(self) -> Path | None:
        """The server's log file; kept across :meth:`kill` so a test can read it."""
        return None if self._dir is None else self._dir / _LOG_NAME

    @staticmethod
    def available(binary: str = "redis-server") -> str | None:
        """Return None if ``binary`` can run, else why not (for a pytest skip reason)."""
        version = _server_version(binary)
        return version if isinstance(version, str) else None

    def command(self, *args: str | int) -> RespValue:
        """Run one command on the server over a fresh connection (no redis-py needed).

        Meant for test setup and inspection (``INFO``, ``DBSIZE``, ``CONFIG SET``).
        """
        return _command(self.port, *args, password=self.password)

    def start(self) -> RedisServer:
        """Start the server and return once it answers ``PING`` as *our* process.

        Idempotent: starting a running server does nothing. On failure nothing is
        left running and the error carries the server's log tail.
        """
        if self.running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=f"kvconn-redis-{self.port}-"))
        # at exit, kill at once: the interpreter is going away
        _live.track(self, lambda: self.stop(timeout=0.0))
        try:
            self._launch_with_retries(allow_new_port=True)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``) and delete its dir.

        Idempotent and safe after :meth:`kill`; it returns only when the process
        has been reaped, so no server outlives it.
        """
        self._terminate(graceful=timeout > 0, timeout=timeout)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _live.untrack(self)

    def kill(self) -> None:
        """SIGKILL the server at once, as a crash would; keeps its dir and port.

        For fault tests: clients see connection errors until :meth:`restart`.
        """
        self._terminate(graceful=False, timeout=0.0)

    def restart(self) -> None:
        """Start again on the same port with empty data (after :meth:`kill` or not).

        Data files are removed so the restarted server is empty even if
        ``extra_args`` turned persistence on; the log and a cluster node's config
        are kept, so a cluster node rejoins its cluster.
        """
        if self._dir is None:
            self.start()
            return
        self._terminate(graceful=True, timeout=_STOP_TIMEOUT_S)
        for entry in self._dir.iterdir():
            if entry.name in (_LOG_NAME, _NODES_CONF):
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        try:
            self._launch_with_retries(allow_new_port=False)
        except BaseException:
            self._terminate(graceful=False, timeout=0.0)
            raise

    def pause(self) -> None:
        """SIGSTOP the server: connections hang instead of failing (timeout tests)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a server stopped by :meth:`pause`."""
        self._signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------

    def _argv(self, log_path: Path) -> list[str]:
        assert self._dir is not None
        config: dict[str, str | None] = {
            "port": str(self.port),
            "bind": HOST,  # loopback only: a test server must not be reachable from outside
            "protected-mode": "yes",
            "save": "",  # no snapshots: nothing on disk, a restart is empty
            "appendonly": "no",
            "daemonize": "no",  # we own the process and must be able to reap it
            "dir": str(self._dir),
            "logfile": str(log_path),
            "maxmemory": self.maxmemory,
            "maxmemory-policy": self.maxmemory_policy,
            "requirepass": self.password,
        }
        return [self.binary, *_flags(config), *self.extra_args]

    def _launch_with_retries(self, *, allow_new_port: bool) -> None:
        attempts = _PORT_ATTEMPTS if allow_new_port and self._port_picker else 1
        for attempt in range(attempts):
            try:
                self._launch()
                return
            except RuntimeError as exc:
                self._terminate(graceful=False, timeout=0.0)
                lost_port_race = _ADDRESS_IN_USE in str(exc)
                if not lost_port_race or attempt == attempts - 1:
                    raise
                assert self._port_picker is not None
                self.port = self._port_picker()

    def _launch(self) -> None:
        assert self._dir is not None
        log_path = self._dir / _LOG_NAME
        # Early errors (bad option) go to stdout before --logfile applies, so both
        # streams append to the same file the server later logs to.
        with open(log_path, "ab") as log:
            log.write(f"--- kvconn: starting on port {self.port}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._argv(log_path),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                start_new_session=True,
            )
        self._wait_ready(log_path)

    def _wait_ready(self, log_path: Path) -> None:
        """Wait until the server on our port is our own process and answers.

        Checking ``process_id`` matters: if someone else already listens on the
        port, our server dies with "address in use", but a connect in between
        would reach *their* server and tests would write into it.
        """
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        wait_for_port(HOST, self.port, _START_TIMEOUT_S, proc=proc, log_path=log_path)
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                info = _info_fields(_text(self.command("INFO", "server")))
                if info.get("process_id") == str(proc.pid):
                    return
                last_error = RuntimeError(
                    f"port {self.port} is served by pid {info.get('process_id')}, "
                    f"not ours ({proc.pid})"
                )
            except (OSError, _ReplyError) as exc:
                last_error = exc
            time.sleep(0.02)
        # Give a dying process a moment, so the log says why.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        state = (
            f"exited with code {proc.returncode}"
            if proc.returncode is not None
            else "is not answering"
        )
        raise RuntimeError(
            f"redis-server on {HOST}:{self.port} {state} ({last_error}); "
            f"log tail:\n{log_tail(log_path)}"
        )

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        os.killpg(proc.pid, sig)

    def _terminate(self, *, graceful: bool, timeout: float) -> None:
        """End the process group and reap it; never signals an already reaped pid."""
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.poll() is None:
            try:
                if graceful:
                    os.killpg(proc.pid, signal.SIGTERM)
                    os.killpg(proc.pid, signal.SIGCONT)  # a paused server must see it
                    try:
                        proc.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def _free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster-bus port (port + 10000) is free too.

    A cluster node also listens on ``port + 10000``; picking the pair keeps this
    working on every Redis version (``cluster-port`` only exists since 7.0).
    """
    for _ in range(200):
        port = free_port(HOST)
        bus = port + 10000
        if bus > 65535 or port in taken or bus in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, bus))
            except OSError:
                continue
        return port
    raise RuntimeError("found no free port pair (port, port + 10000) on 127.0.0.1")


def _slot_ranges(nodes: int) -> list[tuple[int, int]]:
    """Split the 16384 slots into ``nodes`` contiguous, near-equal inclusive ranges."""
    bounds = [CLUSTER_SLOTS * i // nodes for i in range(nodes + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(nodes)]


class RedisCluster:
    """A Redis Cluster of ``nodes`` masters, no replicas, on ``127.0.0.1``.

    Slots are split evenly and assigned directly (``CLUSTER ADDSLOTS``,
    ``SET-CONFIG-EPOCH``, ``MEET``) instead of through ``redis-cli --cluster
    create``, which prompts and changes its flags between versions. Without
    replicas a killed node leaves its slots unserved, which is exactly the
    partial outage the cluster backend must survive.
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        binary: str = "redis-server",
        node_timeout_ms: int = 2000,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        self.binary = binary
        self.node_timeout_ms = node_timeout_ms
        taken: set[int] = set()
        self.nodes: list[RedisServer] = []
        for _ in range(nodes):
            port = _free_cluster_port(taken)
            taken |= {port, port + 10000}
            node = RedisServer(
                port,
                maxmemory=maxmemory,
                maxmemory_policy=maxmemory_policy,
                binary=binary,
                extra_args=_flags(
                    {
                        "cluster-enabled": "yes",
                        "cluster-config-file": _NODES_CONF,
                        "cluster-node-timeout": str(node_timeout_ms),
                    }
                ),
            )
            node._port_picker = lambda: _free_cluster_port(set(self.ports))
            self.nodes.append(node)

    def __repr__(self) -> str:
        return f"RedisCluster(ports={self.ports})"

    @property
    def ports(self) -> list[int]:
        """Client ports of the nodes, in slot order (node 0 owns slot 0)."""
        return [node.port for node in self.nodes]

    @property
    def options(self) -> dict[str, object]:
        """Backend options for kvconn's ``redis`` backend in cluster mode."""
        return {"url": f"redis://{HOST}:{self.nodes[0].port}", "cluster": True}

    @staticmethod
    def available(binary: str = "redis-server") -> str | None:
        """Return None if ``binary`` can run a cluster, else why not."""
        version = _server_version(binary)
        if isinstance(version, str):
            return version
        if version < (3, 0):
            return f"{binary} {'.'.join(map(str, version))} has no cluster support"
        return None

    def start(self) -> RedisCluster:
        """Start every node, join them and return once every node serves all slots.

        Idempotent, like :meth:`RedisServer.start`: a formed cluster is left as it is.
        """
        if all(node.running for node in self.nodes) and not self._readiness_problem():
            return self
        try:
            for node in self.nodes:
                node.start()
            for epoch, (node, (first, last)) in enumerate(
                zip(self.nodes, _slot_ranges(len(self.nodes)), strict=True), start=1
            ):
                # Distinct epochs up front spare the cluster a round of epoch
                # collision handling before it reports ok.
                node.command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
                node.command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
            for node in self.nodes[1:]:
                self.nodes[0].command("CLUSTER", "MEET", HOST, node.port)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every node runs, says ``cluster_state:ok`` and maps all slots.

        ``cluster_state:ok`` alone is not enough: a client that asks a node whose
        slot map is still partial would be redirected wrongly, so each node's
        ``CLUSTER SLOTS`` must also match the planned split.
        """
        deadline = time.monotonic() + timeout
        problem = "not checked yet"
        while time.monotonic() < deadline:
            problem = self._readiness_problem()
            if not problem:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self!r} not ready after {timeout:.0f} s: {problem}")

    def stop(self) -> None:
        """Stop every node and delete their dirs; idempotent."""
        for node in self.nodes:
            node.stop()

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i``: its slots become unreachable, the others keep serving."""
        self.nodes[i].kill()

    def restart_node(self, i: int) -> None:
        """Bring node ``i`` back, empty, on its port; it rejoins from its nodes.conf.

        Other nodes clear their failure flag for it only after a couple of node
        timeouts, so this waits for the whole cluster to report ok again.
        """
        self.nodes[i].restart()
        self.wait_ready()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _readiness_problem(self) -> str:
        """Return why the cluster is not fully formed yet, or "" when it is."""
        expected = {
            slot_range: node.port
            for slot_range, node in zip(_slot_ranges(len(self.nodes)), self.nodes, strict=True)
        }
        for node in self.nodes:
            if not node.running:
                return f"node {node.port} is not running"
            try:
                info = _info_fields(_text(node.command("CLUSTER", "INFO")))
                slots = node.command("CLUSTER", "SLOTS")
            except (OSError, _ReplyError) as exc:
                return f"node {node.port}: {exc}"
            if info.get("cluster_state") != "ok":
                return f"node {node.port}: cluster_state={info.get('cluster_state')}"
            if info.get("cluster_known_nodes") != str(len(self.nodes)):
                return f"node {node.port}: knows {info.get('cluster_known_nodes')} nodes"
            if info.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                return f"node {node.port}: cluster_slots_ok={info.get('cluster_slots_ok')}"
            seen: dict[tuple[int, int], int] = {}
            for entry in slots if isinstance(slots, list) else []:
                if isinstance(entry, list) and len(entry) >= 3:
                    first, last, master = entry[0], entry[1], entry[2]
                    if (
                        isinstance(first, int)
                        and isinstance(last, int)
                        and isinstance(master, list)
                        and len(master) >= 2
                        and isinstance(master[1], int)
                    ):
                        seen[(first, last)] = master[1]
            if seen != expected:
                return f"node {node.port}: slot map {seen} != {expected}"
        return ""
