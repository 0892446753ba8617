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

from kvconn.config import ConnectorConfig, unknown_names
from kvconn.engine_settings import EngineModel, adapter_config, check_kv_heads
from kvconn.errors import ConfigError

#: Keys SGLang itself reads from the extra config of a dynamic backend.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # SGLang's own knobs, which its controllers pop before they build a backend, and
        # its decode-side offload manager passes on as they are
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
#: Keys of this adapter.
ADAPTER_KEYS = frozenset({"kvconn", "kv_heads"})


def engine_model(server_args: Any, served_name: str | None) -> EngineModel | None:
    """The weights SGLang loads (``--model-path``, ``--revision``, ``--quantization``).

    ``server_args`` is SGLang's published ``ServerArgs`` (``None`` when none was
    published); only then is the name SGLang serves under (an alias, possibly shared by
    different models) the fallback.
    """
    if server_args is not None and getattr(server_args, "model_path", None):
        return EngineModel.of(
            server_args.model_path,
            getattr(server_args, "revision", None),
            getattr(server_args, "quantization", None),
        )
    return EngineModel.of(served_name) if served_name else None


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
        model: EngineModel | str | None,
        environ: Mapping[str, str] | None = None,
    ) -> AdapterSettings:
        """Settings from SGLang's extra config, kvconn's environment and the served model.

        kvconn's configuration is the ``kvconn`` table, overlaid by ``$KVCONN_CONFIG``
        and ``KVCONN_*`` variables, as in every adapter (:mod:`kvconn.engine_settings`);
        ``model`` defaults to the weights SGLang loads (:func:`engine_model`).
        """
        extra = dict(extra or {})
        unknown = set(extra) - SGLANG_KEYS - ADAPTER_KEYS
        if unknown:
            raise unknown_names(
                "key",
                unknown,
                ADAPTER_KEYS,
                where="the HiCache extra config",
                note=f"SGLang's own: {', '.join(sorted(SGLANG_KEYS))}",
            )
        if not extra.get("interface_v1"):
            raise ConfigError(
                'the kvconn HiCache backend moves pages in place: set "interface_v1": 1 '
                "in the extra config (without it SGLang copies each page through a "
                "temporary tensor and calls methods this backend does not provide)"
            )
        if isinstance(model, str):
            model = EngineModel.of(model) if model else None
        connector = adapter_config(
            extra.get("kvconn"),
            engine_model=model,
            environ=environ,
            where="the extra config's 'kvconn' entry",
        )
        return cls(connector, check_kv_heads(extra.get("kv_heads"), "the HiCache extra config"))
