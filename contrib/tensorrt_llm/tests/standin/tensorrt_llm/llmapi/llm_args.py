"""The LLM API arguments a connector reads (stand-in, see package)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KvCacheConnectorConfig:
    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclass
class KvCacheConfig:
    tokens_per_block: int = 32
    enable_block_reuse: bool = True
    dtype: str = "auto"  # "auto", "fp8", "nvfp4"


@dataclass
class TorchLlmArgs:
    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_attention_dp: bool = False
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    #: tensorrt_llm.models.modeling_utils.QuantConfig: its kv_cache_quant_algo (QuantAlgo)
    quant_config: Any = None
