"""Server processes that mirakuru starts and waits for, that stop promptly, and die with us.

Each server runs in a process group of its own (a signal to the group reaches whatever
it forked), mirakuru waits until its port (or HTTP endpoint) answers, and kills
leftovers when the interpreter exits. It cannot act when this process is SIGKILLed; on
Linux the child asks the kernel for that (``PR_SET_PDEATHSIG``) before it executes the
server, so a test runner killed mid-run leaves no redis-server or mooncake process
behind.

Stopping is ours, not mirakuru's, so that Ctrl-C ends a dev server promptly whatever it
was doing (issue 15: once more than 30 s on a loaded machine):

* mirakuru's ``stop`` waits for SIGTERM to work as long as the *start* was allowed to
  take (15 s for Redis, 30 s for Mooncake) and then scans every process on the machine
  for leftovers (reading each one's environment); servers were stopped one after
  another, so a 3-node cluster could take three such waits. :func:`stop_all` signals
  every process first, waits once for all of them, no more than ``grace_s``, and then
  SIGKILLs the process groups; the groups reach whatever the servers forked, so no
  scan is needed. Our servers keep no data worth a longer wait.
* A Ctrl-C while :func:`launch` waits for a server to answer left the just-started
  process running, held by nobody, until the interpreter exited; now it is killed
  before the interrupt goes on. The fork itself runs with SIGINT and SIGTERM held back
  (the server gets them unblocked again), so no interrupt lands between the fork and
  the moment the child is ours to stop.
* An interrupt during a stop (a second Ctrl-C) SIGKILLs what is left before it goes on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mirakuru import HTTPExecutor, SimpleExecutor, TCPExecutor
from mirakuru.exceptions import AlreadyRunning, ProcessExitedWithError, TimeoutExpired

__all__ = [
    "HttpChild",
    "StartError",
    "TcpChild",
    "cannot_run",
    "launch",
    "log_tail",
    "stop",
    "stop_all",
]

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.01  # a redis-server listens ~10 ms after exec
#: How long a stop waits for SIGTERM to end the servers before it SIGKILLs them.
STOP_GRACE_S = 5.0
#: Signals that stop a dev server; held back while a child is forked (see the docstring).
_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


class StartError(RuntimeError):
    """A server did not come up. The message's first line says why; the log tail follows.

    ``rejected`` is set when the server refused an input (a flag value, a busy port):
    one line naming it, which ``kvconn dev-server`` prints as its whole error.
    """

    def __init__(self, summary: str, log_path: Path, rejected: str | None = None) -> None:
        super().__init__(f"{summary}; log tail:\n{log_tail(log_path)}")
        self.summary = summary
        self.rejected = rejected


def log_tail(log_path: Path, max_lines: int = 30) -> str:
    """The last run's last lines of a server's log: they say why a start failed (bad
    option, busy port), and the temporary directory holding them is gone by the time
    anyone looks. A run begins at the ``$ command`` line :func:`launch` writes."""
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        return f"({log_path} unreadable: {exc})"
    runs = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    return "\n".join(lines[runs[-1] if runs else 0 :][-max_lines:]) or "(log is empty)"


def cannot_run(binary: str | Path | None, hint: str) -> str | None:
    """Why ``binary --version`` does not run (a pytest skip reason), or None if it does."""
    path = shutil.which(binary) if binary is not None else None
    if path is None:
        return f"{binary or 'the server binary'} not found: {hint}"
    try:
        subprocess.run([path, "--version"], capture_output=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{binary} cannot run: {exc}"
    return None


def _own_group_dying_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: a process group of its own and SIGKILL when we die.

    A group, not a session of its own as mirakuru makes: where the kernel groups
    processes by session for scheduling (``sched_autogroup``, on by default in many
    distributions' kernels), a session of its own makes the server a scheduling group
    of its own, and an engine busy on the same CPUs starved it of any CPU for up to
    5 s (docs/performance.md, "A store server starved by the engine"). In our session
    it gets its share as any other process does. A terminal's Ctrl-C still reaches only
    the foreground group, so stopping stays ours.

    The kernel sends the death signal when the *thread* that forked exits, so it is
    only asked for from the main thread, which lives as long as the process.
    """
    parent = os.getpid()
    prctl: Any = None
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        # The fork ran with SIGINT and SIGTERM blocked (_signals_held): the server must
        # not inherit that, or it would ignore the SIGTERM that stops it.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # we died before the request took effect
                os._exit(1)

    return preexec


