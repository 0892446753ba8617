"""Where the TensorRT-LLM adapter finds its configuration.

``kv_connector_config`` names only the module and the two classes, so kvconn's settings
come from kvconn's usual sources: ``$KVCONN_CONFIG`` (a TOML file) and ``KVCONN_*``
variables, with ``model`` defaulting to the model the engine serves. The adapter's own
settings are the file's ``[tensorrt_llm]`` table (``kv_heads``); it is
taken out before the rest is read as kvconn configuration, whose unknown keys stay errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvconn.config import ENV_CONFIG_FILE, ConnectorConfig, load_toml, unknown_names
from kvconn.engine_settings import EngineModel, adapter_config, check_kv_heads
from kvconn.errors import ConfigError

TABLE = "tensorrt_llm"
TABLE_KEYS = frozenset({"kv_heads"})
#: TensorRT-LLM's ``QuantAlgo`` for "no quantization": not a quantization of the weights.
_NO_QUANT = "NO_QUANT"


def engine_model(llm_args: Any) -> EngineModel | None:
    """The weights TensorRT-LLM loads: ``model``, ``revision``, ``quant_config.quant_algo``.

    ``llm_args`` is the engine's ``LlmArgs``, or just the model's name or path.
    """
    if llm_args is None or isinstance(llm_args, (str, os.PathLike)):
        return EngineModel.of(llm_args) if llm_args else None
    model = getattr(llm_args, "model", None)
    if not model:
        return None
    algo = getattr(getattr(llm_args, "quant_config", None), "quant_algo", None)
    algo = getattr(algo, "value", algo)
    return EngineModel.of(
        model, getattr(llm_args, "revision", None), None if algo == _NO_QUANT else algo
    )


@dataclass(frozen=True)
class TrtllmSettings:
    """kvconn's connector configuration plus the model's global KV head count.

    ``kv_heads`` (MHA/GQA only) says how many distinct K/V heads the TP group holds;
    left out, every rank's K/V is keyed as its own shard, which is always correct but
    stores a GQA head that several ranks duplicate once per rank.

    kvconn's ``stripe_reads`` (``connector.stripe_reads``): the ranks form a gloo group
    (:mod:`kvconn_trtllm.group`) and read each page several of them hold once per
    group. 1.2 launched through MPI has no torch.distributed group, so the adapter
    opens one of its own.
    """

    connector: ConnectorConfig
    kv_heads: int | None = None

    @property
    def stripe_reads(self) -> bool:
        return self.connector.stripe_reads

    @classmethod
    def load(cls, llm_args: Any, environ: Mapping[str, str] | None = None) -> TrtllmSettings:
        """Settings from ``$KVCONN_CONFIG`` (its ``[tensorrt_llm]`` table taken out) and
        ``KVCONN_*`` variables; ``model`` defaults to the weights the engine loads
        (:func:`engine_model`), as in every adapter (:mod:`kvconn.engine_settings`)."""
        env = dict(os.environ if environ is None else environ)
        base: dict[str, Any] = {}
        table: Any = {}
        path = env.pop(ENV_CONFIG_FILE, None)
        if path:
            base = load_toml(path)
            table = base.pop(TABLE, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}: [{TABLE}] must be a table, got {type(table).__name__}")
        if set(table) - TABLE_KEYS:
            raise unknown_names(
                f"[{TABLE}] key", set(table) - TABLE_KEYS, TABLE_KEYS, where=path or ""
            )
        connector = adapter_config(
            base, engine_model=engine_model(llm_args), environ=env, where=str(path)
        )
        return cls(connector, check_kv_heads(table.get("kv_heads"), f"{path}: [{TABLE}]"))
