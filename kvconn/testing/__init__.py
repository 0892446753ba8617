"""Test support shipped with the package, so third-party backends test the same way.

``BackendTests`` is the conformance suite: a backend's test module subclasses it, names
the backend and provides its options (and, for a server, a way to stop and restart it).
``ExactReadStatusTests`` is mixed in by backends whose reads always say why a key did
not load (absent, or stored at another size).
"""

from kvconn.testing.suite import BackendTests, ExactReadStatusTests, ServerControl

__all__ = ["BackendTests", "ExactReadStatusTests", "ServerControl"]
