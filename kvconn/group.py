"""The TP group a connector exchanges striped pages over: agreement and page transfers.

An engine hands its connector a ``torch.distributed`` process group whose ranks are
exactly its TP group, in TP-rank order (gloo on CPUs; NCCL on GPUs, where the pages
travel between devices). Three kinds of calls go over it, and only these:

* :meth:`TpGroup.agree` — one small ``all_reduce(MIN)`` per chunk of a load: the first
  block that failed on any rank, and a digest of the chunk's block hashes, so every rank
  learns the same good prefix and that every rank is loading the same blocks;
* :meth:`TpGroup.exchange` — point-to-point sends and receives of verified staging
  rows (``batch_isend_irecv``), only between replicas of one shard, only for blocks of
  the agreed prefix;
* :meth:`TpGroup.gather` — one small ``all_gather`` per replica check: every rank's
  digests of the pages it holds with others (:mod:`kvconn.replica_check`).

Collectives must be issued in the same order on every rank. So a connector makes them
one load or check at a time (:attr:`TpGroup.lock`), and the engine must submit the same
loads and saves in the same order on every rank — which engines do: the scheduler's
metadata, broadcast to every worker, names them. The group should be kvconn's own (the
engine's TP ranks in a group of its own, ``torch.distributed.new_group(ranks)``):
kvconn's collectives run on a transfer thread, and on a group the engine also uses from
its forward pass the two streams of collectives could interleave differently on
different ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvconn.errors import ConfigError

__all__ = ["Agreement", "TpGroup", "Transfer"]


@dataclass(frozen=True)
class Agreement:
    """What a chunk's agreement told every rank alike."""

    good: int  # blocks of the chunk every page of which arrived verified, on every rank
    same_blocks: bool  # whether every rank was loading the same blocks


@dataclass(frozen=True)
class Transfer:
    """One point-to-point move of staging rows: to (send) or from (receive) ``peer``."""

    peer: int  # rank in the group
    rows: torch.Tensor  # 1-D uint8, contiguous
    send: bool
    tag: int


class TpGroup:
    """A connector's view of its TP group (module docstring)."""

    def __init__(self, group: Any, *, rank: int, tp_size: int) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise ConfigError(
                f"group must be a torch.distributed ProcessGroup of the TP ranks, got {group!r:.80}"
            )
        size = dist.get_world_size(group)
        if size != tp_size:
            raise ConfigError(
                f"the group has {size} ranks but the layout's TP size is {tp_size}: hand kvconn "
                "a group of exactly the TP ranks, in TP-rank order"
            )
        self.group = group
        self.rank = rank
        self.size = size
        self.group_rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        #: Where collectives' tensors live: NCCL moves device memory, gloo host memory.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        #: Held by a load for all of its collectives: one load at a time per connector.
        self.lock = threading.Lock()

    def check(self, values: Sequence[int]) -> list[tuple[int, int]]:
        """The lowest and highest of each of ``values`` over the ranks (one collective,
        at start-up): equal when every rank passed the same."""
        both = [v for value in values for v in (value, -value)]
        tensor = torch.tensor(both, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        out = tensor.tolist()
        return [(out[2 * i], -out[2 * i + 1]) for i in range(len(values))]

    def agree(self, first_bad: int, digest: int) -> Agreement:
        """The group's good prefix of a chunk: the MIN of every rank's first failed block.

        ``digest`` names the chunk's blocks (:func:`kvconn.stripe.chunk_digest`); if
        the ranks' digests differ, they are not loading the same blocks and nothing of
        the chunk may be exchanged: every rank learns it here, alike.
        """
        tensor = torch.tensor([first_bad, digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        good, low, minus_high = tensor.tolist()
        same = low == -minus_high
        return Agreement(good if same else 0, same)

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64, the same count on every rank), by group rank."""
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.group)
        return [t.tolist() for t in out]

    def exchange(self, transfers: Sequence[Transfer]) -> None:
        """Run every send and receive of a chunk at once and wait for all of them.

        Both ends derive the same transfers from the block hashes, in the same order,
        so each send meets its receive (gloo matches by peer and tag, NCCL by order).
        """
        if not transfers:
            return
        ops = [
            dist.P2POp(
                dist.isend if t.send else dist.irecv,
                t.rows,
                group=self.group,
                group_peer=t.peer,
                tag=t.tag,
            )
            for t in transfers
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
