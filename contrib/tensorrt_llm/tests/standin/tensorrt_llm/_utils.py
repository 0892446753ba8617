"""``mpi_rank`` / ``mpi_broadcast`` / ``mpi_allgather`` (stand-in).

In TensorRT-LLM each rank is an MPI process and these are collectives over the world
communicator. Here the stand-in executor starts the ranks as processes, sets the rank
in their environment and installs a group of queues (``install_group``); without a
group (one process, unit tests) the collectives see a world of one.

A rank whose executor stopped (``abandon_group``) makes its peers' next collective
raise instead of waiting, so a test sees at once what would hang a real TP group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

RANK_ENV = "TRTLLM_STANDIN_RANK"
#: how long a collective waits for a peer before calling the group hung
COLLECTIVE_TIMEOUT_S = 60.0

_DEAD = "__standin_rank_stopped__"


class _Group:
    def __init__(self, rank: int, inboxes: Sequence[Any]) -> None:
        self.rank = rank
        self.inboxes = inboxes
        self.calls = 0
        #: why the group can no longer agree (a rank stopped); later collectives raise
        self.broken: str | None = None

    def exchange(self, obj: Any) -> list[Any]:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self.calls += 1
        for peer, box in enumerate(self.inboxes):
            if peer != self.rank:
                box.put((self.calls, self.rank, obj))
        got = {self.rank: obj}
        while len(got) < len(self.inboxes):
            call, peer, value = self.inboxes[self.rank].get(timeout=COLLECTIVE_TIMEOUT_S)
            if call == _DEAD:
                self.broken = f"rank {peer}'s executor stopped: {value}"
                raise RuntimeError(self.broken)
            if call != self.calls:
                raise RuntimeError(
                    f"collective {call} from rank {peer} met collective {self.calls}"
                )
            got[peer] = value
        return [got[r] for r in range(len(self.inboxes))]


_group: _Group | None = None


def install_group(rank: int, inboxes: Sequence[Any]) -> None:
    """Stand-in only: this process is ``rank`` of a group that talks through ``inboxes``."""
    global _group
    _group = _Group(rank, inboxes)


def abandon_group(reason: str) -> None:
    """Stand-in only: this rank's executor stopped; peers' collectives now raise."""
    if _group is not None:
        _group.broken = f"this rank's executor stopped: {reason}"
        for peer, box in enumerate(_group.inboxes):
            if peer != _group.rank:
                box.put((_DEAD, _group.rank, reason))


def mpi_rank() -> int:
    return int(os.environ.get(RANK_ENV, "0"))


def mpi_broadcast(obj: Any, root: int = 0) -> Any:
    return obj if _group is None else _group.exchange(obj)[root]


def mpi_allgather(obj: Any) -> Any:
    return [obj] if _group is None else _group.exchange(obj)
