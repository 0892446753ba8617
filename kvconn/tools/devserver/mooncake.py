"""Throwaway Mooncake Store clusters on loopback, for tests and ``kvconn dev-server``.

The Mooncake backend is only trustworthy when tested against the real store, so
:class:`MooncakeCluster` starts one ``mooncake_master`` (with its embedded HTTP
metadata server) and N standalone storage processes (``mooncake_client``) on free
``127.0.0.1`` ports, each logging into one temporary directory.

Why standalone storage processes: in Mooncake, memory is contributed by clients,
and an object lives in the segment of the process that mounted it. A test client
that mounted its own segment would take its objects with it when it closes, so
the clients a test creates mount nothing (``global_segment_size=0``, see
:attr:`MooncakeCluster.options`) and the data lives in storage processes that
outlive them, as in a real deployment.

Facts this module relies on (measured against mooncake-transfer-engine 0.3.13,
see ``docs/notes/mooncake-api.md``):

* the master's admin server (``--metrics_port``) serves ``/health`` and Prometheus
  ``/metrics``; ``master_total_capacity_bytes`` is how we know a storage process
  has mounted its segment;
* ``mooncake_client`` does not unmount on SIGTERM (it just exits); the master keeps
  a dead process's segment, and keeps placing puts into it, until ``client_ttl``
  seconds (default 10) pass without a heartbeat;
* storage processes re-mount by themselves when a master restarts on the same
  ports, but every object is lost: object metadata lives only in the master.

Every started process runs in its own session (process group) so a stop reaches
its children too, is recorded, and an ``atexit`` hook kills whatever a test forgot
to stop. A process killed with SIGKILL cannot run that hook; on Linux, processes
started from the main thread also get ``PR_SET_PDEATHSIG`` so they die with it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvconn.config import parse_size as parse_bytes
from kvconn.tools.devserver import _live
from kvconn.tools.devserver._ports import free_port, log_tail, wait_for_port

__all__ = ["MooncakeCluster", "add_arguments", "main", "parse_size", "run"]

HOST = "127.0.0.1"

_INSTALL_HINT = "pip install 'kvconn[mooncake]'"
_IBVERBS_HINT = "apt-get install libibverbs1"
_MASTER_BINARY = "mooncake_master"
_STORAGE_BINARY = "mooncake_client"
#: Environment variables that override where the binaries are found.
_MASTER_ENV = "KVCONN_DEV_MOONCAKE_MASTER"
_STORAGE_ENV = "KVCONN_DEV_MOONCAKE_CLIENT"

_DEFAULT_SEGMENT_SIZE = 256 * 2**20
_DEFAULT_LOCAL_BUFFER_SIZE = 64 * 2**20
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_PORT_ATTEMPTS = 3
_POLL_INTERVAL_S = 0.05
_HTTP_TIMEOUT_S = 2.0

#: What gflags prints for a bad command line (``master_args``); not worth a retry.
_CONFIG_ERROR = "ERROR: "
_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)\s*$")


# --------------------------------------------------------------------------- #
# Discovery
# --------------------------------------------------------------------------- #


def _package_binary(name: str) -> Path | None:
    """Return the binary shipped inside the ``mooncake`` wheel, if any.

    The wheel also installs console scripts of the same names, but those are
    Python wrappers (and, under pyenv, shell shims) around the same file; running
    the real binary directly starts faster and keeps the pid we signal the pid that
    serves.
    """
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / name
        if candidate.is_file():
            return candidate
    return None


def _find_binary(name: str, env_var: str) -> Path | None:
    """Locate ``name``: the override in ``env_var``, the wheel's copy, then ``PATH``."""
    override = os.environ.get(env_var)
    if override:
        return Path(override)
    packaged = _package_binary(name)
    if packaged is not None:
        return packaged
    on_path = shutil.which(name)
    return Path(on_path) if on_path else None


