"""Throwaway Redis servers and Redis Clusters on loopback, for tests and dev use.

The Redis backend must be tested against a real ``redis-server``, never against a
user's own Redis and never leaving a process behind. :class:`RedisServer` starts one
server on a free ``127.0.0.1`` port with persistence off, in its own temporary
directory; :class:`RedisCluster` starts cluster-enabled servers and joins them with
``redis-cli --cluster create``. Processes are mirakuru's (see ``_process``), the
client is redis-py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvconn.tools.devserver import MIN_CLUSTER_NODES, _process, byte_size
from kvconn.tools.devserver._ports import free_port, free_port_pair

__all__ = ["RedisCluster", "RedisServer"]

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384
#: A cluster node's bus listens on its client port + this (before Redis 7's cluster-port).
BUS_PORT_OFFSET = 10000

_INSTALL_HINT = "apt-get install redis-server"
_LOG_NAME = "redis.log"
_NODES_CONF = "nodes.conf"
_START_TIMEOUT_S = 15.0
_PORT_ATTEMPTS = 5
#: How redis-server quotes the command-line directive it refused, e.g.
#: ``>>> 'maxmemory-policy "bogus"'`` followed by the reason on the next line.
_REFUSED_DIRECTIVE = re.compile(r"^>>> '(\S+) ?(.*)'$")


def _fields(reply: Any) -> dict[str, str]:
    """``INFO`` / ``CLUSTER INFO`` text (``key:value`` lines) as a dict."""
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1``, empty, with persistence off.

    The port is chosen at construction (a free one when ``port`` is None), so
    :attr:`url` and :attr:`options` can go into a config before :meth:`start`, and it
    stays the same across :meth:`kill` / :meth:`restart`, which is what a test of "the
    backend recovers when the server returns" needs. ``maxmemory`` is a size in kvconn's
    syntax (``"4mb"``, ``"1GiB"``, bytes).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        maxmemory: str | int | None = None,
        maxmemory_policy: str | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        binary: str = "redis-server",
    ) -> None:
        self.port: int = port if port is not None else free_port()
        self.host: str = HOST
        self.maxmemory = None if maxmemory is None else byte_size(maxmemory)
        self.maxmemory_policy = maxmemory_policy
        self.password = password
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.binary = binary
        # A port we picked may be taken by the time the server binds it; then we may
        # pick another. A port the caller chose is never silently replaced.
        self._pick_port: Callable[[], int] | None = None if port is not None else free_port
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._child: _process.TcpChild | None = None

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, {'running' if self.running else 'stopped'})"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``; the password, if any, is in :attr:`options`."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def options(self) -> dict[str, object]:
        """Backend options for kvconn's ``redis`` backend pointing at this server.

        The password travels as its own option rather than inside the URL, so logging
        the URL never leaks it.
        """
        options: dict[str, object] = {"url": self.url}
        if self.password is not None:
            options["password"] = self.password
        return options

    @property
    def running(self) -> bool:
        """Whether the server process is alive (a paused one counts as alive)."""
        return self._child is not None and self._child.running()

    @property
    def pid(self) -> int | None:
        """Process id of the running server, for tests that signal it themselves."""
        process = self._child.process if self._child is not None else None
        return process.pid if process is not None and process.poll() is None else None

    @property
    def directory(self) -> Path | None:
        """The server's private temp dir (log, cluster config), None when stopped."""
        return None if self._dir is None else Path(self._dir.name)

    @property
    def log_path(self) -> Path | None:
        """The server's log file; kept across :meth:`kill` so a test can read it."""
        directory = self.directory
        return None if directory is None else directory / _LOG_NAME

    @staticmethod
    def available(binary: str = "redis-server") -> str | None:
        """Return None if ``binary`` can run, else why not (for a pytest skip reason)."""
        return _process.cannot_run(binary, _INSTALL_HINT)

    def command(self, *args: str | int) -> Any:
        """Run one command on a fresh connection and return the reply as the server sent it.

        No redis-py reply parsing: strings come back as ``bytes``, integers as ``int``,
        arrays as lists; an error reply raises :class:`redis.ResponseError`. Meant for
        test setup and inspection (``INFO``, ``DBSIZE``, ``CONFIG SET``); one connection
        per command leaves no pool to go stale when a test kills the server.
        """
        connection: Any = redis.Connection(  # type: ignore[no-untyped-call]
            host=self.host,
            port=self.port,
            password=self.password,
            protocol=2,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            connection.send_command(*args)
            return connection.read_response()
        finally:
            connection.disconnect()

    def start(self) -> RedisServer:
        """Start the server and return once it accepts connections.

        Idempotent: starting a running server does nothing. On failure nothing is left
        running and a ``StartError`` (a RuntimeError) carries the server's log tail.
        """
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(
                prefix=f"kvconn-redis-{self.port}-", ignore_cleanup_errors=True
            )
        try:
            self._launch(retry_on_a_new_port=True)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and delete its dir; idempotent."""
        _process.stop(self._child)
        self._child = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the server at once, as a crash would; keeps its dir and port.

        For fault tests: clients see connection errors until :meth:`restart`.
        """
        _process.stop(self._child, kill=True)
        self._child = None

    def restart(self) -> None:
        """Start again on the same port with empty data (after :meth:`kill` or not).

        Data files are removed so the restarted server is empty even if ``extra_args``
        turned persistence on; the log and a cluster node's config are kept, so a
        cluster node rejoins its cluster.
        """
        directory = self.directory
        if directory is None:
            self.start()
            return
        _process.stop(self._child)
        self._child = None
        for entry in directory.iterdir():
            if entry.name not in (_LOG_NAME, _NODES_CONF):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        self._launch(retry_on_a_new_port=False)

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

    def _argv(self) -> list[str]:
        settings: dict[str, object] = {
            "port": self.port,
            "bind": HOST,  # loopback only: a test server must not be reachable from outside
            "protected-mode": "yes",
            "save": "",  # no snapshots: nothing on disk, a restart is empty
            "appendonly": "no",
            "daemonize": "no",  # we own the process and must be able to reap it
            "dir": self.directory,
            "logfile": self.log_path,
            "maxmemory": self.maxmemory,
            "maxmemory-policy": self.maxmemory_policy,
        }
        flags = [s for k, v in settings.items() if v is not None for s in (f"--{k}", str(v))]
        return [self.binary, *self._secret_config(), *flags, *self.extra_args]

    def _secret_config(self) -> list[str]:
        """The password goes in a private config file, never on the command line, where
        ``ps`` and mirakuru's debug log of the command would show it."""
        if self.password is None:
            return []
        path = os.path.join(str(self.directory), "secrets.conf")
        quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f'requirepass "{quoted}"\n')
        return [path]

    def _launch(self, *, retry_on_a_new_port: bool) -> None:
        assert self.log_path is not None
        for attempt in range(_PORT_ATTEMPTS if retry_on_a_new_port else 1):
            try:
                self._child = _process.launch(
                    _process.TcpChild,
                    self._argv(),
                    self.log_path,
                    timeout=_START_TIMEOUT_S,
                    cwd=self.directory,
                    host=HOST,
                    port=self.port,
                )
                return
            except _process.StartError as exc:
                tail = _process.log_tail(self.log_path)
                busy = exc.rejected is not None or "Address already in use" in tail
                if busy and self._pick_port is not None and attempt < _PORT_ATTEMPTS - 1:
                    self.port = self._pick_port()  # lost a race for a port we picked
                    continue
                rejected = f"--port {self.port}: in use already" if busy else _refusal(tail)
                raise _process.StartError(exc.summary, self.log_path, rejected) from None

    def _signal(self, sig: signal.Signals) -> None:
        pid = self.pid
        if pid is None:
            raise RuntimeError(f"{self!r} is not running")
        os.killpg(pid, sig)


