"""Store selection shared by ``kvconn simulate`` and ``kvconn inspect``, and a timing shim.

Both commands take the same options (``--backend NAME --option key=value``, ``--path``,
``--config FILE``) so that a footprint printed by ``inspect`` is the footprint of the
store ``simulate`` just wrote, whichever backend that is.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig, load_toml, parse_literal
from kvconn.errors import ConfigError

T = TypeVar("T")

DEFAULT_BACKEND = "lmdb"


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("store")
    group.add_argument(
        "--backend",
        default=None,
        help=f"backend name (entry point in 'kvconn.backends'); default {DEFAULT_BACKEND}",
    )
    group.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option, repeatable; VALUE is read as a TOML literal when it is one "
        '(8, true, "x"), else as a string',
    )
    group.add_argument(
        "--path",
        default=None,
        help="shorthand for --option path=PATH (lmdb: the store directory; default "
        "$XDG_CACHE_HOME/kvconn/lmdb)",
    )
    group.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a kvconn configuration TOML (model, backend, options, namespace, "
        "writer_policy ...); the flags above override it",
    )
    group.add_argument("--namespace", default=None, help="key namespace (default kvconn)")


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["map_size=1073741824", "path=/tmp/x"]`` -> ``{"map_size": 1073741824, ...}``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--option expects KEY=VALUE, got {pair!r}")
        out[key] = parse_literal(raw)
    return out


def store_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration table from ``--config`` overlaid by the explicit flags."""
    data: dict[str, Any] = dict(load_toml(args.config)) if args.config else {}
    options = dict(data.get("options", {}))
    if not isinstance(options, Mapping):
        raise ConfigError(f"{args.config}: 'options' must be a table")
    if args.backend is not None:
        if data.get("backend") not in (None, args.backend):
            options = {}  # options of another backend would be rejected as unknown
        data["backend"] = args.backend
    data.setdefault("backend", DEFAULT_BACKEND)
    options.update(parse_options(args.option))
    if args.path is not None:
        options["path"] = args.path
    data["options"] = options
    if args.namespace is not None:
        data["namespace"] = args.namespace
    return data


def connector_config(
    args: argparse.Namespace, model: str, overrides: Mapping[str, Any] | None = None
) -> ConnectorConfig:
    """A full connector configuration; ``model`` is used when the file names none."""
    data = store_settings(args)
    data.setdefault("model", model)
    data.update(overrides or {})
    return ConnectorConfig.from_dict(data)


class TimedBackend(Backend):
    """Wraps a backend and counts the seconds spent inside it.

    ``first_call`` is the moment the first store call since :meth:`mark` began: the
    connector derives keys and owners before it asks the store anything, so the time
    from entering ``save``/``load``/``lookup`` to ``first_call`` is its planning time.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.seconds = 0.0  # wall-clock time inside the store
        self.cpu_seconds = 0.0  # CPU time of this thread inside the store
        self.calls = 0
        self.first_call: tuple[float, float] | None = None  # (wall, cpu)

    def mark(self) -> None:
        self.first_call = None

    def _timed(self, fn: Callable[[], T]) -> T:
        start, cpu = time.perf_counter(), time.thread_time()
        if self.first_call is None:
            self.first_call = (start, cpu)
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
            self.calls += 1

    # Whole public calls are timed and delegated, so the inner backend validates keys
    # once and that validation counts as store time, as it would in a real engine.
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._timed(lambda: self.inner.exists(keys))

    def put(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        return self._timed(lambda: self.inner.put(keys, values))

    def get(
        self, keys: Sequence[str], buffers: Sequence[Any], *, scratch: bool = False
    ) -> list[bool]:
        return self._timed(lambda: self.inner.get(keys, buffers, scratch=scratch))

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self._timed(lambda: self.inner.delete(keys))

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self.inner.list_keys(prefix)

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        return self.inner._exists(keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        return self.inner._put(keys, values)

    def _get(self, keys: list[str], buffers: list[memoryview]) -> Sequence[bool]:
        return self.inner._get(keys, buffers)

    def _get_scratch(self, keys: list[str], buffers: list[memoryview]) -> Sequence[bool]:
        return self.inner._get_scratch(keys, buffers)

    def register_buffer(self, buffer: memoryview) -> None:
        self.inner.register_buffer(buffer)

    def unregister_buffer(self, buffer: memoryview) -> None:
        self.inner.unregister_buffer(buffer)

    def close(self) -> None:
        self.inner.close()


def timed(inner: Backend) -> TimedBackend:
    """A :class:`TimedBackend` that declares the same capabilities as ``inner``.

    Capabilities are class attributes, so the wrapper class is made per backend class:
    the connector must see zero-copy registration exactly when the real store has it.
    """
    cls = type(
        f"Timed{type(inner).__name__}",
        (TimedBackend,),
        {
            "name": inner.name,
            "extra": inner.extra,
            "capabilities": inner.capabilities,
            "max_key_length": inner.max_key_length,
        },
    )
    return cast("type[TimedBackend]", cls)(inner)


def describe_location(backend: Backend) -> str:
    """Where the store lives, for the report header (a path for embedded stores)."""
    inner = backend.inner if isinstance(backend, TimedBackend) else backend
    path = getattr(inner, "path", None)
    return f"{inner.name} at {path}" if path is not None else inner.name
