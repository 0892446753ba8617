"""Throwaway Mooncake Store clusters on loopback, for tests and ``kvconn dev-server``.

The Mooncake backend is only trustworthy when tested against the real store, so
:class:`MooncakeCluster` starts one ``mooncake_master`` (with its embedded HTTP
metadata server) and N standalone storage processes (``mooncake_client``) on free
``127.0.0.1`` ports, each logging into one temporary directory.

Why standalone storage processes: in Mooncake, memory is contributed by clients, and
an object lives in the segment of the process that mounted it. A test client that
mounted its own segment would take its objects with it when it closes, so the clients
a test creates mount nothing (``global_segment_size=0``, see
:attr:`MooncakeCluster.options`) and the data lives in storage processes that outlive
them, as in a real deployment.

Facts this module relies on (mooncake-transfer-engine 0.3.13, see
``docs/notes/mooncake-api.md``): the master's admin server (``--metrics_port``) serves
``/health`` and Prometheus ``/metrics``, where ``master_total_capacity_bytes`` shows a
storage process has mounted its segment; the master keeps a dead process's segment,
and keeps placing puts into it, until ``client_ttl`` seconds (default 10) pass without
a heartbeat; storage processes re-mount by themselves when a master restarts on the
same ports, but every object is lost (object metadata lives only in the master).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvconn.tools.devserver import MIN_SEGMENT_SIZE, _process, byte_size
from kvconn.tools.devserver._ports import free_port

__all__ = ["MooncakeCluster", "keep_transfers_on_loopback", "ready_to_benchmark"]

HOST = "127.0.0.1"
DEFAULT_SEGMENT_SIZE = 256 * 2**20
_DEFAULT_LOCAL_BUFFER_SIZE = 64 * 2**20

_INSTALL_HINT = "pip install 'kvconn[mooncake]' (or set $KVCONN_DEV_MOONCAKE_MASTER, _CLIENT)"
_IBVERBS_HINT = "apt-get install libibverbs1"
#: name -> environment variable that overrides where the binary is found
_BINARIES = {
    "mooncake_master": "KVCONN_DEV_MOONCAKE_MASTER",
    "mooncake_client": "KVCONN_DEV_MOONCAKE_CLIENT",
}
_START_TIMEOUT_S = 30.0
_PORT_ATTEMPTS = 3
_POLL_S = 0.05
_HTTP_TIMEOUT_S = 2.0
#: How gflags reports a bad command line (``master_args``): no other port would help.
_FLAG_ERROR = re.compile(r"^ERROR: (.*)", re.MULTILINE)
_METRIC_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}\n]*\})?[ \t]+(\S+)[ \t]*$", re.MULTILINE)
_SEGMENT_LABEL = re.compile(r'segment="([^"]*)"')


def keep_transfers_on_loopback(host: str = HOST) -> None:
    """Make the Mooncake clients this process creates from now on transfer over ``host``.

    The transfer engine reads ``MC_TCP_BIND_ADDRESS`` as a client is made; without it a
    client advertises the first non-loopback interface, and its transfers with a cluster
    on loopback leave loopback. The storage processes :class:`MooncakeCluster` starts get
    it in their own environment; this is for clients made in the caller's process (a
    benchmark's). A value already set is the caller's choice and stays.
    """
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)


def ready_to_benchmark() -> bool:
    """Prepare this process for a benchmark against throwaway clusters: its clients
    transfer over loopback (:func:`keep_transfers_on_loopback`). False, after saying why
    on stderr, when Mooncake's binaries are not there to start a cluster."""
    keep_transfers_on_loopback()
    problem = MooncakeCluster.available()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return False
    return True


