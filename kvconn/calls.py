"""Calls into a backend: serialization, back-off and the rule that errors are not misses.

Every store call a connector, a lookup or the transfer service makes goes through one
:class:`BackendCalls`. It owns three things that must be decided once per backend:

* whether calls may overlap: a backend that does not declare
  ``Capabilities.thread_safe`` gets one lock, shared by everything calling it;
* back-off (DESIGN rule 6): after a failure the backend is skipped for
  ``retry_interval_s``, so a dead server costs the serving loop one timeout, not one per
  request; the first failure is logged as a warning and the recovery as info;
* the key length limit, checked once at start-up on the longest key shape, so a batch
  of keys made from those shapes needs no per-key check (:class:`VettedKeys`).

Torch-free: a scheduler that only looks up imports this without the tensor library.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvconn.backend import Backend, VettedKeys
from kvconn.errors import BackendError, ConfigError, InvalidKeyError
from kvconn.redaction import redact_url
from kvconn.stats import ConnectorStats

log = logging.getLogger("kvconn")

T = TypeVar("T")


class Unavailable(Exception):
    """The backend failed this call or is in its back-off window: read as unavailable."""


class BackendCalls:
    """One backend as its callers use it: guarded, backed off, counted."""

    def __init__(
        self,
        backend: Backend,
        *,
        name: str,
        retry_interval_s: float,
        stats: ConnectorStats,
    ) -> None:
        self.backend = backend
        self.name = name
        self.retry_interval_s = retry_interval_s
        self.stats = stats
        self.guard = call_guard(backend)
        self._lock = threading.Lock()  # back-off state; never held across a backend call
        self._down_until = 0.0
        self._down = False
        self._key_limit = backend.max_key_length

    # ------------------------------------------------------------------ keys
    def check_keys(self, shapes: Sequence[str], *, model: str, namespace: str) -> None:
        """Fail at start-up if some key would exceed the backend's limit.

        ``shapes`` holds the longest key of every shape the caller makes. Otherwise every
        call would raise ``InvalidKeyError`` and read as a store outage: the cache would
        silently never work and the log would blame the store.
        """
        longest = max(shapes, key=len)
        limit = self.backend.max_key_length
        if len(longest) > limit:
            raise ConfigError(
                f"keys would be {len(longest)} characters, over the {self.backend.name!r} "
                f"backend's limit of {limit}: shorten the model name ({model!r}) "
                f"or the namespace ({namespace!r})"
            )
        # Every key of these shapes has a fixed-size hex digest, so checking the shapes
        # once vouches for every batch (VettedKeys).
        VettedKeys(list(shapes), limit)
        self._key_limit = limit

    def vetted(self, keys: Sequence[str]) -> VettedKeys:
        return VettedKeys.unchecked(keys, self._key_limit)

    # ------------------------------------------------------------------ calls
    @property
    def down(self) -> bool:
        """Whether calls are being skipped right now (the back-off window)."""
        return time.monotonic() < self._down_until

    def call(self, op: str, fn: Callable[[], T]) -> T:
        """Run a backend call; on failure log, count, back off and raise ``Unavailable``."""
        if time.monotonic() < self._down_until:
            raise Unavailable
        try:
            with self.guard:
                result = fn()
        except InvalidKeyError:
            raise  # our own key is at fault, not the store: never hide it as an outage
        except Exception as exc:
            self.stats.bump("backend_errors")
            with self._lock:
                # From the failure, not the start: a call that timed out after longer
                # than the interval must still leave a window in which no call waits.
                self._down_until = time.monotonic() + self.retry_interval_s
                first = not self._down
                self._down = True
            if first:
                log.warning(
                    "kvconn: backend %r failed in %s (%s); serving without the cache, "
                    "retrying after %.1fs",
                    self.name,
                    op,
                    redact_url(str(exc)),
                    self.retry_interval_s,
                    exc_info=not isinstance(exc, (OSError, BackendError)),
                )
            raise Unavailable from exc
        if self._down:
            with self._lock:
                recovered, self._down = self._down, False
            if recovered:
                log.info("kvconn: backend %r answers again", self.name)
        return result

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.call("exists", lambda: self.backend.exists(self.vetted(keys)))


#: One lock per backend object that is not thread-safe, shared by every caller over it
#: (a TP group in one process may share a backend); weak, so a closed backend goes.
_BACKEND_LOCKS: weakref.WeakKeyDictionary[Backend, threading.Lock] = weakref.WeakKeyDictionary()
_BACKEND_LOCKS_LOCK = threading.Lock()


def call_guard(backend: Backend) -> contextlib.AbstractContextManager[object]:
    """What to hold around a call to ``backend``: nothing when it declares thread safety."""
    if backend.capabilities.thread_safe:
        return contextlib.nullcontext()
    with _BACKEND_LOCKS_LOCK:
        try:
            return _BACKEND_LOCKS.setdefault(backend, threading.Lock())
        except TypeError:  # not weak-referenceable (__slots__): a lock of its own
            return threading.Lock()
