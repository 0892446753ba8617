"""Validated options of the Redis backend, and the URL forms it accepts.

Every option is checked here, before any connection is made, so a typo fails at start-up
with a :class:`~kvconn.errors.ConfigError` that names the option, instead of surfacing
later as a confusing connection error in the serving loop.

URL forms (``redis-py`` compatible where they overlap):

* ``redis://[[user]:password@]host[:port][/db]`` - plain TCP (port 6379 by default);
* ``rediss://…`` - the same over TLS;
* ``unix://[[user]:password@]/path/to/redis.sock[?db=N]`` - a Unix domain socket;
* ``redis+cluster://host[:port][,host[:port]…]`` and ``rediss+cluster://…`` - Redis
  Cluster: the listed nodes are only seeds, the client discovers the rest. The same as
  ``cluster=True`` with a ``redis://`` URL; the scheme exists so that one string in a
  config file can say "cluster" on its own. Several seeds are allowed only for a cluster.

Explicit options (``username``, ``password``, ``db``) take precedence over the URL: a
deployment can keep the URL in a shared config and the secret in its own.
"""

from __future__ import annotations

import math
import os
import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

from kvconn.errors import ConfigError
from kvconn.redaction import redact_url

__all__ = ["DEFAULT_URL", "RedisConfig", "make_config"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PORT = 6379

_TCP_SCHEMES = {"redis": False, "rediss": True}  # scheme -> TLS
_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}


@dataclass(frozen=True)
class RedisConfig:
    """Everything a client needs to reach one Redis deployment; built by :func:`make_config`."""

    nodes: tuple[tuple[str, int], ...]  # (host, port); several only for a cluster's seeds
    unix_path: str | None
    tls: bool
    cluster: bool
    db: int
    username: str | None
    password: str | None = field(repr=False)  # never in a repr, a log line or an error
    key_prefix: str
    max_connections: int
    connect_timeout_s: float
    timeout_s: float
    ttl_ms: int | None
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_verify: bool
    #: One server's ``MGET`` replies are read into buffers kept for reuse
    #: (:mod:`kvconn_redis._reply`); False: as redis-py parses them.
    reuse_reply_buffers: bool = True

    @property
    def where(self) -> str:
        """The address for messages and logs; never contains the password."""
        if self.unix_path is not None:
            return f"unix://{self.unix_path}?db={self.db}"
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + ("" if self.cluster else f"/{self.db}")

    def check_tls(self) -> None:
        """Load the tls_* files once, so a bad certificate or key fails at start-up."""
        try:
            context = ssl.create_default_context(cafile=self.tls_ca_file)
            if self.tls_cert_file is not None:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"redis: cannot set up TLS from the tls_* options: {exc}") from exc


def _fail(option: str, problem: str) -> ConfigError:
    # Problems quote the URL: its password must not travel with them.
    return ConfigError(redact_url(f"redis: option {option!r} {problem}"))


