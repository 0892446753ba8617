"""Where the TensorRT-LLM adapter finds its configuration.

``kv_connector_config`` names only the module and the two classes, so kvconn's settings
come from kvconn's usual sources: ``$KVCONN_CONFIG`` (a TOML file) and ``KVCONN_*``
variables, with ``model`` defaulting to the model the engine serves. The adapter's own
settings are the file's ``[tensorrt_llm]`` table (``kv_heads``, ``stripe_reads``); it is
taken out before the rest is read as kvconn configuration, whose unknown keys stay errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvconn.config import ENV_CONFIG_FILE, ConnectorConfig, load_toml
from kvconn.errors import ConfigError

TABLE = "tensorrt_llm"
TABLE_KEYS = frozenset({"kv_heads", "stripe_reads"})


@dataclass(frozen=True)
class TrtllmSettings:
    """kvconn's connector configuration plus the model's global KV head count.

    ``kv_heads`` (MHA/GQA only) says how many distinct K/V heads the TP group holds;
    left out, every rank's K/V is keyed as its own shard, which is always correct but
    stores a GQA head that several ranks duplicate once per rank.

    ``stripe_reads``: the ranks form a gloo group (:mod:`kvconn_trtllm.group`) and
    read each page several of them hold once per group. Off by default: 1.2 launched
    through MPI has no torch.distributed group, so the adapter opens one of its own.
    """

    connector: ConnectorConfig
    kv_heads: int | None = None
    stripe_reads: bool = False

    @classmethod
    def load(cls, model: Any, environ: Mapping[str, str] | None = None) -> TrtllmSettings:
        env = dict(os.environ if environ is None else environ)
        base: dict[str, Any] = {}
        if str(model or ""):
            base["model"] = str(model)
        table: Any = {}
        path = env.pop(ENV_CONFIG_FILE, None)
        if path:
            loaded = load_toml(path)
            table = loaded.pop(TABLE, {})
            base.update(loaded)
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}: [{TABLE}] must be a table, got {type(table).__name__}")
        unknown = sorted(set(table) - TABLE_KEYS)
        if unknown:
            raise ConfigError(
                f"{path}: unknown key(s) in [{TABLE}]: {', '.join(unknown)}; "
                f"known: {', '.join(sorted(TABLE_KEYS))}"
            )
        kv_heads = table.get("kv_heads")
        if kv_heads is not None and (
            isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1
        ):
            raise ConfigError(
                f"{path}: [{TABLE}] kv_heads must be a positive int, got {kv_heads!r}"
            )
        stripe = table.get("stripe_reads", False)
        if not isinstance(stripe, bool):
            raise ConfigError(
                f"{path}: [{TABLE}] stripe_reads must be true or false, got {stripe!r}"
            )
        return cls(ConnectorConfig.from_env(env, base=base), kv_heads, stripe)
