"""The adapter's part of SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands a dynamic backend the whole extra-config dict. Its own keys
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``) sit next to ours;
kvconn's configuration is the ``kvconn`` table, in the same form as a kvconn TOML file,
so the store is chosen by its entry-point name (``"backend": "redis"``) exactly as
anywhere else. Unknown keys are errors, as in kvconn's own configuration: a misspelt
``kv_head`` silently ignored would show up weeks later as a footprint twice too large.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvconn.config import ConnectorConfig
from kvconn.errors import ConfigError

#: Keys SGLang itself reads from the extra config of a dynamic backend.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
#: Keys of this adapter.
ADAPTER_KEYS = frozenset({"kvconn", "kv_heads"})


@dataclass(frozen=True)
class AdapterSettings:
    """What the adapter needs besides the host pool.

    ``kv_heads`` is the model's global KV head count; ``None`` reads it from the served
    model's config (and keys every rank's K/V separately if that is impossible).
    """

    connector: ConnectorConfig
    kv_heads: int | None = None

    @classmethod
    def from_extra_config(
        cls,
        extra: Mapping[str, Any] | None,
        model_name: str | None,
        environ: Mapping[str, str] | None = None,
    ) -> AdapterSettings:
        """Settings from SGLang's extra config, kvconn's environment and the served model.

        kvconn's configuration is the ``kvconn`` table, overlaid by ``$KVCONN_CONFIG``
        and ``KVCONN_*`` variables (``ConnectorConfig.from_env``); ``model`` defaults to
        the model name SGLang serves under.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - SGLANG_KEYS - ADAPTER_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown key(s) in the HiCache extra config: {', '.join(unknown)}; "
                f"kvconn's adapter reads {', '.join(sorted(ADAPTER_KEYS))} "
                f"(SGLang reads {', '.join(sorted(SGLANG_KEYS))})"
            )
        if not extra.get("interface_v1"):
            raise ConfigError(
                'the kvconn HiCache backend moves pages in place: set "interface_v1": 1 '
                "in the extra config (without it SGLang copies each page through a "
                "temporary tensor and calls methods this backend does not provide)"
            )
        table = extra.get("kvconn", {})
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"the extra config's 'kvconn' entry must be a table of kvconn settings, "
                f"got {type(table).__name__}"
            )
        base = dict(table)
        if "model" not in base and model_name:
            base["model"] = model_name
        connector = ConnectorConfig.from_env(environ, base=base)
        kv_heads = extra.get("kv_heads")
        if kv_heads is not None and (
            isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1
        ):
            raise ConfigError(f"kv_heads must be a positive int, got {kv_heads!r}")
        return cls(connector, kv_heads)
