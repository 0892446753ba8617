"""Managed real servers for tests and ``kvconn dev-server``.

kvconn's backends are only trustworthy when they are tested against the real
store, not a fake. This package starts throwaway servers (Redis, Redis Cluster,
Mooncake) on free loopback ports, each in its own temporary directory, so tests
never touch a user's server and never leave a process behind. The same helpers
back the ``kvconn dev-server`` command for local experiments.

The process handling is mirakuru's, the port picking port-for's and the Redis
talk redis-py's: all three come with ``pip install 'kvconn[devserver]'``. This
module itself imports none of them, so the command line can say what is missing.
"""

from __future__ import annotations

from kvconn.config import parse_size

__all__ = ["DEVSERVER_EXTRA", "MIN_CLUSTER_NODES", "MIN_SEGMENT_SIZE", "byte_size"]

#: The extra that installs what the dev servers import.
DEVSERVER_EXTRA = "devserver"
#: ``redis-cli --cluster create`` refuses fewer masters.
MIN_CLUSTER_NODES = 3
#: ``mooncake_client`` aborts below this, with a message that does not say why.
MIN_SEGMENT_SIZE = 16 * 2**20


def byte_size(value: str | int) -> int:
    """Bytes from ``268435456``, ``"256MiB"`` or ``"4mb"``: kvconn's one size syntax.

    Units are binary whatever the spelling (see :func:`kvconn.config.parse_size`), so
    ``--maxmemory 1gb`` and ``--segment-size 1gb`` mean the same number of bytes.
    """
    size = value if isinstance(value, int) else parse_size(value)
    if size is None or size < 0:
        raise ValueError(f"not a size: {value!r} (examples: 268435456, 256MiB, 1GiB)")
    return size
