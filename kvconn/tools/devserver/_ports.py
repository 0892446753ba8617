"""Free loopback ports for the dev servers, picked by port-for.

port-for draws from ports no service is registered for and outside the ephemeral
range, so a port it hands out is not grabbed by some outgoing connection before the
server binds it; the server helpers still retry with a new port when they lose a race.
"""

from __future__ import annotations

import port_for

__all__ = ["free_port", "free_port_pair"]


def free_port() -> int:
    """A TCP port that nothing used on 127.0.0.1 (or any address) a moment ago."""
    return port_for.select_random()


def free_port_pair(offset: int, exclude: set[int]) -> int:
    """A free port ``p`` (not in ``exclude``) whose ``p + offset`` is free too.

    A Redis Cluster node also listens on its client port + 10000 (the cluster bus).
    """
    for _ in range(100):
        port = port_for.select_random(exclude_ports=exclude)
        if port + offset not in exclude and port_for.is_available(port + offset):
            return port
    raise RuntimeError(f"port-for found no free port pair (p, p + {offset})")