def _check_str(option: str, value: object, *, allow_empty: bool = False) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _fail(option, f"must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise _fail(option, "must not be empty (leave it out instead)")
    return value


def _check_positive(
    option: str, value: object, *, integer: bool = False, most: float = math.inf
) -> float:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an int" if integer else "a number"
        raise _fail(option, f"must be {kind} > 0, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise _fail(option, f"must be > 0 and finite, got {value!r}")
    if value > most:
        raise _fail(option, f"must be at most {most:g}, got {value!r}")
    return float(value)


#: Longest socket timeout accepted: a day. Far beyond any useful wait, and far below
#: what ``socket.settimeout`` overflows on (~1e10 s).
_MAX_TIMEOUT_S = 86400.0
#: Longest TTL accepted: ~31 years, which Redis's PX still holds.
_MAX_TTL_S = 1e9


def _check_file(option: str, value: object) -> str | None:
    path = _check_str(option, value)
    if path is not None and not os.path.isfile(path):
        raise _fail(option, f"names {path!r}, which is not a readable file")
    return path


def _parse_host(option: str, text: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6addr]:port``."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _fail(option, f"has an unclosed IPv6 bracket in {text!r}")
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise _fail(option, f"has junk after the IPv6 address in {text!r}")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise _fail(option, f"has no host in {text!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _fail(option, f"has a bad port {port_text!r} (want 1-65535)")
    return host, int(port_text)


@dataclass(frozen=True)
class _ParsedUrl:
    nodes: tuple[tuple[str, int], ...]
    unix_path: str | None
    tls: bool
    cluster: bool
    db: int | None
    username: str | None
    password: str | None


def _parse_db(text: str) -> int:
    if not text.isdigit():
        raise _fail("url", f"has a bad database number {text!r} (want an int >= 0)")
    return int(text)


def parse_url(url: object) -> _ParsedUrl:
    """Split a Redis URL into its parts; anything this backend would ignore is an error."""
    if not isinstance(url, str):
        raise _fail("url", f"must be a string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in {**_TCP_SCHEMES, **_CLUSTER_SCHEMES, "unix": False}:
        raise _fail(
            "url",
            f"must start with redis://, rediss://, unix://, redis+cluster:// or "
            f"rediss+cluster://, got {url!r}",
        )
    rest, _, fragment = rest.partition("#")
    rest, _, query_text = rest.partition("?")
    if fragment:
        raise _fail("url", "must not have a #fragment")
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    unknown = sorted(set(query) - {"db"})
    if unknown:
        raise _fail(
            "url",
            f"has query parameter(s) {', '.join(unknown)} this backend does not read; "
            "pass them as backend options instead",
        )
    db = _parse_db(query["db"]) if "db" in query else None

    if scheme == "unix":
        userinfo, at, path = rest.rpartition("@") if "@" in rest else ("", "", rest)
        if not path.startswith("/"):
            raise _fail(
                "url", f"needs an absolute socket path (unix:///path/redis.sock), got {url!r}"
            )
        nodes: tuple[tuple[str, int], ...] = ()
        unix_path: str | None = unquote(path)
    else:
        netloc, _, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        if not at:
            userinfo, hosts = "", netloc
        if not hosts:
            raise _fail("url", f"has no host in {url!r}")
        nodes = tuple(_parse_host("url", h) for h in hosts.split(","))
        unix_path = None
        if path:
            if db is not None:
                raise _fail("url", "gives the database both as /db and as ?db=")
            db = _parse_db(path)
    username = password = None
    if userinfo:
        user_text, colon, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if colon else None
    cluster = scheme in _CLUSTER_SCHEMES
    tls = _TCP_SCHEMES.get(scheme, False) or _CLUSTER_SCHEMES.get(scheme, False)
    return _ParsedUrl(nodes, unix_path, tls, cluster, db, username, password)


def make_config(
    *,
    url: object,
    username: object,
    password: object,
    db: object,
    key_prefix: object,
    max_connections: object,
    connect_timeout_s: object,
    timeout_s: object,
    ttl_s: object,
    cluster: object,
    tls_ca_file: object,
    tls_cert_file: object,
    tls_key_file: object,
    tls_verify: object,
    reuse_reply_buffers: object = True,
) -> RedisConfig:
    """Check every option and combine it with the URL; raise ConfigError naming the culprit."""
    parsed = parse_url(url)
    username = _check_str("username", username)
    password = _check_str("password", password, allow_empty=True)
    if db is not None and (isinstance(db, bool) or not isinstance(db, int) or db < 0):
        raise _fail("db", f"must be an int >= 0, got {db!r}")
    prefix = _check_str("key_prefix", key_prefix, allow_empty=True) or ""
    if prefix and (
        not prefix.isascii() or not prefix.isprintable() or any(c.isspace() for c in prefix)
    ):
        raise _fail(
            "key_prefix", f"must be printable ASCII without spaces, like keys; got {prefix!r}"
        )
    connections = int(_check_positive("max_connections", max_connections, integer=True))
    connect_timeout = _check_positive("connect_timeout_s", connect_timeout_s, most=_MAX_TIMEOUT_S)
    timeout = _check_positive("timeout_s", timeout_s, most=_MAX_TIMEOUT_S)
    ttl_ms = None
    if ttl_s is not None:
        # PX takes whole milliseconds; round up so a tiny TTL never becomes "no expiry".
        ttl_ms = max(1, math.ceil(_check_positive("ttl_s", ttl_s, most=_MAX_TTL_S) * 1000))
    if not isinstance(cluster, bool):
        raise _fail("cluster", f"must be a bool, got {cluster!r}")
    for option, flag in (("tls_verify", tls_verify), ("reuse_reply_buffers", reuse_reply_buffers)):
        if not isinstance(flag, bool):
            raise _fail(option, f"must be a bool, got {flag!r}")
    ca_file = _check_file("tls_ca_file", tls_ca_file)
    cert_file = _check_file("tls_cert_file", tls_cert_file)
    key_file = _check_file("tls_key_file", tls_key_file)
    if key_file is not None and cert_file is None:
        raise _fail("tls_key_file", "needs tls_cert_file too")
    tls_options = [
        name
        for name, value in (
            ("tls_ca_file", ca_file),
            ("tls_cert_file", cert_file),
            ("tls_key_file", key_file),
        )
        if value is not None
    ] + (["tls_verify"] if not tls_verify else [])
    if tls_options and not parsed.tls:
        raise _fail(tls_options[0], "only applies to TLS; use a rediss:// URL")

    final_username = username if username is not None else parsed.username
    final_password = password if password is not None else parsed.password
    if final_username is not None and final_password is None:
        raise _fail("username", "needs a password too (Redis AUTH takes both)")
    cluster = cluster or parsed.cluster
    final_db = db if db is not None else (parsed.db or 0)
    if cluster:
        if parsed.unix_path is not None:
            raise _fail("cluster", "cannot be used with a unix:// URL (Redis Cluster is TCP only)")
        if final_db != 0:
            raise _fail(
                "db", f"must be 0 in cluster mode (Redis Cluster has one database), got {final_db}"
            )
    elif len(parsed.nodes) > 1:
        raise _fail("url", "lists several hosts, which only a cluster accepts (redis+cluster://)")
    config = RedisConfig(
        nodes=parsed.nodes,
        unix_path=parsed.unix_path,
        tls=parsed.tls,
        cluster=cluster,
        db=final_db,
        username=final_username,
        password=final_password,
        key_prefix=prefix,
        max_connections=connections,
        connect_timeout_s=connect_timeout,
        timeout_s=timeout,
        ttl_ms=ttl_ms,
        tls_ca_file=ca_file,
        tls_cert_file=cert_file,
        tls_key_file=key_file,
        tls_verify=bool(tls_verify),
        reuse_reply_buffers=bool(reuse_reply_buffers),
    )
    if config.tls:
        config.check_tls()
    return config
