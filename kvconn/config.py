"""Connector configuration from a dict, a TOML file or environment variables.

Unknown keys are errors: a misspelt ``writer_polcy`` silently falling back to the default
is exactly the kind of mistake that only shows up as a wrong footprint weeks later.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvconn.errors import ConfigError
from kvconn.keys import key_part
from kvconn.plan import WriterPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "KVCONN_"
ENV_OPTION_PREFIX = "KVCONN_OPTION_"
ENV_CONFIG_FILE = "KVCONN_CONFIG"
#: Variables of kvconn's development tools and test harness (``KVCONN_DEV_*``): never a
#: connector setting, so ``from_env`` leaves them alone instead of calling them typos.
ENV_TOOL_PREFIX = "KVCONN_DEV_"


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything a connector needs besides the layout and the pools.

    ``model`` names the weights and quantization revision: KV bytes of different weights
    differ, so it is part of every key and has no default.
    """

    model: str
    backend: str = "lmdb"
    options: Mapping[str, Any] = field(default_factory=dict)
    namespace: str = "kvconn"
    writer_policy: WriterPolicy = WriterPolicy.SPREAD
    #: Upper bound of host staging memory one save/load uses at a time.
    staging_bytes: int = 256 * 2**20
    #: After a backend error, calls within this many seconds skip the backend entirely,
    #: so a dead server costs the serving loop one timeout, not one per request.
    retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        key_part(self.model, "model")
        key_part(self.namespace, "namespace")
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must be a non-empty name, got {self.backend!r}")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"options must be a table/dict, got {type(self.options).__name__}")
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "writer_policy", WriterPolicy.parse(self.writer_policy))
        if isinstance(self.staging_bytes, str):  # "256MiB", from a file or the environment
            size = parse_size(self.staging_bytes)
            if size is None:
                raise ConfigError(
                    f"staging_bytes must be a size like 268435456 or '256MiB', "
                    f"got {self.staging_bytes!r}"
                )
            object.__setattr__(self, "staging_bytes", size)
        if (
            isinstance(self.staging_bytes, bool)
            or not isinstance(self.staging_bytes, int)
            or (self.staging_bytes < 1)
        ):
            raise ConfigError(f"staging_bytes must be a positive int, got {self.staging_bytes!r}")
        if (
            isinstance(self.retry_interval_s, bool)
            or not isinstance(self.retry_interval_s, (int, float))
            or not math.isfinite(self.retry_interval_s)
            or self.retry_interval_s < 0
        ):
            raise ConfigError(
                f"retry_interval_s must be a number >= 0, got {self.retry_interval_s!r}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConnectorConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown configuration key(s): {', '.join(unknown)}; "
                f"known keys: {', '.join(sorted(names))}"
            )
        if "model" not in data:
            raise ConfigError("configuration needs 'model' (the weights/quantization revision)")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> ConnectorConfig:
        return cls.from_dict(load_toml(path))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None
    ) -> ConnectorConfig:
        """``base``, overlaid by ``$KVCONN_CONFIG`` (a TOML file), overlaid by ``KVCONN_*``.

        ``KVCONN_OPTION_<NAME>=value`` sets backend option ``name``; the value is read as
        a TOML literal when it parses as one (``8``, ``true``, ``"x"``), else as a string.
        """
        env = os.environ if environ is None else environ
        data: dict[str, Any] = dict(base or {})
        data["options"] = dict(data.get("options", {}))
        if env.get(ENV_CONFIG_FILE):
            loaded = load_toml(env[ENV_CONFIG_FILE])
            file_options = loaded.pop("options", {})
            if not isinstance(file_options, Mapping):
                raise ConfigError(
                    f"{env[ENV_CONFIG_FILE]}: options must be a table, "
                    f"got {type(file_options).__name__}"
                )
            options = {**data["options"], **file_options}
            data.update(loaded)
            data["options"] = options
        names = {f.name for f in fields(cls)} - {"options"}
        for var, raw in env.items():
            if (
                not var.startswith(ENV_PREFIX)
                or var == ENV_CONFIG_FILE
                or var.startswith(ENV_TOOL_PREFIX)
            ):
                continue
            if var.startswith(ENV_OPTION_PREFIX):
                data["options"][var[len(ENV_OPTION_PREFIX) :].lower()] = parse_literal(raw)
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in names:
                raise ConfigError(
                    f"unknown environment variable {var}; known: "
                    + ", ".join(sorted(ENV_PREFIX + n.upper() for n in names))
                    + f", {ENV_OPTION_PREFIX}<NAME>, {ENV_CONFIG_FILE}"
                )
            data[name] = (
                parse_literal(raw) if name in ("staging_bytes", "retry_interval_s") else raw
            )
        return cls.from_dict(data)

    def with_options(self, **options: Any) -> ConnectorConfig:
        return replace(self, options={**self.options, **options})


def load_toml(path: str | os.PathLike[str], what: str = "configuration file") -> dict[str, Any]:
    """A TOML file's table; a missing or malformed file is a ConfigError naming ``what``."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {p} is not valid TOML: {exc}") from None


def parse_literal(raw: str) -> Any:
    """A value given as text (env var, ``-o key=value``): a TOML literal when it is one
    (``8``, ``true``, ``"x"``), else the string itself."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """``"268435456"``, ``"256MiB"``, ``"256mb"``, ``"1g"`` → bytes, or ``None``.

    Units are binary whatever the spelling, as Mooncake reads them (``"4gb"`` is 4 GiB),
    so a size copied from a Mooncake config keeps its value.
    """
    match = _SIZE.match(text)
    if match is None:
        return None
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** "_kmgt".index(unit)) if unit else int(number)
