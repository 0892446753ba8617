"""Server processes that mirakuru starts, waits for and stops, and that die with us.

mirakuru runs each server in its own session (a stop reaches whatever it forked),
waits until its port (or HTTP endpoint) answers, and kills leftovers when the
interpreter exits. It cannot act when this process is SIGKILLed; on Linux the child
asks the kernel for that (``PR_SET_PDEATHSIG``) before it executes the server, so a
test runner killed mid-run leaves no redis-server or mooncake process behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mirakuru import HTTPExecutor, SimpleExecutor, TCPExecutor
from mirakuru.exceptions import (
    AlreadyRunning,
    ProcessExitedWithError,
    ProcessFinishedWithError,
    TimeoutExpired,
)

__all__ = ["HttpChild", "StartError", "TcpChild", "cannot_run", "launch", "log_tail", "stop"]

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.01  # a redis-server listens ~10 ms after exec


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


def _new_session_dying_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: a session of its own (as mirakuru does) and SIGKILL when we die.

    The kernel sends the death signal when the *thread* that forked exits, so it is
    only asked for from the main thread, which lives as long as the process.
    """
    parent = os.getpid()
    prctl: Any = None
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        os.setsid()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # we died before the request took effect
                os._exit(1)

    return preexec


class _DiesWithParent(SimpleExecutor):
    @property
    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = super()._popen_kwargs
        kwargs["preexec_fn"] = _new_session_dying_with_parent()
        return kwargs


class TcpChild(_DiesWithParent, TCPExecutor):
    """Ready once its port accepts connections."""


class HttpChild(_DiesWithParent, HTTPExecutor):
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
            child.start()
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


def stop(child: SimpleExecutor | None, *, kill: bool = False) -> None:
    """SIGTERM (or SIGKILL) the child's process group and reap it; a paused child too."""
    if child is None or child.process is None:
        return
    if kill:
        child.kill()
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.process.pid, signal.SIGCONT)  # a paused server must see SIGTERM
    with contextlib.suppress(ProcessFinishedWithError):  # how a dev server exits is no news
        child.stop()