class _DiesWithParent(SimpleExecutor):
    @property
    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = super()._popen_kwargs
        kwargs["preexec_fn"] = _own_group_dying_with_parent()
        return kwargs


class _PortCheck(TCPExecutor):
    def pre_start_check(self) -> bool:
        """Whether the port accepts connections (also mirakuru's readiness check).

        mirakuru's own closes its socket in a ``finally``: a Ctrl-C that lands before
        the socket exists turns into ``UnboundLocalError`` there, and the interrupt is
        lost behind it (it failed a CI run of the interrupted-start test).
        """
        with socket.socket() as sock:
            try:
                sock.connect((self.host, self.port))
            except OSError:  # TimeoutError too
                return False
            return True


class TcpChild(_DiesWithParent, _PortCheck):
    """Ready once its port accepts connections."""


class HttpChild(_DiesWithParent, _PortCheck, HTTPExecutor):
    """Ready once its URL answers with the expected status."""


Child = TypeVar("Child", bound=TCPExecutor)


def launch(
    kind: type[Child],
    argv: Sequence[str],
    log_path: Path,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    **where: Any,
) -> Child:
    """Start ``argv`` (stdout and stderr appended to ``log_path``) and wait until ready.

    ``where`` is ``host=, port=`` for a :class:`TcpChild`, ``url=`` (and ``method=``,
    ``status=``) for an :class:`HttpChild`. Raises :class:`StartError` with nothing left
    running when the port is taken already, the process exits or ``timeout`` passes.
    """
    with open(log_path, "ab") as log:  # the child holds its own copy of the descriptor
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        child = kind(
            list(argv),
            timeout=timeout,
            sleep=_POLL_S,
            envvars=dict(env or {}),
            cwd=None if cwd is None else str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            **where,
        )
        name = Path(argv[0]).name
        try:
            # mirakuru's Executor.start, with the fork under held signals
            if child.pre_start_check():
                raise AlreadyRunning(child)
            with _signals_held():
                SimpleExecutor.start(child)
            child.wait_for(child.check_subprocess)
            return child
        except AlreadyRunning:
            address = f"{child.host}:{child.port}"
            raise StartError(
                f"{name}: {address} is in use already", log_path, f"{address} is in use already"
            ) from None
        except ProcessExitedWithError as exc:
            raise StartError(f"{name} exited with code {exc.exit_code}", log_path) from None
        except TimeoutExpired:  # mirakuru has killed it
            raise StartError(f"{name} not ready within {timeout:.0f} s", log_path) from None
        except BaseException:  # Ctrl-C while waiting for it: it must not outlive the wait
            stop(child, kill=True)
            raise


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (are blocked) inside; delivered, if they came, on the way out.

    Only the main thread gets them, so only there is anything held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop(child: SimpleExecutor | None, *, kill: bool = False) -> None:
    """Stop one child as :func:`stop_all` does."""
    stop_all([child], kill=kill)


def stop_all(
    children: Iterable[SimpleExecutor | None], *, kill: bool = False, grace_s: float = STOP_GRACE_S
) -> None:
    """SIGTERM every child's process group (SIGKILL with ``kill``), then reap them all.

    A paused server is sent SIGCONT first, so it sees the SIGTERM. Whatever has not
    exited ``grace_s`` after the signals were sent is SIGKILLed, one wait for all of
    them. Each group is killed before its leader is reaped, so its id cannot have been
    reused by then (a leader reaped already, by a ``poll``, is not signalled at all).
    Interrupted (a second Ctrl-C), it SIGKILLs what is left, then lets the interrupt go
    on.
    """
    held = [c for c in children if c is not None and c.process is not None]
    running = [c.process for c in held if c.process is not None and c.process.returncode is None]
    try:
        for process in running:
            if kill:
                _signal_group(process.pid, signal.SIGKILL)
            else:
                _signal_group(process.pid, signal.SIGCONT)
                _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + (0.0 if kill else grace_s)
        while not all(_exited(p.pid) for p in running) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for process in running:  # leaders exited (not yet reaped) or past the grace
            _signal_group(process.pid, signal.SIGKILL)
        for process in running:
            process.wait()
    except BaseException:
        for process in running:
            _signal_group(process.pid, signal.SIGKILL)
        raise
    for child in held:
        # Reaped: nothing is left for mirakuru's own clean-up (an environment scan of
        # every process) to find when the executor is collected.
        child.process = None


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its id stays ours until then)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
