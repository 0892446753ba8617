"""Finding backends by name through the ``kvconn.backends`` entry-point group.

The core never imports a backend module directly: a deployment installs the backend
it wants (``kvconn[redis]``, a third-party package …) and names it in configuration.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kvconn.backend import Backend
from kvconn.config import check_options, unknown_names
from kvconn.errors import BackendDependencyMissing, BackendNotFound, ConfigError, KvconnError
from kvconn.redaction import redact_url

GROUP = "kvconn.backends"


def _entry_points() -> dict[str, list[EntryPoint]]:
    """Entry points by name; more than one under a name is a conflict, never resolved
    silently (which one loads would depend on the order of ``sys.path``)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, []).append(ep)
    return found


def _dist(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


def _conflict(name: str, eps: list[EntryPoint]) -> str:
    who = "; ".join(f"{_dist(ep)} ({ep.value})" for ep in eps)
    return (
        f"backend name {name!r} is registered by {len(eps)} installed distributions: {who}; "
        "uninstall all but one"
    )


def installed_backends() -> list[str]:
    """Names of installed backends, without importing any of them."""
    return sorted(_entry_points())


@dataclass(frozen=True)
class BackendInfo:
    name: str
    distribution: str
    target: str
    problem: str | None  # None when the backend and its client import


def describe_backends() -> list[BackendInfo]:
    """What ``kvconn backends`` prints: name, providing distribution, usability."""
    infos = []
    for name, eps in sorted(_entry_points().items()):
        for ep in eps:
            if len(eps) > 1:
                problem: str | None = _conflict(name, eps)
            else:
                try:
                    cls = ep.load()
                    problem = (
                        cls.client_problem()
                        if isinstance(cls, type) and issubclass(cls, Backend)
                        else (f"{ep.value} is not a kvconn Backend subclass")
                    )
                except Exception as exc:
                    problem = f"cannot import {ep.value}: {exc}"
            infos.append(BackendInfo(name, _dist(ep), ep.value, problem))
    return infos


def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``; errors name the alternatives or the extra."""
    from stevedore import driver, exception

    if not isinstance(name, str) or not name:
        raise ConfigError(f"a backend name must be a non-empty string, got {name!r}")
    registered = _entry_points().get(name, [])
    if len(registered) > 1:
        raise ConfigError(_conflict(name, registered))

    def _raise(_manager: Any, _ep: Any, exc: BaseException) -> None:
        raise exc

    try:
        manager = driver.DriverManager(
            GROUP,
            name,
            invoke_on_load=False,
            on_load_failure_callback=_raise,
        )
    except exception.NoMatches:
        raise BackendNotFound(name, installed_backends()) from None
    except BackendDependencyMissing:
        raise
    except ImportError as exc:
        raise BackendDependencyMissing(name, exc.name or str(exc), name) from exc
    except Exception as exc:  # a broken plugin: say which, never a bare traceback
        raise ConfigError(f"backend {name!r} cannot be loaded from its entry point: {exc}") from exc
    cls = manager.driver
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"backend {name!r} resolves to {cls!r}, not a kvconn Backend subclass")
    return cls


def accepted_options(cls: type[Backend]) -> tuple[list[str], bool]:
    """The option names ``cls`` takes as keywords, and whether it takes any (``**kw``)."""
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = [
        p
        for p, v in params.items()
        if p != "self"
        and v.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return accepted, takes_any


def load_backend(
    name: str, options: Mapping[str, Any] | None = None, *, key_prefix: str | None = None
) -> Backend:
    """Instantiate backend ``name`` with ``options`` as keyword arguments.

    Options are checked against the constructor's signature first, so a typo fails with
    the list of accepted options instead of a bare ``TypeError``. With ``key_prefix``
    (what every key the caller makes starts with: ``kvconn.keys.key_prefix(namespace,
    model)``) the new backend is asked whether those keys are off limits
    (:meth:`Backend.check_access`), so a user a store confines to other keys is refused
    now, not on every call.
    """
    cls = backend_class(name)
    options = check_options(options if options is not None else {}, f"backend {name!r}: options")
    problem = cls.client_problem()
    if problem is not None:
        raise BackendDependencyMissing(name, cls.client_modules[0], cls.extra or name)
    accepted, takes_any = accepted_options(cls)
    unknown = sorted(set(options) - set(accepted))
    if unknown and not takes_any:
        raise unknown_names("option", unknown, accepted, where=f"backend {name!r}")
    try:
        backend = cls(**options)
    except KvconnError:
        raise  # the backend's own message, which names the option
    except (TypeError, ValueError, OverflowError) as exc:
        # Not chained: the original message may quote an option's value, a password
        # included, and a chained traceback would print it unmasked.
        raise ConfigError(
            f"backend {name!r}: bad options ({type(exc).__name__}): {redact_url(str(exc))}"
        ) from None
    if key_prefix is not None:
        try:
            backend.check_access(key_prefix)
        except BaseException:
            backend.close()
            raise
    return backend
