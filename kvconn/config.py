"""Connector configuration from a dict, a TOML file or environment variables.

Unknown keys are errors: a misspelt ``writer_polcy`` silently falling back to the default
is exactly the kind of mistake that only shows up as a wrong footprint weeks later.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from kvconn.cpus import check_setting as check_transfer_cpus
from kvconn.errors import ConfigError
from kvconn.integrity import DEFAULT as DEFAULT_CHECKSUM
from kvconn.integrity import PageChecksum
from kvconn.keys import key_part
from kvconn.plan import WriterPolicy
from kvconn.redaction import redact_options

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
#: The same, named before that prefix existed: scripts/test.sh reads it, and the suite it
#: runs (the TensorRT-LLM stand-in's ranks) configures connectors from the environment.
ENV_TOOL_VARIABLES = frozenset({"KVCONN_SKIP_ENGINES"})

#: Upper bounds that only a typo reaches (``"99999999T"``, ``1e300``): refused with a
#: message at start-up instead of an allocation failure or a back-off that never ends.
MAX_STAGING_BYTES = 1 << 40  # 1 TiB of host staging
MAX_RETRY_INTERVAL_S = 86_400.0  # a day
MAX_WAIT_S = 3_600.0  # an hour: no scheduler waits that long on a cache
#: More KV heads than any model has: a larger ``shard_heads`` is a typo.
MAX_SHARD_HEADS = 1 << 16
#: Settings read from text (the environment) as TOML literals: numbers, sizes.
_NUMERIC = (
    "staging_bytes",
    "inflight_bytes",
    "retry_interval_s",
    "lookup_wait_s",
    "lookup_timeout_s",
    "lookup_inline",
    "load_timeout_s",
    "idle_wait_s",
    "stripe_reads",
    "verify_replicas_every",
    "shard_heads",
)
#: The sparsest sampling of replica checks (``verify_replicas_every``) a config may ask.
MAX_VERIFY_EVERY = 1 << 32


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
    #: The checksum stored after every page and verified on load (``"xxh3-64"``), or
    #: ``"none"``. Part of every key: every process sharing pages must agree on it.
    checksum: str = DEFAULT_CHECKSUM
    #: Ceiling of host staging held by asynchronous transfers (kvconn.transfer): pages
    #: captured for saves not yet stored plus loads being read. At the ceiling new saves
    #: are dropped (and counted) and loads wait: nothing grows without bound.
    inflight_bytes: int = 1 << 30
    #: How long a scheduler's lookup may wait for the store before it answers "ask again
    #: later" (kvconn.lookup.DeadlineLookup)...
    lookup_wait_s: float = 0.002
    #: ...and how long after it started an unanswered lookup is answered as a miss.
    lookup_timeout_s: float = 0.5
    #: Ask a store that answers from this host (``Capabilities.local``: LMDB) on the
    #: scheduler's own thread, not through the lookup thread: quicker than the hand-off,
    #: but a disk that hangs holds the scheduler as long. False: every store gets the
    #: thread and ``lookup_wait_s``.
    lookup_inline: bool = True
    #: An asynchronous load not finished this long after it was submitted fails its
    #: blocks (the engine recomputes them); its late bytes never reach the slots. Also
    #: how long an engine thread that must learn a save's outcome (SGLang's backup
    #: thread) waits for it.
    load_timeout_s: float = 30.0
    #: An engine step with nothing to compute (vLLM's loop while a hit loads or a
    #: lookup is answered) waits this long at most, for the rank's next load to finish
    #: or, on a rank with none in flight, the whole time, instead of returning at once
    #: to poll again: the polling loop would take the core and the GIL from the load,
    #: or a store server on the same host, it waits for. A request arriving meanwhile
    #: waits as long. 0: never wait.
    idle_wait_s: float = 0.005
    #: Where the transfer threads (loads, saves) run (kvconn.cpus): ``"auto"``, the
    #: cores the engine keeps for KV transfers where the adapter knows them (vLLM's CPU
    #: backend), else where they start; ``"inherit"``, where they start (in an engine
    #: that binds its compute threads, the step's cores); or a CPU list (``"6-7"``).
    transfer_cpus: str = "auto"
    #: Read each page several TP ranks hold once per group and pass it over the group
    #: (kvconn.striped_load): the engine adapter builds a gloo group of its TP ranks.
    #: Pays against a store behind a network; against an embedded one (LMDB) the
    #: exchange costs more than reading again (docs/performance.md), hence off by default.
    stripe_reads: bool = False
    #: Over a TP group, compare the bytes of a page that several ranks hold across those
    #: ranks for 1 saved block in this many (and for the first save); 0: never. A page
    #: kind whose ranks disagree is then keyed per rank (kvconn.replicas). Every rank of
    #: a group must use the same value.
    verify_replicas_every: int = 1000
    #: Cut head-sharded pages at this many shards of the heads (``w<G>r<j>``) whatever
    #: the TP size, so deployments at different TP sizes share pages: ``G`` a multiple
    #: of every TP size that shares, dividing every sharded role's units. ``None`` (the
    #: default): each TP size cuts its own shards (``w<min(tp, units)>r<i>``).
    shard_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("model", "namespace"):
            object.__setattr__(self, name, typed_text(getattr(self, name), name))
            key_part(getattr(self, name), name)
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must be a non-empty name, got {self.backend!r}")
        object.__setattr__(self, "options", check_options(self.options))
        if not isinstance(self.writer_policy, str):  # WriterPolicy is a str too
            raise ConfigError(
                f"writer_policy must be a name ('spread' or 'first'), got {self.writer_policy!r}"
            )
        object.__setattr__(self, "writer_policy", WriterPolicy.parse(self.writer_policy))
        for name in ("staging_bytes", "inflight_bytes"):
            object.__setattr__(self, name, _size(getattr(self, name), name))
        object.__setattr__(self, "transfer_cpus", check_transfer_cpus(self.transfer_cpus))
        PageChecksum(self.checksum)  # anything but a known name: a ConfigError listing them
        for name in ("stripe_reads", "lookup_inline"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        every = self.verify_replicas_every
        if (
            isinstance(every, bool)
            or not isinstance(every, int)
            or not 0 <= every <= (MAX_VERIFY_EVERY)
        ):
            raise ConfigError(
                f"verify_replicas_every must be an int between 0 (never) and "
                f"{MAX_VERIFY_EVERY}, got {every!r}"
            )
        for name, low, high in (
            ("retry_interval_s", 0.0, MAX_RETRY_INTERVAL_S),
            ("lookup_wait_s", 0.0, MAX_WAIT_S),
            ("lookup_timeout_s", 0.0, MAX_WAIT_S),
            ("load_timeout_s", 0.001, MAX_RETRY_INTERVAL_S),
            ("idle_wait_s", 0.0, MAX_WAIT_S),
        ):
            _seconds(getattr(self, name), name, low, high)
        heads = self.shard_heads
        if heads is not None and (
            isinstance(heads, bool)
            or not isinstance(heads, int)
            or not 1 <= heads <= MAX_SHARD_HEADS
        ):
            raise ConfigError(
                f"shard_heads must be a number of head shards between 1 and {MAX_SHARD_HEADS} "
                f"(a multiple of every TP size that shares pages), or unset; got {heads!r}"
            )

    def __repr__(self) -> str:
        # Options carry credentials (a Redis password, a URL with one): a repr ends up in
        # logs and tracebacks, so it shows them masked.
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["options"] = redact_options(self.options)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConnectorConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"a configuration must be a table/dict, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise unknown_names("configuration key", unknown, names)
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
        if base is not None and not isinstance(base, Mapping):
            raise ConfigError(f"base must be a table/dict, got {type(base).__name__}")
        data: dict[str, Any] = dict(base or {})
        data["options"] = check_options(data.get("options", {}), "base options")
        if env.get(ENV_CONFIG_FILE):
            loaded = load_toml(env[ENV_CONFIG_FILE])
            file_options = check_options(
                loaded.pop("options", {}), f"{env[ENV_CONFIG_FILE]}: options"
            )
            options = {**data["options"], **file_options}
            data.update(loaded)
            data["options"] = options
        data["options"].update(env_options(env))
        names = {f.name for f in fields(cls)} - {"options"}
        unknown = []
        for var, raw in env.items():
            if (
                not var.startswith(ENV_PREFIX)
                or var == ENV_CONFIG_FILE
                or var in ENV_TOOL_VARIABLES
                or var.startswith((ENV_TOOL_PREFIX, ENV_OPTION_PREFIX))  # options: above
            ):
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in names:
                unknown.append(var)
                continue
            data[name] = parse_literal(raw) if name in _NUMERIC else raw
        if unknown:
            known = [ENV_PREFIX + n.upper() for n in names]
            raise unknown_names(
                "environment variable",
                unknown,
                [*known, f"{ENV_OPTION_PREFIX}<NAME>", ENV_CONFIG_FILE],
            )
        return cls.from_dict(data)

    def with_options(self, **options: Any) -> ConnectorConfig:
        return replace(self, options={**self.options, **options})


def _size(value: object, name: str) -> int:
    """A byte count given as an int or as text such as ``"256MiB"``."""
    if isinstance(value, str):  # "256MiB", from a file or the environment
        try:
            size = parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if size is None:
            raise ConfigError(f"{name} must be a size like 268435456 or '256MiB', got {value!r}")
        value = size
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STAGING_BYTES:
        raise ConfigError(
            f"{name} must be an int between 1 and {MAX_STAGING_BYTES} (1 TiB), got {value!r}"
        )
    return value


def _seconds(value: object, name: str, low: float, high: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ConfigError(
            f"{name} must be a number of seconds between {low:g} and {high:g}, got {value!r}"
        )


def unknown_names(
    kind: str,
    unknown: Iterable[object],
    known: Iterable[object],
    *,
    where: str = "",
    note: str = "",
) -> ConfigError:
    """The one wording of "this names something nobody reads", and what is read instead.

    ``unknown configuration key(s): writer_polcy; known: backend, checksum, …`` — the
    same whether the name came from a dict, a file, the environment or an engine's
    settings, so that a reader (or a log search) recognises it anywhere. ``where``
    prefixes the source (a file path), ``note`` follows in parentheses.
    """
    text = (
        f"unknown {kind}(s): {', '.join(sorted(map(str, unknown)))}; "
        f"known: {', '.join(sorted(map(str, known))) or 'none'}"
    )
    if note:
        text += f" ({note})"
    return ConfigError(f"{where}: {text}" if where else text)


def typed_text(value: object, what: str) -> object:
    """``value`` with surrogate escapes turned back into the UTF-8 text that was typed.

    Under a C locale, argv and the environment arrive with non-ASCII bytes as surrogate
    escapes; keys made from them would differ from (or fail where) a UTF-8 locale's.
    """
    if not isinstance(value, str) or value.isascii():
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError:
        raise ConfigError(f"{what} {value!r:.80} is not valid UTF-8 text") from None


def check_options(options: object, what: str = "options") -> dict[str, Any]:
    """Backend options as a plain dict: a table whose keys are non-empty names."""
    if not isinstance(options, Mapping):
        raise ConfigError(f"{what} must be a table/dict, got {type(options).__name__}")
    bad = [k for k in options if not isinstance(k, str) or not k]
    if bad:
        raise ConfigError(f"{what}: option names must be non-empty strings, got {bad[0]!r}")
    return dict(options)


def env_options(environ: Mapping[str, str]) -> dict[str, Any]:
    """Backend options from ``KVCONN_OPTION_<NAME>=value`` variables.

    The way to pass a secret (a password) without putting it on a command line, where
    every user of the machine can read it in the process list.
    """
    out: dict[str, Any] = {}
    for var, raw in environ.items():
        if var.startswith(ENV_OPTION_PREFIX):
            name = var[len(ENV_OPTION_PREFIX) :].lower()
            if not name:
                raise ConfigError(f"{ENV_OPTION_PREFIX}<NAME> needs a name, got {var!r}")
            out[name] = parse_literal(raw)
    return out


def load_toml(path: str | os.PathLike[str], what: str = "configuration file") -> dict[str, Any]:
    """A TOML file's table; a missing, unreadable or malformed file is a ConfigError."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(f"{what}: expected a file path, got {path!r}")
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {p} is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {p} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {p} is not UTF-8 text (byte {exc.start}); TOML files are UTF-8"
        ) from None
    except (ValueError, RecursionError) as exc:  # a NUL in the path, absurd nesting
        raise ConfigError(f"{what} {str(p)!r:.200} cannot be read: {exc}") from None


