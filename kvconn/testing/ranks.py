"""Run one function per rank in its own spawned process and collect what each returns.

Engine adapters' tests start TP groups of real processes (an engine's ranks are
processes); this is the part they share: start, wait for one payload per rank with a
deadline, notice a rank that died, and never leave a process behind.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any


def run_ranks(
    target: Callable[..., None], world: int, args: Sequence[Any] = (), *, timeout_s: float
) -> list[Any]:
    """Call ``target(rank, *args, results)`` in ``world`` processes; payloads by rank.

    ``target`` must put exactly one ``(rank, payload)`` on ``results`` (the queue passed
    last), including when it fails, so the caller can report the failure; a rank that
    exits without doing so is an error, and so is passing ``timeout_s``.
    """
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(rank, *args, results), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{world - len(out)} of {world} ranks did not finish in {timeout_s:.0f}s"
                )
            try:
                rank, payload = results.get(timeout=min(left, 2.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank died with exit code {dead[0]}") from None
                continue
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]
