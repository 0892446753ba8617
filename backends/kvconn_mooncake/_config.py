"""Validated options of the Mooncake backend, merged with Mooncake's own settings.

A Mooncake deployment is usually configured once, for Mooncake's own integrations:
``MOONCAKE_CONFIG_PATH`` (a JSON file, read by vLLM's connector and by
``mooncake.mooncake_config.MooncakeConfig``; SGLang HiCache reads the same keys from
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``) or ``MOONCAKE_MASTER`` & co. in the
environment. Reading the same sources means such a deployment "just works" with kvconn.

Precedence, per setting: an explicit backend option, then the JSON file, then the
environment, then the default. As in ``MooncakeConfig.load_from_env``, a JSON file
replaces the environment entirely (its absent keys take defaults, not ``MOONCAKE_*``).

Every value is checked here, before any connection, so a typo fails at start-up with a
:class:`~kvconn.errors.ConfigError` that names the option *and where it came from*
(an option, an environment variable, or a key in a named file).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvconn.config import parse_size as parse_bytes
from kvconn.errors import ConfigError
from kvconn_mooncake._flight import queue_limit

__all__ = ["CONFIG_PATH_ENV", "PROTOCOLS", "MooncakeConfig", "make_config", "parse_size"]

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
#: The TCP transport's queue of requests per peer, as Mooncake's transport reads it.
TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
SGLANG_CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
PROTOCOLS = ("tcp", "rdma")

#: Where Mooncake's integrations read each setting from the environment.
ENV_VARS: Mapping[str, str] = {
    "master_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
}
#: The JSON keys of ``MooncakeConfig.from_file`` (and vLLM's / SGLang's files).
JSON_KEYS: Mapping[str, str] = {
    "master_address": "master_server_address",
    "metadata_server": "metadata_server",
    "protocol": "protocol",
    "device_name": "device_name",
    "local_hostname": "local_hostname",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
}

DEFAULTS: Mapping[str, object] = {
    # Mooncake's own default: peers exchange metadata directly, no metadata server.
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "device_name": "",
    "local_hostname": "localhost",
    # A pure client: objects live in standalone storage processes (mooncake_client), so
    # they survive an engine restart. A rank that mounted memory would take its pages
    # with it when it exits; embedding is opt-in (set global_segment_size).
    "global_segment_size": 0,
    # Staging for Mooncake's *copying* API, which kvconn does not use (it moves bytes
    # with batch_put_from / batch_get_into); a small buffer keeps setup cheap.
    "local_buffer_size": 16 * 2**20,
}

_HOST_PORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})$")


@dataclass(frozen=True)
class MooncakeConfig:
    """Everything ``setup()`` and the put/get calls need; built by :func:`make_config`."""

    master_address: str
    metadata_server: str
    protocol: str
    device_name: str
    local_hostname: str
    global_segment_size: int
    local_buffer_size: int
    replica_num: int
    soft_pin: bool
    setup_retries: int | None
    probe_timeout_s: float
    scratch_bytes: int
    read_failover: bool
    #: Keys moving at once, all threads together (:mod:`._flight`); None: no bound.
    transfers_in_flight: int | None
    #: setting -> where its value came from ("option", "MOONCAKE_MASTER", "file.json", …)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def master_host_port(self) -> tuple[str, int] | None:
        """The master's RPC address for a cheap TCP probe; None for etcd/HA addresses."""
        match = _HOST_PORT_RE.match(self.master_address)
        if match is None:
            return None
        return match.group(1).strip("[]"), int(match.group(2))

    @property
    def metadata_host_port(self) -> tuple[str, int] | None:
        """The metadata server's address for a TCP probe; None for P2PHANDSHAKE etc."""
        text = self.metadata_server
        if "://" in text:
            text = text.split("://", 1)[1]
        text = text.split("/", 1)[0].split(";", 1)[0].split(",", 1)[0]
        match = _HOST_PORT_RE.match(text)
        if match is None:
            return None
        return match.group(1).strip("[]"), int(match.group(2))

    def replicate_config(self, mc: Any) -> Any:
        """Mooncake's ``ReplicateConfig`` for puts (``mc``: the ``mooncake.store`` module)."""
        config = mc.ReplicateConfig()
        config.replica_num = self.replica_num
        if self.soft_pin:
            if hasattr(config, "soft_pin_action"):  # 0.3.13 and later
                config.soft_pin_action = mc.SoftPinAction.ENABLE
            else:  # earlier releases
                config.with_soft_pin = True
        return config

    def setup_args(self) -> tuple[str, str, int, int, str, str, str]:
        """Positional arguments of ``MooncakeDistributedStore.setup`` (0.3.x signature)."""
        return (
            self.local_hostname,
            self.metadata_server,
            self.global_segment_size,
            self.local_buffer_size,
            self.protocol,
            self.device_name,
            self.master_address,
        )


