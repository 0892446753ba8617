"""kvconn as a TensorRT-LLM 1.2 KV-cache connector.

Turned on with the engine's own ``kv_connector_config``::

    kv_connector_config:
      connector_module: kvconn_trtllm
      connector_scheduler_class: KvconnScheduler
      connector_worker_class: KvconnWorker

Tested only against a stand-in of the connector interface written from its documented
signatures, never against TensorRT-LLM itself (docs/engines/tensorrt-llm.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconn_trtllm.connector import KvconnScheduler as KvconnScheduler
    from kvconn_trtllm.connector import KvconnWorker as KvconnWorker

__all__ = ["KvconnScheduler", "KvconnWorker"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvconn_trtllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvconn_trtllm' has no attribute {name!r}")
