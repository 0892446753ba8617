"""How much memory a simulation will take, checked against the machine before it starts.

Every rank is a process holding its own KV pools and staging buffer, so memory grows
with ``--tp`` times the pool size, and the pool with layers, tokens per block, bytes
per token and the longest prompt. A typo in any of them (``--tp 100000``,
``--tokens-per-block 10000000``) used to start the ranks anyway and die in one of them
with an out-of-memory traceback, or take the machine down with it; the estimate turns
that into one message naming the figure and what the machine has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvconn.errors import ConfigError
from kvconn.tools.store_options import human_bytes

#: Private memory of one rank process besides its pools and staging, measured on the
#: development machine (torch 2.13 CPU, Python 3.11; USS from /proc/<pid>/smaps_rollup):
#: ~19 MiB for a fork of the forkserver, which imported torch once; ~152 MiB for a
#: spawned process, which imports it itself. Rounded up a little: the estimate is there
#: to stop absurd runs, and must not refuse one that fits.
RANK_OVERHEAD = {"forkserver": 24 << 20, "spawn": 160 << 20}
#: The coordinator (torch, the workload, the store client) and the forkserver: ~230 +
#: ~145 MiB measured.
BASE_OVERHEAD = 384 << 20
#: Per prompt token held by the workload: a tuple slot (8 B) and a share of the int
#: objects the prompts of a conversation have in common.
BYTES_PER_WORKLOAD_TOKEN = 16


@dataclass(frozen=True)
class MemoryEstimate:
    ranks: int
    pool_bytes: int  # per rank
    staging_bytes: int  # per rank
    process_bytes: int  # per rank
    workload_bytes: int
    base_bytes: int

    @property
    def per_rank(self) -> int:
        return self.pool_bytes + self.staging_bytes + self.process_bytes

    @property
    def total(self) -> int:
        return self.ranks * self.per_rank + self.workload_bytes + self.base_bytes

    def describe(self) -> str:
        """``total: ranks x (parts) + workload + coordinator``, leaving out empty parts."""
        rank_parts = [
            f"{what} {human_bytes(n)}"
            for what, n in (
                ("pools", self.pool_bytes),
                ("staging", self.staging_bytes),
                ("process", self.process_bytes),
            )
            if n
        ]
        return (
            f"{human_bytes(self.total)}: {self.ranks} rank(s) x ({' + '.join(rank_parts)}) + "
            f"workload {human_bytes(self.workload_bytes)} + coordinator "
            f"{human_bytes(self.base_bytes)}"
        )


def estimate_memory(
    *,
    ranks: int,
    pool_sizes: Sequence[int],
    staging_bytes: int,
    prompt_tokens: int,
    start_method: str,
) -> MemoryEstimate:
    """The memory a run takes at its peak, roughly (within tens of MiB per rank).

    Staging is allocated up to what one save or load needs, never more than the
    configured bound: at most half a pool, since a rank's pool has twice the slots of
    the longest request.
    """
    pool = sum(pool_sizes)
    return MemoryEstimate(
        ranks=ranks,
        pool_bytes=pool,
        staging_bytes=min(staging_bytes, pool // 2 + (1 << 12)) if pool else 0,
        process_bytes=RANK_OVERHEAD.get(start_method, max(RANK_OVERHEAD.values())),
        workload_bytes=prompt_tokens * BYTES_PER_WORKLOAD_TOKEN,
        base_bytes=BASE_OVERHEAD,
    )


def available_memory() -> int | None:
    """Bytes this process may still use: the machine's available memory, or less under a
    cgroup (container) limit; ``None`` where neither can be read."""
    figures: list[int] = []
    unreadable = (OSError, ValueError, IndexError, AttributeError)
    with contextlib.suppress(*unreadable):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                figures.append(int(line.split()[1]) * 1024)
    if not figures:
        with contextlib.suppress(*unreadable):
            figures.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(*unreadable):  # cgroup v2
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            figures.append(max(0, int(limit) - used))
    return min(figures) if figures else None


def check_memory(estimate: MemoryEstimate, available: int | None) -> None:
    """Refuse a run that cannot fit; say how big it is and what would shrink it."""
    if available is None or estimate.total <= available:
        return
    raise ConfigError(
        f"this simulation needs about {estimate.describe()}, but the machine has "
        f"{human_bytes(available)} available; lower --tp, --layers, --tokens-per-block, "
        "the layout's bytes per token, the workload's token counts or the configured "
        "staging_bytes"
    )
