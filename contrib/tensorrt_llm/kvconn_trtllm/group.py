"""The TP group kvconn stripes loads over, for an engine whose ranks talk through MPI.

TensorRT-LLM 1.2 runs its ranks as MPI processes and, launched through MPI, does not
initialize ``torch.distributed``: there is no process group to hand kvconn. With
kvconn's ``stripe_reads = true`` the adapter makes one, with gloo: rank 0 opens
a ``torch.distributed`` store on a free port, every rank learns its address through the
engine's own MPI allgather, and every rank joins. If ``torch.distributed`` is already
initialized (a launch through torch's own collectives), its world is the TP group (the
adapter refuses pipeline parallelism and attention DP) and kvconn takes a gloo group of
its own over it. Either way the group is kvconn's alone: its loads' collectives run on
a transfer thread and must not interleave with the engine's.

Gloo moves the pages through host memory: each load's pages are verified in pinned
staging, exchanged there and copied to the GPU once, as an unstriped load copies them.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

from kvconn.errors import ConfigError

#: A rank that died leaves the others in a collective this long, not gloo's 30 minutes.
GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def tp_group(rank: int, tp_size: int, allgather: Callable[[Any], list[Any]]) -> Any:
    """A gloo group of the TP ranks in TP order, for ``Connector(group=...)``.

    Collective over the engine's ranks: every rank calls it once, at the same point
    (``register_kv_caches``). ``allgather`` is the engine's MPI allgather.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        store = None
        port = None
        if rank == 0:
            # port 0: the store picks a free port, told to the others below
            store = dist.TCPStore(  # type: ignore[attr-defined]  # exported, not declared
                "0.0.0.0", 0, tp_size, True, timeout=GROUP_TIMEOUT, wait_for_workers=False
            )
            port = store.port
        peers = allgather((socket.gethostname(), port))
        host0, port0 = peers[0]
        # one node (the usual TP group): loopback; else rank 0's host name
        host = "127.0.0.1" if all(h == host0 for h, _ in peers) else host0
        if store is None:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port0, tp_size, False, timeout=GROUP_TIMEOUT
            )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=tp_size, timeout=GROUP_TIMEOUT
        )
    elif dist.get_world_size() != tp_size or dist.get_rank() != rank:
        raise ConfigError(
            f"torch.distributed's world ({dist.get_world_size()} ranks, this one "
            f"{dist.get_rank()}) is not the TP group ({tp_size} ranks, this one {rank}); "
            "turn stripe_reads off"
        )
    return dist.new_group(list(range(tp_size)), backend="gloo", timeout=GROUP_TIMEOUT)
