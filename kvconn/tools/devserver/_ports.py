"""Free loopback ports for the dev servers, picked by port-for.

port-for draws from ports no service is registered for and outside the ephemeral
range, so a port it hands out is not grabbed by some outgoing connection before the
server binds it; the server helpers still retry with a new port when they lose a race.
"""

from __future__ import annotations

import functools

import port_for

__all__ = ["free_port", "free_port_pair"]


@functools.cache
def _candidates() -> frozenset[int]:
    # port-for works this set out from the OS's ephemeral range on every call (~20 ms)
    return frozenset(port_for.available_good_ports())


def free_port(exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port that nothing used on 127.0.0.1 (or any address) a moment ago."""
    return port_for.select_random(set(_candidates()), exclude_ports=exclude)


def free_port_pair(offset: int, exclude: set[int]) -> int:
    """A free port ``p`` (not in ``exclude``) whose ``p + offset`` is free too.

    A Redis Cluster node also listens on its client port + 10000 (the cluster bus).
    """
    for _ in range(100):
        port = free_port(exclude)
        bus = port + offset
        if bus in _candidates() and bus not in exclude and not port_for.port_is_used(bus):
            return port
    raise RuntimeError(f"port-for found no free port pair (p, p + {offset})")
