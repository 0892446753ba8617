"""Starting the test harnesses' rank processes cheaply, as if each were spawned.

A spawned process imports torch again (~1.3 s of CPU each), and a TP group of 8 ranks
paid that 8 times per test. A fork server imports torch and kvconn once; every rank is
then a fork of that clean, single-threaded server (never of the test process, its
threads or its store clients), as ``kvconn simulate`` starts its ranks.

A fork of the server differs from a spawned child in what it inherits: its
environment and its standard output and error are the server's, fixed when the server
started, whereas a test may have set variables since (``MC_TCP_BIND_ADDRESS`` for
Mooncake ranks) and pytest may have moved the descriptors. :func:`start` hands the
child the parent's current environment and descriptors 1 and 2 with its arguments, so
the child sees what a spawned one would. (``multiprocessing`` already carries the
working directory and ``sys.path``.)
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

RankContext = SpawnContext | ForkServerContext

#: What the fork server imports before forking: torch and the parts of kvconn the ranks
#: use, ``kvconn simulate``'s too (the server is one per process, and the first caller's
#: list is the one it keeps; a module a rank needs and the server lacks is imported by the
#: rank). Never a backend: a store client may start threads at import, and a fork of a
#: process with threads is unsafe.
PRELOAD = (
    "torch",
    "kvconn.connector",
    "kvconn.config",
    "kvconn.testing.tpgroup",
    "kvconn.tools.simulate.worker",
)


def rank_context() -> RankContext:
    """The fork server (preloaded) where the platform has one, else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start(
    ctx: RankContext,
    target: Callable[..., None],
    args: Sequence[Any] = (),
    *,
    name: str | None = None,
    daemon: bool | None = None,
) -> BaseProcess:
    """Start ``target(*args)`` in a process of ``ctx`` that sees this process's
    environment and standard streams as they are now."""
    proc: BaseProcess = ctx.Process(
        target=_as_spawned,
        args=(dict(os.environ), _Streams() if _forks(ctx) else None, target, *args),
        name=name,
        daemon=daemon,
    )
    proc.start()
    return proc


class _Streams:
    """Descriptors 1 and 2 of the parent, sent to the child when it starts."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Called while the process object is pickled for the start: the one moment
        # multiprocessing passes descriptors to the fork server along with it.
        return (_attach_streams, (reduction.DupFd(1), reduction.DupFd(2)))


def _forks(ctx: RankContext) -> bool:
    return ctx.get_start_method() == "forkserver"


def _attach_streams(stdout: Any, stderr: Any) -> None:
    for fd, dup in ((1, stdout), (2, stderr)):
        received = dup.detach()
        if received != fd:
            os.dup2(received, fd)
            os.close(received)


def _as_spawned(
    environ: dict[str, str], streams: None, target: Callable[..., None], *args: Any
) -> None:
    """Run in the child: the parent's environment, then the target.

    ``streams`` was already applied while the arguments were unpickled (see
    :class:`_Streams`); it arrives here as ``None``.
    """
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