def parse_size(value: object, where: str) -> int:
    """``268435456``, ``"256MiB"``, ``"256mb"``, ``"3.2 GB"`` → bytes (binary units).

    Mooncake reads ``"4gb"`` as 4 GiB (``MooncakeConfig._parse_segment_size``); the same
    spellings mean the same here, so a size copied from a Mooncake config keeps its value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"mooncake: {where} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"mooncake: {where} must be >= 0, got {value}")
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            size = parse_bytes(value)
        except ConfigError as exc:  # a fraction of a byte
            raise ConfigError(f"mooncake: {where}: {exc}") from None
        if size is not None:
            return size
    raise ConfigError(
        f"mooncake: {where} must be a size (bytes, or like '512mb', '4GiB'), got {value!r}"
    )


def _where(name: str, source: str) -> str:
    if source == "option":
        return f"option {name!r}"
    if source.startswith("MOONCAKE_") or source.startswith("SGLANG_"):
        return f"environment variable {source} (for option {name!r})"
    return f"{source} (for option {name!r})"


def _check_text(name: str, value: object, source: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"mooncake: {_where(name, source)} must be a string, got {type(value).__name__}"
        )
    text = value.strip()
    if not text and not allow_empty:
        raise ConfigError(f"mooncake: {_where(name, source)} must not be empty")
    if any(c.isspace() for c in text):
        raise ConfigError(f"mooncake: {_where(name, source)} must not contain spaces: {value!r}")
    return text


def _check_size(name: str, value: object, source: str) -> int:
    return parse_size(value, _where(name, source))


def _check_master(value: object, source: str) -> str:
    text = _check_text("master_address", value, source)
    if "://" in text:  # e.g. etcd://h1:2379;h2:2379 for a master with HA
        return text
    match = _HOST_PORT_RE.match(text)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(
            f"mooncake: {_where('master_address', source)} must be host:port (the master's "
            f"RPC address, e.g. 127.0.0.1:50051) or an etcd:// URL, got {text!r}"
        )
    return text


def _check_protocol(value: object, source: str) -> str:
    text = _check_text("protocol", value, source).lower()
    if text not in PROTOCOLS:
        raise ConfigError(
            f"mooncake: {_where('protocol', source)} must be one of {', '.join(PROTOCOLS)}, "
            f"got {value!r}"
        )
    return text


def _check_devices(value: object, source: str) -> str:
    """One device, a comma-separated list, or a list of names (Mooncake wants "a,b")."""
    if isinstance(value, (list, tuple)):
        names = [_check_text("device_name", v, source) for v in value]
        return ",".join(names)
    return _check_text("device_name", value, source, allow_empty=True)


def _option_bool(options: Mapping[str, object], name: str) -> bool:
    value = options[name]
    if not isinstance(value, bool):
        raise ConfigError(f"mooncake: option {name!r} must be a bool, got {value!r}")
    return value


def _read_json(path: str, env_var: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"mooncake: cannot read {env_var}={path!r}: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"mooncake: {env_var}={path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"mooncake: {env_var}={path!r} must hold a JSON object")
    return data


def _transfers_in_flight(value: object, protocol: str, env: Mapping[str, str]) -> int | None:
    """The option, or by default over TCP the transport's queue per peer (:mod:`._flight`;
    read from the environment whatever ``read_env`` says, as Mooncake's transport reads
    it), and no bound over RDMA, whose limits were not measured. 0: no bound."""
    if value is None:
        return queue_limit(env.get(TCP_QUEUE_ENV)) if protocol == "tcp" else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            "mooncake: option 'transfers_in_flight' must be an int >= 1 (0: no bound; "
            f"None: the TCP queue, {TCP_QUEUE_ENV}), got {value!r}"
        )
    return value or None


def mooncake_settings(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """Settings Mooncake's integrations would use here: name -> (value, source)."""
    out: dict[str, tuple[object, str]] = {}
    for env_var in (CONFIG_PATH_ENV, SGLANG_CONFIG_PATH_ENV):
        path = environ.get(env_var)
        if path:
            data = _read_json(path, env_var)
            for name, key in JSON_KEYS.items():
                if key in data:
                    out[name] = (data[key], f"key {key!r} in {path}")
            # vLLM: a "standalone-store" client mounts nothing (storage runs elsewhere).
            if data.get("mode") == "standalone-store" and "global_segment_size" not in out:
                out["global_segment_size"] = (0, f"key 'mode' in {path}")
            return out
    for name, env_var in ENV_VARS.items():
        value = environ.get(env_var)
        if value is not None and (value != "" or name == "device_name"):
            out[name] = (value, env_var)
    return out


