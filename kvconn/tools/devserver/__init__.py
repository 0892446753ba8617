"""Managed real servers for tests and ``kvconn dev-server``.

kvconn's backends are only trustworthy when they are tested against the real
store, not a fake. This package starts throwaway servers (Redis, Redis Cluster,
Mooncake) on free loopback ports, each in its own temporary directory, so tests
never touch a user's server and never leave a process behind. The same helpers
back the ``kvconn dev-server`` command for local experiments.
"""