def _refusal(log: str) -> str | None:
    """``--maxmemory-policy "bogus": argument(s) must be one of …`` from a config error.

    redis-server names the directive it refused, as given on its command line, and why
    on the next line; the dev-server flags carry the same names.
    """
    lines = log.splitlines()
    for line, reason in zip(lines, [*lines[1:], ""]):
        match = _REFUSED_DIRECTIVE.match(line.strip())
        if match:
            return f"--{match.group(1)} {match.group(2)}: {reason.strip()}".strip()
    return None


class RedisCluster:
    """A Redis Cluster of ``nodes`` masters (at least 3), no replicas, on ``127.0.0.1``.

    ``redis-cli --cluster create`` assigns the slots and joins the nodes. Without
    replicas a killed node leaves its slots unserved, which is exactly the partial
    outage the cluster backend must survive.
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        maxmemory: str | int | None = None,
        maxmemory_policy: str | None = None,
        binary: str = "redis-server",
        node_timeout_ms: int = 2000,
    ) -> None:
        if nodes < MIN_CLUSTER_NODES:
            raise ValueError(f"a Redis Cluster needs {MIN_CLUSTER_NODES} nodes, not {nodes}")
        self.binary = binary
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []
        for _ in range(nodes):
            node = RedisServer(
                free_port_pair(BUS_PORT_OFFSET, self._ports_in_use()),
                maxmemory=maxmemory,
                maxmemory_policy=maxmemory_policy,
                binary=binary,
                extra_args=(
                    *("--cluster-enabled", "yes", "--cluster-config-file", _NODES_CONF),
                    *("--cluster-node-timeout", str(node_timeout_ms)),
                ),
            )
            node._pick_port = lambda: free_port_pair(BUS_PORT_OFFSET, self._ports_in_use())
            self.nodes.append(node)

    def __repr__(self) -> str:
        return f"RedisCluster(ports={self.ports})"

    @property
    def ports(self) -> list[int]:
        """Client ports of the nodes."""
        return [node.port for node in self.nodes]

    @property
    def running(self) -> bool:
        """True while every node runs."""
        return all(node.running for node in self.nodes)

    @property
    def options(self) -> dict[str, object]:
        """Backend options for kvconn's ``redis`` backend in cluster mode."""
        return {"url": f"redis://{HOST}:{self.nodes[0].port}", "cluster": True}

    @staticmethod
    def available(binary: str = "redis-server") -> str | None:
        """Return None if ``binary`` and ``redis-cli`` can run a cluster, else why not."""
        return _process.cannot_run(binary, _INSTALL_HINT) or _process.cannot_run(
            "redis-cli", _INSTALL_HINT
        )

    def start(self) -> RedisCluster:
        """Start every node, join them and return once every node serves all slots.

        Idempotent, like :meth:`RedisServer.start`: a formed cluster is left as it is.
        """
        if self.running and not self._readiness_problem():
            return self
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"{HOST}:{port}" for port in self.ports]
            argv = ["redis-cli", "--cluster", "create", *addresses, "--cluster-yes"]
            created = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if created.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed: {created.stdout}{created.stderr}")
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every node runs, says ``cluster_state:ok`` and all agree on the slots.

        ``cluster_state:ok`` alone is not enough: a client that asks a node whose slot
        map is still partial would be redirected wrongly.
        """
        deadline = time.monotonic() + timeout
        while problem := self._readiness_problem():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self!r} not ready after {timeout:.0f} s: {problem}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node and delete their dirs; idempotent.

        Every node gets its SIGTERM at once and one wait covers them all (a node at a
        time made a cluster's stop the sum of its nodes' waits).
        """
        _process.stop_all(node._child for node in self.nodes)
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

    def _ports_in_use(self) -> set[int]:
        return {n.port + offset for n in self.nodes for offset in (0, BUS_PORT_OFFSET)}

    def _readiness_problem(self) -> str:
        """Why the cluster is not fully formed yet, or "" when it is."""
        slot_maps = set()
        for node in self.nodes:
            if not node.running:
                return f"node {node.port} is not running"
            try:
                info = _fields(node.command("CLUSTER", "INFO"))
                slots = node.command("CLUSTER", "SLOTS")
            except redis.RedisError as exc:
                return f"node {node.port}: {exc}"
            wanted = {
                "cluster_state": "ok",
                "cluster_known_nodes": str(len(self.nodes)),
                "cluster_slots_ok": str(CLUSTER_SLOTS),
            }
            seen = {key: info.get(key) for key in wanted}
            if seen != wanted:
                return f"node {node.port}: {seen}"
            slot_maps.add(tuple(sorted((first, last, node[1]) for first, last, node, *_ in slots)))
        return "" if len(slot_maps) == 1 else f"the nodes disagree on the slot map: {slot_maps}"