def make_config(
    options: Mapping[str, object], *, environ: Mapping[str, str] | None = None
) -> MooncakeConfig:
    """Merge the backend's options with Mooncake's settings and check every value.

    ``options`` holds every argument of ``MooncakeBackend`` by name. A Mooncake setting
    (a key of :data:`JSON_KEYS`) that is None or absent was not given: it comes from
    the file, the environment or :data:`DEFAULTS`, in that order.
    """
    read_env = _option_bool(options, "read_env")
    env = os.environ if environ is None else environ
    found = mooncake_settings(env) if read_env else {}
    merged: dict[str, tuple[object, str]] = {}
    for name in JSON_KEYS:
        explicit = options.get(name)
        if explicit is not None:
            merged[name] = (explicit, "option")
        elif name in found:
            merged[name] = found[name]
        elif name in DEFAULTS:
            merged[name] = (DEFAULTS[name], "default")
    if "master_address" not in merged:
        raise ConfigError(
            "mooncake: option 'master_address' is required (the master's host:port), or set "
            f"MOONCAKE_MASTER or {CONFIG_PATH_ENV} as for Mooncake's own integrations"
        )
    master = _check_master(*merged["master_address"])
    metadata = _check_text("metadata_server", *merged["metadata_server"])
    protocol = _check_protocol(*merged["protocol"])
    devices = _check_devices(*merged["device_name"])
    hostname = _check_text("local_hostname", *merged["local_hostname"])
    segment = _check_size("global_segment_size", *merged["global_segment_size"])
    local = _check_size("local_buffer_size", *merged["local_buffer_size"])

    replica_num = options["replica_num"]
    setup_retries = options["setup_retries"]
    probe_timeout_s = options["probe_timeout_s"]
    if isinstance(replica_num, bool) or not isinstance(replica_num, int) or replica_num < 1:
        raise ConfigError(
            f"mooncake: option 'replica_num' must be an int >= 1, got {replica_num!r}"
        )
    if setup_retries is not None and (
        isinstance(setup_retries, bool) or not isinstance(setup_retries, int) or setup_retries < 1
    ):
        raise ConfigError(
            f"mooncake: option 'setup_retries' must be an int >= 1 (or None), got {setup_retries!r}"
        )
    if (
        isinstance(probe_timeout_s, bool)
        or not isinstance(probe_timeout_s, (int, float))
        or not math.isfinite(probe_timeout_s)
        or probe_timeout_s <= 0
    ):
        raise ConfigError(
            f"mooncake: option 'probe_timeout_s' must be a number > 0, got {probe_timeout_s!r}"
        )
    in_flight = _transfers_in_flight(options["transfers_in_flight"], protocol, env)
    scratch = parse_size(options["scratch_bytes"], "option 'scratch_bytes'")
    if scratch < 1:
        raise ConfigError(
            f"mooncake: option 'scratch_bytes' must be > 0, got {options['scratch_bytes']!r}"
        )
    return MooncakeConfig(
        master_address=master,
        metadata_server=metadata,
        protocol=protocol,
        device_name=devices,
        local_hostname=hostname,
        global_segment_size=segment,
        local_buffer_size=local,
        replica_num=replica_num,
        soft_pin=_option_bool(options, "soft_pin"),
        setup_retries=setup_retries,
        probe_timeout_s=float(probe_timeout_s),
        scratch_bytes=scratch,
        read_failover=_option_bool(options, "read_failover"),
        transfers_in_flight=in_flight,
        sources={name: source for name, (_, source) in merged.items()},
    )
