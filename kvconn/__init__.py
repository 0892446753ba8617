"""kvconn: a KV-cache connector core that stores replicated bytes once.

The public surface: describe a rank's pool (:mod:`kvconn.layout`), build a
:class:`Connector` from a :class:`ConnectorConfig`, and call ``lookup`` / ``save`` /
``load``. Backends are found by name through the ``kvconn.backends`` entry points.
"""

from kvconn.backend import Backend, Capabilities
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector, LoadResult, LookupResult, SaveResult
from kvconn.errors import (
    BackendDependencyMissing,
    BackendError,
    BackendNotFound,
    BackendUnavailable,
    ConfigError,
    InvalidKeyError,
    KvconnError,
    LayoutError,
)
from kvconn.hashing import ReuseScope, block_hashes
from kvconn.layout import KvLayout, LayerGroup, Region, Role, shard_position
from kvconn.plan import WriterPolicy
from kvconn.registry import installed_backends, load_backend

__all__ = [
    "Backend",
    "BackendDependencyMissing",
    "BackendError",
    "BackendNotFound",
    "BackendUnavailable",
    "Capabilities",
    "ConfigError",
    "Connector",
    "ConnectorConfig",
    "InvalidKeyError",
    "KvLayout",
    "KvconnError",
    "LayerGroup",
    "LayoutError",
    "LoadResult",
    "LookupResult",
    "Region",
    "ReuseScope",
    "Role",
    "SaveResult",
    "WriterPolicy",
    "block_hashes",
    "installed_backends",
    "load_backend",
    "shard_position",
]

__version__ = "0.1.0"