def _find_binary(name: str) -> Path | None:
    """The override in ``$KVCONN_DEV_MOONCAKE_*``, the wheel's own copy, then ``PATH``.

    The wheel also installs console scripts of the same names, but those are Python
    wrappers around the packaged file; running it directly starts faster and keeps
    the pid we signal the pid that serves.
    """
    override = os.environ.get(_BINARIES[name])
    if override:
        return Path(override)
    spec = importlib.util.find_spec("mooncake")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / name).is_file():
            return Path(location) / name
    on_path = shutil.which(name)
    return Path(on_path) if on_path else None


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class _Master(_process.HttpChild):
    """Ready once ``/health`` answers and the RPC and metadata ports accept too."""

    def __init__(self, *args: Any, other_ports: Sequence[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.other_ports = tuple(other_ports)

    def after_start_check(self) -> bool:
        return super().after_start_check() and all(
            _accepts(self.host, port) for port in self.other_ports
        )


class MooncakeCluster:
    """A master plus ``storage_processes`` standalone storage processes on loopback.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. Clients connect
    with :attr:`options`, which mount no memory of their own, so everything they put
    lives in the storage processes, each contributing ``segment_size`` bytes (a size in
    kvconn's syntax, at least 16 MiB).

    ``master_args`` are appended to the master's command line (gflags: a later flag
    wins). ``client_ttl`` (seconds) is how long the master keeps a silent process's
    segment; the master's default is 10, a fault test that kills storage may want 2-3.
    ``env`` is added to the children's environment (e.g. ``MC_LOG_LEVEL``). Logs go to
    a temporary directory, removed at :meth:`stop`, or to ``log_dir``, which is kept.
    """

    def __init__(
        self,
        storage_processes: int = 1,
        segment_size: int | str = DEFAULT_SEGMENT_SIZE,
        host: str = HOST,
        master_args: Sequence[str] = (),
        *,
        local_buffer_size: int | str = _DEFAULT_LOCAL_BUFFER_SIZE,
        client_ttl: int | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        start_timeout: float = _START_TIMEOUT_S,
    ) -> None:
        if storage_processes < 0:
            raise ValueError(f"storage_processes must be >= 0, got {storage_processes}")
        self.segment_size = byte_size(segment_size)
        if self.segment_size < MIN_SEGMENT_SIZE:
            raise ValueError(f"segment_size must be >= 16 MiB, got {segment_size!r}")
        self.storage_processes = storage_processes
        self.host = host
        self.master_args = list(master_args)
        self.local_buffer_size = byte_size(local_buffer_size)
        self.client_ttl = client_ttl
        self.start_timeout = start_timeout
        # Without MC_TCP_BIND_ADDRESS the transfer engine advertises the first
        # non-loopback interface's address and storage traffic leaves loopback.
        self._child_env = {"MC_TCP_BIND_ADDRESS": host, **(env or {})}
        self._user_log_dir = Path(log_dir) if log_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._dir: Path | None = None
        self._master: _Master | None = None
        self._storage: list[_process.TcpChild | None] = []
        self._lock = threading.RLock()
        self.master_port = self.metadata_port = self.metrics_port = 0

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"MooncakeCluster({state}, master={self.master_address}, "
            f"metadata_port={self.metadata_port}, storage={self.storage_processes}x"
            f"{self.segment_size})"
        )

    # -- what clients need ------------------------------------------------- #

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        """The master's Prometheus endpoint (``/health`` and ``/metrics/summary`` too)."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def options(self) -> dict[str, object]:
        """Backend options for a client of this cluster.

        ``global_segment_size`` is 0 on purpose: a client that mounted memory would hold
        the objects it puts and lose them when it closes.
        """
        return {
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "local_hostname": self.host,
            "global_segment_size": 0,
            "local_buffer_size": self.local_buffer_size,
        }

    @property
    def env(self) -> dict[str, str]:
        """The same settings as the environment Mooncake's own integrations read.

        (``mooncake.mooncake_config.MooncakeConfig.load_from_env`` and SGLang HiCache
        read ``MOONCAKE_MASTER`` & co.; vLLM reads a JSON file at
        ``MOONCAKE_CONFIG_PATH``, see :meth:`config_json`.)
        """
        return {
            "MOONCAKE_MASTER": self.master_address,
            "MOONCAKE_TE_META_DATA_SERVER": self.metadata_server,
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_DEVICE": "",
            "MOONCAKE_LOCAL_HOSTNAME": self.host,
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
            "MOONCAKE_LOCAL_BUFFER_SIZE": str(self.local_buffer_size),
            "MOONCAKE_MASTER_METRICS_PORT": str(self.metrics_port),
            # Not a MOONCAKE_* setting: keeps the client's transfer engine on host.
            "MC_TCP_BIND_ADDRESS": self.host,
        }

    def config_json(self) -> dict[str, object]:
        """A ``MOONCAKE_CONFIG_PATH`` document (keys of ``MooncakeConfig.from_file``)."""
        return {
            "local_hostname": self.host,
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": 0,
            "local_buffer_size": self.local_buffer_size,
        }

    def client(self, *, segment_size: int = 0, local_buffer_size: int = 0) -> Any:
        """A bare ``MooncakeDistributedStore`` set up against this cluster (no kvconn).

        For benchmarks and experiments that compare kvconn with the raw client; close it
        before the cluster stops. ``segment_size`` > 0 mounts memory in this process.
        """
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        code = store.setup(
            self.host,
            self.metadata_server,
            segment_size,
            local_buffer_size,
            "tcp",
            "",
            self.master_address,
        )
        if code != 0:
            raise RuntimeError(f"mooncake setup() against {self.master_address} gave {code}")
        return store

    # -- state -------------------------------------------------------------- #

    @property
    def running(self) -> bool:
        """True while the master process is alive."""
        return self._master is not None and self._master.running()

    @property
    def log_dir(self) -> Path | None:
        """Where ``master.log`` and ``storage-<i>.log`` are written (None before start)."""
        return self._dir

    @property
    def pids(self) -> list[int]:
        """Pids of every live process of this cluster (master first)."""
        children = [self._master, *self._storage]
        return [c.process.pid for c in children if c is not None and c.process and c.running()]

    def storage_alive(self, index: int) -> bool:
        child = self._storage[index] if 0 <= index < len(self._storage) else None
        return child is not None and child.running()

    @staticmethod
    def available() -> str | None:
        """Return None if a cluster can start here, else a human reason (for ``skip``).

        Every Mooncake binary links ``libibverbs`` even for TCP; without it they die at
        load time with a linker message that does not say which package to install.
        """
        try:
            ctypes.CDLL("libibverbs.so.1")
        except OSError as exc:
            return f"libibverbs missing ({exc}): {_IBVERBS_HINT}"
        return _process.cannot_run(
            _find_binary("mooncake_master"), _INSTALL_HINT
        ) or _process.cannot_run(_find_binary("mooncake_client"), _INSTALL_HINT)

    # -- lifecycle ---------------------------------------------------------- #

    def start(self) -> MooncakeCluster:
        """Start the master and the storage processes; return once all are mounted.

        Raises :class:`~kvconn.tools.devserver._process.StartError` (a RuntimeError,
        with the failing process's log tail) if anything does not come up within
        ``start_timeout`` seconds; nothing is left running in that case.
        """
        with self._lock:
            if self._master is not None:
                raise RuntimeError(f"{self!r} is already started")
            problem = self.available()
            if problem is not None:
                raise RuntimeError(f"cannot start a Mooncake cluster: {problem}")
            if self._user_log_dir is None:
                self._tmp = tempfile.TemporaryDirectory(
                    prefix=f"kvconn-mooncake-{os.getpid()}-", ignore_cleanup_errors=True
                )
                self._dir = Path(self._tmp.name)
            else:
                self._user_log_dir.mkdir(parents=True, exist_ok=True)
                self._dir = self._user_log_dir
            try:
                self._start_master_on_free_ports()
                self._storage = [self._launch_storage(i) for i in range(self.storage_processes)]
                self.wait_for_capacity(self.storage_processes * self.segment_size)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """Terminate every process (SIGTERM, then SIGKILL); idempotent.

        The log directory is removed unless the caller chose it (``log_dir=``).
        """
        with self._lock:
            # storage first, together: each unmounts its segment from the master it needs
            _process.stop_all(self._storage)
            _process.stop(self._master)
            self._storage = []
            self._master = None
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None
            self._dir = None

    def kill_master(self) -> None:
        """SIGKILL the master (and its metadata server); storage processes live on.

        Clients then get ``-900`` (RPC_FAIL) from every call, each after ~4 s.
        """
        with self._lock:
            _process.stop(self._master, kill=True)

    def restart_master(self) -> None:
        """(Re)start the master on the same ports and wait for storage to re-mount.

        Every object is gone afterwards (the master holds all object metadata); the
        live storage processes re-mount their segments on their own, within a few
        seconds, and this returns once the master sees all of them.
        """
        with self._lock:
            if self._master is None:
                raise RuntimeError(f"{self!r} was never started")
            _process.stop(self._master, kill=True)
            self._master = self._launch_master()
            live = sum(1 for i in range(len(self._storage)) if self.storage_alive(i))
            self.wait_for_capacity(live * self.segment_size)

    def kill_storage(self, index: int, *, wait_unmounted: bool = False) -> None:
        """SIGKILL storage process ``index``; its objects' replicas are lost.

        The master notices only after ``client_ttl`` s without a heartbeat; until then
        ``is_exist`` still reports its objects and puts may still be placed in its
        segment (they fail with ``-800``). ``wait_unmounted=True`` waits until the
        master has dropped the segment.
        """
        with self._lock:
            child = self._storage[index]
            if child is None:
                return
            before = self._capacity()
            _process.stop(child, kill=True)
            self._storage[index] = None
            if wait_unmounted:
                ttl = self.client_ttl if self.client_ttl is not None else 10
                self._wait_for(
                    lambda: self._capacity() <= before - self.segment_size,
                    timeout=ttl * 3 + self.start_timeout,
                    what=f"the master to drop storage-{index}'s segment",
                )

    def restart_storage(self, index: int) -> None:
        """Start storage process ``index`` again after :meth:`kill_storage`; return once
        its segment is mounted.

        The new process mounts a new, empty segment under a new name (a segment is named
        after its transfer engine's address, whose port is picked afresh), so it serves
        none of the objects the old process held: those stay listed on the dead segment,
        failing reads with ``-800``, until the master drops it (``client_ttl``).
        """
        with self._lock:
            if self.storage_alive(index):
                raise RuntimeError(f"storage-{index} of {self!r} is still running")
            before = set(self.segments())
            self._storage[index] = self._launch_storage(index)
            self._wait_for(
                lambda: bool(set(self.segments()) - before),
                timeout=self.start_timeout,
                what=f"storage-{index}'s new segment to be mounted",
            )

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- inspection --------------------------------------------------------- #

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled Prometheus metrics (e.g. ``master_key_count``), under
        Mooncake's own names. Raises :class:`OSError` if the master does not answer."""
        return {name: value for name, labels, value in self._metric_lines() if not labels}

    def segments(self) -> dict[str, int]:
        """Mounted segments as the master sees them: name -> capacity in bytes."""
        out: dict[str, int] = {}
        for name, labels, value in self._metric_lines():
            match = _SEGMENT_LABEL.search(labels)
            if name == "segment_total_capacity_bytes" and match:
                out[match.group(1)] = int(value)
        return out

    def wait_for_capacity(self, total_bytes: int, timeout: float | None = None) -> None:
        """Block until the master counts at least ``total_bytes`` of mounted memory."""
        self._wait_for(
            lambda: self._capacity() >= total_bytes,
            timeout=self.start_timeout if timeout is None else timeout,
            what=f"{total_bytes} bytes of storage to be mounted",
        )

    # -- internals ---------------------------------------------------------- #

    def _log(self, name: str) -> Path:
        directory = self.log_dir
        assert directory is not None
        return directory / f"{name}.log"

    def _start_master_on_free_ports(self) -> None:
        """Pick free ports and start the master; retry with new ports if it dies.

        A busy RPC port makes the master exit 1 without an error line, so any early
        exit is retried, except a command-line error, which no other port would fix.
        """
        for attempt in range(_PORT_ATTEMPTS):
            ports: set[int] = set()
            while len(ports) < 3:
                ports.add(free_port())
            self.master_port, self.metadata_port, self.metrics_port = ports
            try:
                self._master = self._launch_master()
                return
            except _process.StartError as exc:
                flag_error = _FLAG_ERROR.search(_process.log_tail(self._log("master")))
                if flag_error:
                    refused = f"mooncake_master refused its flags: {flag_error[1]}"
                    raise _process.StartError(exc.summary, self._log("master"), refused) from None
                if attempt == _PORT_ATTEMPTS - 1:
                    raise

    def _launch_master(self) -> _Master:
        argv = [
            str(_find_binary("mooncake_master")),
            f"--rpc_port={self.master_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--http_metadata_server_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--metrics_host={self.host}",
            *([f"--client_ttl={self.client_ttl}"] if self.client_ttl is not None else []),
            *self.master_args,
        ]
        return _process.launch(
            _Master,
            argv,
            self._log("master"),
            timeout=self.start_timeout,
            env=self._child_env,
            url=f"http://{self.host}:{self.metrics_port}/health",
            method="GET",
            other_ports=(self.master_port, self.metadata_port),
        )

    def _launch_storage(self, index: int) -> _process.TcpChild:
        """Start storage process ``index``; it serves its RPC port once it has mounted."""
        port = free_port()
        argv = [
            str(_find_binary("mooncake_client")),
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={self.segment_size}",
            "--local_buffer_size=0",
            f"--host={self.host}",
            f"--port={port}",
            "--protocol=tcp",
        ]
        return _process.launch(
            _process.TcpChild,
            argv,
            self._log(f"storage-{index}"),
            timeout=self.start_timeout,
            env=self._child_env,
            host=self.host,
            port=port,
        )

    def _metric_lines(self) -> list[tuple[str, str, float]]:
        with urllib.request.urlopen(self.metrics_url, timeout=_HTTP_TIMEOUT_S) as resp:
            text = resp.read().decode(errors="replace")
        lines = []
        for name, labels, value in _METRIC_LINE.findall(text):
            with contextlib.suppress(ValueError):
                lines.append((name, labels, float(value)))
        return lines

    def _capacity(self) -> int:
        try:
            return int(self.metrics().get("master_total_capacity_bytes", 0))
        except OSError:
            return -1

    def _wait_for(self, condition: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Poll ``condition``; fail early if a process died, with the logs' tails."""
        deadline = time.monotonic() + timeout
        while not condition():
            names = ["master", *(f"storage-{i}" for i in range(len(self._storage)))]
            children = [self._master, *self._storage]
            dead = [n for n, c in zip(names, children) if c is not None and not c.running()]
            if dead or time.monotonic() > deadline:
                reason = f"{', '.join(dead)} exited" if dead else f"timed out after {timeout} s"
                tails = "\n".join(
                    f"--- {n}.log:\n{_process.log_tail(self._log(n), 20)}" for n in names
                )
                raise RuntimeError(f"waiting for {what}: {reason}\n{tails}")
            time.sleep(_POLL_S)
