"""kvconn as SGLang's HiCache L3 storage backend.

Turned on with SGLang's own flags::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvconn",
        "module_path": "kvconn_sglang", "class_name": "KvconnHiCacheStorage",
        "interface_v1": 1, "kvconn": {"backend": "redis", "options": {...}}}'

The class is imported on first use, so the settings and layout modules load without
SGLang (docs/engines/sglang.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconn_sglang.storage import KvconnHiCacheStorage as KvconnHiCacheStorage

__all__ = ["KvconnHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvconnHiCacheStorage":
        from kvconn_sglang.storage import KvconnHiCacheStorage

        return KvconnHiCacheStorage
    raise AttributeError(f"module 'kvconn_sglang' has no attribute {name!r}")
