"""One error hierarchy for the whole library.

Callers need to tell three situations apart, because each has a different remedy:

* a *configuration* problem (bad layout, unknown option, unknown backend) is a bug in
  the deployment and must fail fast, at start-up, with a message naming the culprit;
* a *backend* problem (connection refused, timeout, server error) is transient: the
  connector turns it into misses and dropped saves and keeps serving;
* a *miss* is not an error at all, so no exception type exists for it.
"""

from __future__ import annotations

from collections.abc import Iterable


class KvconnError(Exception):
    """Base class of every error kvconn raises on purpose."""


class ConfigError(KvconnError, ValueError):
    """The configuration cannot work; fix it before serving."""


class LayoutError(ConfigError):
    """The described KV-cache layout is inconsistent (overlaps, bounds, units, roles)."""


class ArgumentError(KvconnError, ValueError, TypeError):
    """A call's arguments cannot be right (slot count or range, a slot used twice, a
    block hash, tokens, a reuse scope): a bug in the caller, refused before anything is
    read or written.

    It subclasses both ``ValueError`` and ``TypeError`` because those are what such
    calls raised before this type existed, so ``except ValueError`` written against
    them keeps working.
    """


class ConnectorClosed(KvconnError, RuntimeError):
    """A call on a connector (or lookup, or transfer service) after ``close()``: a bug in
    the caller's shutdown order, not a miss to be served around."""


class InvalidKeyError(KvconnError, ValueError):
    """A store key is not acceptable to the backend contract (type, characters, length)."""


class BackendError(KvconnError):
    """The store could not answer: this is never to be read as a miss."""


class BackendUnavailable(BackendError):
    """The store cannot be reached right now (refused, timed out, closed); may recover."""


class BackendNotFound(ConfigError):
    """No installed backend has the requested name."""

    def __init__(self, name: str, installed: Iterable[str]) -> None:
        self.name = name
        self.installed = sorted(installed)
        listing = ", ".join(self.installed) if self.installed else "none"
        super().__init__(
            f"unknown kvconn backend {name!r}; installed backends: {listing} "
            "(backends register under the entry-point group 'kvconn.backends')"
        )


class BackendDependencyMissing(ConfigError, ImportError):
    """A backend is installed but the client library it drives is not."""

    def __init__(self, backend: str, module: str, extra: str) -> None:
        self.backend = backend
        self.module = module
        self.extra = extra
        super().__init__(
            f"the {backend!r} backend needs the Python module {module!r}, which is not "
            f"importable; install it with: pip install 'kvconn[{extra}]'"
        )
