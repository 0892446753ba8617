"""kvconn's vLLM adapter: ``KvconnConnector``, a vLLM v1 KV connector.

vLLM finds it with ``kv_connector_module_path="kvconn_vllm"``. The connector's names
load on first use: ``kvconn_vllm.layout`` (how vLLM's KV tensors become a kvconn
layout) needs only torch, and kvconn itself never imports this package or vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

_CONNECTOR_NAMES = ("KvconnConnector", "KvconnMetadata", "LayoutHandshake", "Transfer")
__all__ = list(_CONNECTOR_NAMES)


def __getattr__(name: str) -> Any:
    if name in _CONNECTOR_NAMES:
        return getattr(importlib.import_module("kvconn_vllm.connector"), name)
    raise AttributeError(f"module 'kvconn_vllm' has no attribute {name!r}")