def parse_literal(raw: str) -> Any:
    """A value given as text (env var, ``-o key=value``): a TOML literal when it is one
    (``8``, ``true``, ``"x"``), else the string itself.

    Only a whole single value counts: ``1\nother = 2`` is the string it is, not ``1``.
    """
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except (tomllib.TOMLDecodeError, RecursionError):
        return raw
    return parsed["v"] if len(parsed) == 1 else raw


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """``"268435456"``, ``"256MiB"``, ``"1.5GiB"``, ``"1g"`` → bytes, or ``None``.

    Units are binary whatever the spelling, as Mooncake reads them (``"4gb"`` is 4 GiB),
    so a size copied from a Mooncake config keeps its value. Exact for any length of
    digits (no float overflow); the caller bounds the result. A size that comes to a
    fraction of a byte (``"1.5"``, ``"0.3KiB"``) is a :class:`ConfigError`: rounding it
    silently would turn ``"1.5"``, likely meant as GiB, into one byte.
    """
    match = _SIZE.match(text)
    if match is None:
        return None
    number, unit = Decimal(match.group(1)), match.group(2).lower()
    size = number * 1024 ** "_kmgt".index(unit) if unit else number
    if size != size.to_integral_value():
        raise ConfigError(
            f"{text.strip()!r} is {size.normalize():f} bytes, not a whole number of bytes"
        )
    return int(size)
