"""Loopback port helpers shared by the managed dev servers.

Every dev server binds a port that the OS picked as free, and every start waits
for the port to accept connections before tests use it. Both steps live here so
each server helper (Redis, Mooncake, ...) fails the same, readable way: with the
tail of the server's own log instead of a bare "connection refused".
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["free_port", "log_tail", "wait_for_port"]

_POLL_INTERVAL_S = 0.02


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    The OS picks it (bind to port 0), so parallel test processes do not collide
    the way a fixed port list would. The socket is closed before returning, so
    another process may grab the port in between; callers that start a server on
    it should retry with a new port when the server reports the address in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def log_tail(log_path: str | Path | None, max_lines: int = 30) -> str:
    """Return the last ``max_lines`` lines of a server log, or a placeholder.

    A server that fails to start usually says why in its log (address in use,
    bad option); putting that text into the exception saves a trip to a temp dir
    that is deleted by the time anyone looks.
    """
    if log_path is None:
        return "(no log file)"
    try:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(log {log_path} unreadable: {exc})"
    lines = text.splitlines()[-max_lines:]
    return "\n".join(lines) if lines else "(log is empty)"


def wait_for_port(
    host: str,
    port: int,
    timeout: float,
    proc: subprocess.Popen[Any] | None = None,
    log_path: str | Path | None = None,
) -> None:
    """Block until ``host:port`` accepts a TCP connection.

    Polls instead of sleeping a fixed time, so a fast start costs milliseconds
    and a slow machine still gets up to ``timeout`` seconds. If ``proc`` exits
    first, waiting on is pointless: raise at once. Either failure raises
    :class:`RuntimeError` carrying the tail of ``log_path``.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server process {proc.pid} exited with code {proc.returncode} "
                f"before {host}:{port} accepted connections; log tail:\n"
                f"{log_tail(log_path)}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{host}:{port} did not accept connections within {timeout:.1f} s; "
                f"log tail:\n{log_tail(log_path)}"
            )
        time.sleep(_POLL_INTERVAL_S)
