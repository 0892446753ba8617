"""Run one function per rank in its own process and collect what each returns.

Engine adapters' tests start TP groups of real processes (an engine's ranks are
processes); this is the part they share: start, wait for one payload per rank with a
deadline, notice a rank that died, and never leave a process behind.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvconn.testing.processes import rank_context, start

#: How often a wait for payloads looks for a rank that died without reporting.
POLL_S = 0.25
#: How long a rank that reported may take to exit before it is killed.
EXIT_GRACE_S = 10.0


def run_ranks(
    target: Callable[..., None], world: int, args: Sequence[Any] = (), *, timeout_s: float
) -> list[Any]:
    """Call ``target(rank, *args, results)`` in ``world`` processes; payloads by rank.

    ``target`` must put exactly one ``(rank, payload)`` on ``results`` (the queue passed
    last), including when it fails, so the caller can report the failure; a rank that
    exits without doing so is an error, and so is passing ``timeout_s``.
    """
    ctx = rank_context()
    results: Any = ctx.Queue()
    procs = []
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        for rank in range(world):
            procs.append(start(ctx, target, (rank, *args, results), daemon=True))
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{world - len(out)} of {world} ranks did not finish in {timeout_s:.0f}s"
                )
            try:
                rank, payload = results.get(timeout=min(left, POLL_S))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank died with exit code {dead[0]}") from None
                continue
            out[rank] = payload
        finished = True
    finally:
        # Ranks that reported exit by themselves; after a failure nothing waits for
        # the others (a hung rank would hold the caller for the whole grace period).
        grace_s = EXIT_GRACE_S if finished else 0.0
        for p in procs:
            p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]
