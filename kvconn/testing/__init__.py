"""Test support shipped with the package, so third-party backends test the same way.

``BackendTests`` is the conformance suite: a backend's test module subclasses it, names
the backend and provides its options (and, for a server, a way to stop and restart it).
"""

from kvconn.testing.suite import BackendTests, ServerControl

__all__ = ["BackendTests", "ServerControl"]