def _ibverbs_problem() -> str | None:
    """Say why ``libibverbs`` cannot be loaded, or None if it can.

    Every Mooncake binary and ``mooncake.store`` link against it even when only
    TCP is used; without it they die at load time with a linker message that does
    not say which package to install.
    """
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as exc:
        return f"libibverbs missing ({exc}): {_IBVERBS_HINT}"
    return None


def _binary_problem(path: Path | None, name: str, env_var: str) -> str | None:
    """Say why ``path`` cannot run, or None if ``path --version`` succeeds."""
    if path is None:
        return f"{name} not found (nor ${env_var}): {_INSTALL_HINT}"
    if not path.is_file():
        return f"{name} not found at {path}: {_INSTALL_HINT}"
    if not os.access(path, os.X_OK):
        return f"{name} at {path} is not executable"
    try:
        proc = subprocess.run(
            [str(path), "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{name} at {path} cannot run: {exc}"
    if proc.returncode != 0:
        out = proc.stdout.decode(errors="replace").strip()
        return f"{name} at {path} cannot run (exit {proc.returncode}): {out[-500:]}"
    return None


def parse_size(value: str | int) -> int:
    """Parse ``268435456``, ``256MiB``, ``256mb``, ``1g`` into bytes (binary units).

    Mooncake's own tools read sizes this way (``"4 GB"`` means 4 GiB), so the
    dev-server command accepts the same spellings.
    """
    if isinstance(value, int):
        return value
    size = parse_bytes(value)
    if size is None:
        raise ValueError(f"not a size: {value!r} (examples: 268435456, 256MiB, 1GiB)")
    return size


# --------------------------------------------------------------------------- #
# Process handling
# --------------------------------------------------------------------------- #


def _death_signal_hook() -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that makes the child die with its parent, if safe.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, so it is only
    set for children started from the main thread (a pytest worker's main thread
    lives as long as the process). It covers what atexit cannot: a test runner
    killed with SIGKILL.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


class _Process:
    """One child process in its own session, with its log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str]):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed in wait()
        self._log.write(f"$ {' '.join(argv)}\n".encode())
        self._log.flush()
        try:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                preexec_fn=_death_signal_hook(),  # main thread only, see there
            )
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole process group (the child and anything it forked)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for exit; close the log once it has exited."""
        try:
            self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return False
        self._log.close()
        return True

    def kill(self) -> None:
        """SIGKILL the group and reap the child, so no zombie is left either."""
        self.signal_group(signal.SIGKILL)
        self.wait(_STOP_TIMEOUT_S)


def _stop_all(processes: Sequence[_Process], timeout: float) -> None:
    """SIGTERM every process at once, then SIGKILL the stragglers (one shared deadline)."""
    for p in processes:
        if p.alive():
            p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in processes:
        p.wait(deadline - time.monotonic())
    for p in processes:
        p.kill()


# --------------------------------------------------------------------------- #
# The cluster
# --------------------------------------------------------------------------- #


class MooncakeCluster:
    """A master plus ``storage_processes`` standalone storage processes on loopback.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. Clients connect
    with :attr:`options`, which mount no memory of their own, so everything they put
    lives in the storage processes. ``segment_size`` bytes are contributed by each
    storage process.

    ``master_args`` are appended to the master's command line (gflags: a later flag
    wins, so they can override what this class sets). ``client_ttl`` (seconds) is
    how long the master keeps a silent process's segment; the master's default is
    10, a fault test that kills storage may want 2-3. ``env`` is added to the
    children's environment (e.g. ``MC_LOG_LEVEL``).
    """

    def __init__(
        self,
        storage_processes: int = 1,
        segment_size: int = _DEFAULT_SEGMENT_SIZE,
        host: str = HOST,
        master_args: Sequence[str] = (),
        *,
        local_buffer_size: int = _DEFAULT_LOCAL_BUFFER_SIZE,
        client_ttl: int | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        start_timeout: float = _START_TIMEOUT_S,
        master_binary: str | os.PathLike[str] | None = None,
        storage_binary: str | os.PathLike[str] | None = None,
    ) -> None:
        if storage_processes < 0:
            raise ValueError(f"storage_processes must be >= 0, got {storage_processes}")
        if segment_size < 16 * 2**20:
            # mooncake_client aborts below this with an unhelpful message
            raise ValueError(f"segment_size must be >= 16 MiB, got {segment_size}")
        self.storage_processes = storage_processes
        self.segment_size = int(segment_size)
        self.host = host
        self.master_args = list(master_args)
        self.local_buffer_size = int(local_buffer_size)
        self.client_ttl = client_ttl
        self.start_timeout = start_timeout
        self._extra_env = dict(env or {})
        self._master_binary = (
            Path(master_binary) if master_binary else _find_binary(_MASTER_BINARY, _MASTER_ENV)
        )
        self._storage_binary = (
            Path(storage_binary) if storage_binary else _find_binary(_STORAGE_BINARY, _STORAGE_ENV)
        )
        self._user_log_dir = Path(log_dir) if log_dir is not None else None
        self._dir: Path | None = None
        self._master: _Process | None = None
        self._storage: list[_Process | None] = []
        self._lock = threading.RLock()
        self.master_port = 0
        self.metadata_port = 0
        self.metrics_port = 0

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"MooncakeCluster({state}, master={self.host}:{self.master_port}, "
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

        ``global_segment_size`` is 0 on purpose: a client that mounted memory would
        hold the objects it puts and lose them when it closes.
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
        return self._master is not None and self._master.alive()

    @property
    def log_dir(self) -> Path | None:
        """Where ``master.log`` and ``storage-<i>.log`` are written (None before start)."""
        return self._dir

    @property
    def pids(self) -> list[int]:
        """Pids of every live process of this cluster (master first)."""
        procs = [self._master, *self._storage]
        return [p.pid for p in procs if p is not None and p.alive()]

    def storage_alive(self, index: int) -> bool:
        proc = self._storage[index] if 0 <= index < len(self._storage) else None
        return proc is not None and proc.alive()

    @staticmethod
    def available(
        master_binary: str | os.PathLike[str] | None = None,
        storage_binary: str | os.PathLike[str] | None = None,
    ) -> str | None:
        """Return None if a cluster can start here, else a human reason (for ``skip``)."""
        problem = _ibverbs_problem()
        if problem is not None:
            return problem
        master = Path(master_binary) if master_binary else _find_binary(_MASTER_BINARY, _MASTER_ENV)
        problem = _binary_problem(master, _MASTER_BINARY, _MASTER_ENV)
        if problem is not None:
            return problem
        storage = (
            Path(storage_binary) if storage_binary else _find_binary(_STORAGE_BINARY, _STORAGE_ENV)
        )
        return _binary_problem(storage, _STORAGE_BINARY, _STORAGE_ENV)

    # -- lifecycle ---------------------------------------------------------- #

    def start(self) -> MooncakeCluster:
        """Start the master and the storage processes; return once all are mounted.

        Raises :class:`RuntimeError` (with the tail of the failing process's log) if
        anything does not come up within ``start_timeout`` seconds; nothing is left
        running in that case.
        """
        with self._lock:
            if self._master is not None:
                raise RuntimeError(f"{self!r} is already started")
            problem = self.available(self._master_binary, self._storage_binary)
            if problem is not None:
                raise RuntimeError(f"cannot start a Mooncake cluster: {problem}")
            self._make_dir()
            _live.track(self, self.stop)
            try:
                self._start_master_with_retries()
                self._storage = []
                for index in range(self.storage_processes):
                    self._storage.append(self._launch_storage(index))
                for index in range(self.storage_processes):
                    self._wait_storage_port(index)
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
            procs = [p for p in (*self._storage, self._master) if p is not None]
            _stop_all(procs, _STOP_TIMEOUT_S)
            self._storage = []
            self._master = None
            if self._dir is not None and self._user_log_dir is None:
                shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            _live.untrack(self)

    def kill_master(self) -> None:
        """SIGKILL the master (and its metadata server); storage processes live on.

        Clients then get ``-900`` (RPC_FAIL) from every call, each after ~4 s.
        """
        with self._lock:
            if self._master is not None:
                self._master.kill()

    def restart_master(self) -> None:
        """(Re)start the master on the same ports and wait for storage to re-mount.

        Every object is gone afterwards (the master holds all object metadata);
        the live storage processes re-mount their segments on their own, within a
        few seconds, and this returns once the master sees all of them.
        """
        with self._lock:
            if self._dir is None:
                raise RuntimeError(f"{self!r} was never started")
            if self._master is not None:
                self._master.kill()
            self._master = self._launch_master()
            self._wait_master_ready(self._master)
            live = sum(1 for i in range(len(self._storage)) if self.storage_alive(i))
            self.wait_for_capacity(live * self.segment_size)

    def kill_storage(self, index: int, *, wait_unmounted: bool = False) -> None:
        """SIGKILL storage process ``index``; its objects' replicas are lost.

        The master notices only after ``client_ttl`` s without a heartbeat; until
        then ``is_exist`` still reports its objects and puts may still be placed
        in its segment (they fail with ``-800``). ``wait_unmounted=True`` waits
        until the master has dropped the segment.
        """
        with self._lock:
            proc = self._storage[index]
            if proc is None:
                return
            before = self._capacity()
            proc.kill()
            self._storage[index] = None
            if wait_unmounted:
                ttl = self.client_ttl if self.client_ttl is not None else 10
                self._wait_for(
                    lambda: self._capacity() <= before - self.segment_size,
                    timeout=ttl * 3 + self.start_timeout,
                    what=f"the master to drop storage-{index}'s segment",
                    log=self._master.log_path if self._master else None,
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
        """The master's unlabelled Prometheus metrics (e.g. ``master_key_count``).

        Raises :class:`OSError` if the master does not answer.
        """
        out: dict[str, float] = {}
        for name, labels, value in self._metric_lines():
            if not labels:
                out[name] = value
        return out

    def segments(self) -> dict[str, int]:
        """Mounted segments as the master sees them: name -> capacity in bytes."""
        out: dict[str, int] = {}
        for name, labels, value in self._metric_lines():
            if name == "segment_total_capacity_bytes":
                match = re.search(r'segment="([^"]*)"', labels)
                if match:
                    out[match.group(1)] = int(value)
        return out

    def wait_for_capacity(self, total_bytes: int, timeout: float | None = None) -> None:
        """Block until the master counts at least ``total_bytes`` of mounted memory."""
        self._wait_for(
            lambda: self._capacity() >= total_bytes,
            timeout=self.start_timeout if timeout is None else timeout,
            what=f"{total_bytes} bytes of storage to be mounted",
            log=None,
        )

    # -- internals ---------------------------------------------------------- #

    def _make_dir(self) -> None:
        if self._user_log_dir is not None:
            self._user_log_dir.mkdir(parents=True, exist_ok=True)
            self._dir = self._user_log_dir
        else:
            self._dir = Path(tempfile.mkdtemp(prefix=f"kvconn-mooncake-{os.getpid()}-"))

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # A user's MOONCAKE_CONFIG_PATH must not reconfigure a throwaway cluster.
        env.pop("MOONCAKE_CONFIG_PATH", None)
        # Without this the transfer engine advertises the first non-loopback
        # interface's address (e.g. eth0) and storage traffic leaves loopback.
        env["MC_TCP_BIND_ADDRESS"] = self.host
        env.update(self._extra_env)
        return env

    def _master_argv(self) -> list[str]:
        assert self._master_binary is not None
        argv = [
            str(self._master_binary),
            f"--rpc_port={self.master_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--http_metadata_server_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--metrics_host={self.host}",
        ]
        if self.client_ttl is not None:
            argv.append(f"--client_ttl={self.client_ttl}")
        return argv + self.master_args

    def _launch_master(self) -> _Process:
        assert self._dir is not None
        return _Process("master", self._master_argv(), self._dir / "master.log", self._child_env())

    def _start_master_with_retries(self) -> None:
        """Pick free ports and start the master; retry with new ports if it dies.

        ``free_port`` closes its probe socket, so another process may take a port
        before the master binds it. The master says little when that happens (a
        busy RPC port: exit 1 and no error line), so any early exit is retried,
        except a command-line error, which no other port would fix.
        """
        last: RuntimeError | None = None
        for _ in range(_PORT_ATTEMPTS):
            taken: set[int] = set()
            for attr in ("master_port", "metadata_port", "metrics_port"):
                port = free_port(self.host)
                while port in taken:
                    port = free_port(self.host)
                taken.add(port)
                setattr(self, attr, port)
            self._master = self._launch_master()
            try:
                self._wait_master_ready(self._master)
                return
            except RuntimeError as exc:
                last = exc
                self._master.kill()
                log = log_tail(self._master.log_path, 50)
                self._master = None
                if _CONFIG_ERROR in log:
                    break  # a bad flag fails the same way on any port
        assert last is not None
        raise last

    def _wait_master_ready(self, master: _Process) -> None:
        deadline = time.monotonic() + self.start_timeout
        for port in (self.master_port, self.metadata_port, self.metrics_port):
            wait_for_port(
                self.host,
                port,
                timeout=max(deadline - time.monotonic(), 0.1),
                proc=master.proc,
                log_path=master.log_path,
            )
        self._wait_for(
            self._master_healthy,
            timeout=max(deadline - time.monotonic(), 0.1),
            what="the master to report service_ready",
            log=master.log_path,
            proc=master,
        )

    def _master_healthy(self) -> bool:
        url = f"http://{self.host}:{self.metrics_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as resp:
                body = json.loads(resp.read().decode())
        except (OSError, ValueError):
            return False
        return bool(body.get("service_ready", True)) if isinstance(body, dict) else True

    def _launch_storage(self, index: int) -> _Process:
        assert self._dir is not None and self._storage_binary is not None
        argv = [
            str(self._storage_binary),
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={self.segment_size}",
            "--local_buffer_size=0",
            f"--host={self.host}",
            f"--port={free_port(self.host)}",
            "--protocol=tcp",
        ]
        return _Process(
            f"storage-{index}", argv, self._dir / f"storage-{index}.log", self._child_env()
        )

    def _wait_storage_port(self, index: int) -> None:
        """Wait until storage ``index`` serves its RPC port (it mounts before that)."""
        proc = self._storage[index]
        assert proc is not None
        port = int(next(a for a in proc.argv if a.startswith("--port=")).split("=", 1)[1])
        wait_for_port(
            self.host, port, timeout=self.start_timeout, proc=proc.proc, log_path=proc.log_path
        )

    def _metric_lines(self) -> list[tuple[str, str, float]]:
        with urllib.request.urlopen(self.metrics_url, timeout=_HTTP_TIMEOUT_S) as resp:
            text = resp.read().decode(errors="replace")
        out: list[tuple[str, str, float]] = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _METRIC_LINE.match(line)
            if match is None:
                continue
            with contextlib.suppress(ValueError):
                out.append((match.group(1), match.group(2) or "", float(match.group(3))))
        return out

    def _capacity(self) -> int:
        try:
            return int(self.metrics().get("master_total_capacity_bytes", 0))
        except (OSError, urllib.error.URLError):
            return -1

    def _wait_for(
        self,
        condition: Callable[[], bool],
        *,
        timeout: float,
        what: str,
        log: Path | None,
        proc: _Process | None = None,
    ) -> None:
        """Poll ``condition``; on timeout raise with the relevant log tails."""
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                return
            dead = self._dead_processes() if proc is None else ([proc] if not proc.alive() else [])
            if dead or time.monotonic() >= deadline:
                reason = (
                    f"{', '.join(p.name for p in dead)} exited"
                    if dead
                    else f"timed out after {timeout:.1f} s"
                )
                raise RuntimeError(f"waiting for {what}: {reason}\n{self._log_report(log, dead)}")
            time.sleep(_POLL_INTERVAL_S)

    def _dead_processes(self) -> list[_Process]:
        procs = [self._master, *self._storage]
        return [p for p in procs if p is not None and not p.alive()]

    def _log_report(self, log: Path | None, dead: Sequence[_Process]) -> str:
        paths: list[Path] = [p.log_path for p in dead]
        if log is not None and log not in paths:
            paths.append(log)
        if not paths:
            paths = [p.log_path for p in (self._master, *self._storage) if p is not None]
        return "\n".join(f"--- tail of {path.name}:\n{log_tail(path, 20)}" for path in paths)


# --------------------------------------------------------------------------- #
# ``kvconn dev-server mooncake``
# --------------------------------------------------------------------------- #


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvconn dev-server mooncake``."""
    parser.add_argument(
        "--storage-processes", type=int, default=1, help="standalone storage processes (1)"
    )
    parser.add_argument(
        "--segment-size",
        type=parse_size,
        default=_DEFAULT_SEGMENT_SIZE,
        help="memory each storage process contributes, e.g. 256MiB, 1GiB (256MiB)",
    )
    parser.add_argument("--host", default=HOST, help="address to bind (127.0.0.1)")
    parser.add_argument(
        "--client-ttl", type=int, default=None, help="master --client_ttl seconds (10)"
    )
    parser.add_argument(
        "--log-dir", default=None, help="keep logs here instead of a temporary directory"
    )
    parser.add_argument("--json", action="store_true", help="print the options as one JSON line")
    parser.add_argument(
        "master_args", nargs="*", help="extra mooncake_master flags (after --)", default=[]
    )


def run(args: argparse.Namespace) -> int:
    """Start a cluster, print how to reach it, and keep it up until Ctrl-C / SIGTERM.

    Ctrl-C at any point (even during start-up) is a normal stop: exit code 0.
    """
    problem = MooncakeCluster.available()
    if problem is not None:
        print(f"mooncake dev server unavailable: {problem}", file=sys.stderr)
        return 1
    cluster = MooncakeCluster(
        storage_processes=args.storage_processes,
        segment_size=args.segment_size,
        host=args.host,
        master_args=args.master_args,
        client_ttl=args.client_ttl,
        log_dir=args.log_dir,
    )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with cluster:
            _print_cluster(cluster, as_json=args.json)
            while not stop.wait(0.5):
                if not cluster.running:
                    print("mooncake_master exited; stopping", file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        pass  # the with-block has already stopped the cluster
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _print_cluster(cluster: MooncakeCluster, *, as_json: bool) -> None:
    """Tell the user (or a script reading one JSON line) how to reach ``cluster``."""
    if as_json:
        print(json.dumps(cluster.options), flush=True)
        return
    print(f"mooncake master   {cluster.master_address}")
    print(f"metadata server   {cluster.metadata_server}")
    print(f"metrics           {cluster.metrics_url}")
    print(f"storage           {cluster.storage_processes} x {cluster.segment_size} bytes")
    print(f"logs              {cluster.log_dir}")
    print(f"backend options   {json.dumps(cluster.options)}")
    for key, value in cluster.env.items():
        print(f"export {key}={value!r}")
    print("Ctrl-C to stop.", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvconn.tools.devserver.mooncake``: the dev-server command on its own."""
    parser = argparse.ArgumentParser(
        prog="python -m kvconn.tools.devserver.mooncake",
        description=(__doc__ or "").strip().split("\n\n")[0],
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
