"""Store selection shared by ``kvconn simulate`` and ``kvconn inspect``.

Both commands take the same options (``--backend NAME --option key=value``, ``--path``,
``--config FILE``) so that a footprint printed by ``inspect`` is the footprint of the
store ``simulate`` just wrote, whichever backend that is.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvconn.config import (
    ENV_OPTION_PREFIX,
    ConnectorConfig,
    check_options,
    env_options,
    load_toml,
    parse_literal,
)
from kvconn.errors import ConfigError

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
        f'(8, true, "x"), else as a string. {ENV_OPTION_PREFIX}<NAME>=VALUE variables set '
        "options too (below these flags): pass secrets such as a password that way, since a "
        "command line is visible to every user of the machine",
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


def store_settings(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The configuration table from ``--config``, overlaid by ``KVCONN_OPTION_*``
    variables, overlaid by the explicit flags."""
    data: dict[str, Any] = dict(load_toml(args.config)) if args.config else {}
    options = check_options(data.get("options", {}), f"{args.config}: options")
    if args.backend is not None:
        if data.get("backend") not in (None, args.backend):
            options = {}  # options of another backend would be rejected as unknown
        data["backend"] = args.backend
    data.setdefault("backend", DEFAULT_BACKEND)
    options.update(env_options(os.environ if environ is None else environ))
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


def human_bytes(n: float) -> str:
    """A byte count for people: ``1.50 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
