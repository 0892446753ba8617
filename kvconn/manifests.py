"""Storing the layout manifest of every page kind, once, after the first save.

``kvconn inspect`` reads the manifests to tell which roles a page holds (the key only
carries a fingerprint of them). They are put by the first save that reaches the store,
after the save's own pages, so a failure here can never cost a page; a failed or refused
put is retried by a later save. A put never overwrites, so every rank doing it is
harmless.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from kvconn.calls import BackendCalls, Unavailable

log = logging.getLogger("kvconn")


class ManifestWriter:
    def __init__(self, calls: BackendCalls, manifests: Mapping[str, bytes]) -> None:
        self.calls = calls
        self.manifests = dict(manifests)
        self.stored = False
        self._lock = threading.Lock()

    def store(self, take: Callable[[int], memoryview]) -> None:
        """Put every manifest in one batch, from memory ``take(nbytes)`` lends.

        ``take`` lends staging memory, so a zero-copy store (Mooncake) moves them from its
        registered buffer like pages. Not a page: nothing is counted as written or dropped;
        a backend error is still one (counted, logged once, backed off).
        """
        if self.stored:
            return
        keys = list(self.manifests)
        view = take(sum(len(v) for v in self.manifests.values()))
        values: list[memoryview] = []
        offset = 0
        for value in self.manifests.values():
            view[offset : offset + len(value)] = value
            values.append(view[offset : offset + len(value)])
            offset += len(value)
        calls = self.calls
        try:
            stored = calls.call("put", lambda: calls.backend.put(calls.vetted(keys), values))
        except Unavailable:
            return
        with self._lock:  # a concurrent save may have stored them meanwhile
            self.stored = self.stored or all(stored)
        if not all(stored):
            log.debug("kvconn: a layout manifest put was refused; a later save retries")
