"""redis-py's exceptions as kvconn's three kinds of trouble, with messages fit to show.

The connector needs to know which remedy applies (``kvconn.errors``): a *configuration*
problem must stop start-up, a store that *cannot answer right now* becomes misses and
dropped saves (:class:`BackendUnavailable`), and anything else the store says is a
:class:`BackendError`. redis-py wraps causes (a cluster that "cannot be connected"
because a node said ``NOAUTH``; a ``ConnectionError`` whose cause is a certificate the
client does not trust), so the whole chain of causes is read, not just the outer type.

Every message names the deployment by its address (never the password) and passes
through :func:`kvconn.redaction.redact_url` in case a URL with credentials got quoted.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

from redis import exceptions as rx

from kvconn.errors import BackendError, BackendUnavailable, ConfigError, KvconnError
from kvconn.redaction import redact_url
from kvconn_redis._config import RedisConfig

__all__ = ["error_code", "reply_error", "translate"]

#: Replies that mean "not now": loading a dataset, a busy script, a resharding cluster.
_TRANSIENT_CODES = {"LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN"}


#: Failures of the moment: the same call may succeed later.
_UNREACHABLE = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterError,
    rx.RedisClusterException,
    OSError,
)


#: Codes that older redis-py releases strip from the message without keeping them.
_STRIPPED_CODES = (
    (rx.NoPermissionError, "NOPERM"),
    (rx.ReadOnlyError, "READONLY"),
    (rx.OutOfMemoryError, "OOM"),
    (rx.BusyLoadingError, "LOADING"),
)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def error_code(exc: BaseException) -> str:
    """The reply's error code (``NOPERM``, ``WRONGTYPE``…); redis-py strips some."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    for kind, known in _STRIPPED_CODES:
        if isinstance(exc, kind):
            return known
    head = str(exc).split(" ", 1)[0]
    return head if head.isupper() and head.isalpha() else ""


def _text(exc: BaseException) -> str:
    code, text = error_code(exc), str(exc)
    return text if not code or text.startswith(code) else f"{code} {text}"


def _user(config: RedisConfig) -> str:
    return config.username or "default"


def reply_error(exc: BaseException, config: RedisConfig, op: str) -> BackendError:
    """An error *reply* to one command of a batch (the rest of the batch was read)."""
    where, code = config.where, error_code(exc)
    text = redact_url(f"redis at {where}: {op} failed: {_text(exc)}")
    if code in _TRANSIENT_CODES or isinstance(exc, rx.ClusterDownError):
        return BackendUnavailable(text)
    if isinstance(exc, rx.AskError) and not config.cluster:
        return BackendError(f"{text} (the server is a Redis Cluster node: use cluster=True)")
    if code == "NOPERM":
        return BackendError(f"{text} (the ACL user {_user(config)!r} may not do this)")
    if isinstance(exc, (rx.ConnectionError, rx.TimeoutError)):
        return translate(exc, config, op)  # type: ignore[return-value]
    return BackendError(text)


def translate(
    exc: BaseException, config: RedisConfig, op: str, *, startup: bool = False
) -> KvconnError:
    """The kvconn error for ``exc`` raised by redis-py during ``op``.

    ``startup``: the backend is being built; credentials, permissions, certificates and
    the server's mode are then :class:`ConfigError` (a deployment to fix), while a server
    that cannot be reached stays :class:`BackendUnavailable` (it may come up later).
    """
    where = config.where
    causes = list(_causes(exc))
    problem: KvconnError | None = None
    for cause in causes:
        if isinstance(cause, rx.AuthenticationError):
            code = error_code(cause)
            if code == "NOAUTH" or "Authentication required" in str(cause):
                # Older redis-py releases drop the code from the message.
                text = _text(cause) if code else f"NOAUTH {cause}"
                what = f"requires a password ({text})"
            else:
                what = f"refused the credentials ({_text(cause)})"
            problem = _config_or(
                startup,
                f"redis at {where} {what}; check the username/password options",
            )
            break
        if isinstance(cause, ssl.SSLCertVerificationError):
            problem = _config_or(
                startup,
                f"redis at {where}: the server's TLS certificate is not trusted "
                f"({cause.verify_message}); check tls_ca_file, or tls_verify",
            )
            break
        if isinstance(cause, rx.RedisClusterException) and "not enabled" in str(cause):
            problem = _config_or(
                startup,
                f"redis at {where} is not a Redis Cluster node ({cause}); "
                "use a redis:// URL without cluster=True",
            )
            break
        if isinstance(cause, rx.ResponseError) and not isinstance(cause, rx.ClusterDownError):
            problem = reply_error(cause, config, op)
            if startup and error_code(cause) == "NOPERM":
                problem = ConfigError(str(problem))
            break
    if problem is None:
        problem = _unavailable(causes, config, op)
    problem.args = (redact_url(str(problem)),)
    return problem


def _config_or(startup: bool, text: str) -> KvconnError:
    return ConfigError(text) if startup else BackendError(text)


def _unavailable(causes: list[BaseException], config: RedisConfig, op: str) -> KvconnError:
    """Connection-level failures: refused, reset, timed out, pool exhausted, cluster down."""
    where, outer = config.where, causes[0]
    if any(isinstance(c, (rx.TimeoutError, TimeoutError)) for c in causes):
        return BackendUnavailable(
            f"redis at {where}: {op} timed out after {config.timeout_s:g} s "
            "(timeout_s bounds the whole call)"
        )
    text = str(outer) or type(outer).__name__
    if isinstance(outer, rx.MaxConnectionsError) or "No connection available" in text:
        return BackendUnavailable(
            f"redis at {where}: {op} failed: all {config.max_connections} connections "
            "stayed busy for the whole call (raise max_connections?)"
        )
    if " connecting to " in text or any(isinstance(c, ConnectionRefusedError) for c in causes):
        return BackendUnavailable(f"redis at {where}: {op} failed: cannot connect ({text})")
    if isinstance(outer, _UNREACHABLE):
        return BackendUnavailable(f"redis at {where}: {op} failed: {text}")
    return BackendError(f"redis at {where}: {op} failed: {type(outer).__name__}: {text}")
