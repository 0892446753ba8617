"""kvconn: a KV-cache connector core that stores replicated bytes once.

The public surface: describe a rank's pool (:mod:`kvconn.layout`), build a
:class:`Connector` from a :class:`ConnectorConfig`, and call ``lookup`` / ``save`` /
``load`` -- or hand transfers to a :class:`TransferService` and poll their outcomes.
A scheduler without tensors answers lookups with :class:`Lookup` (no torch import).
Backends are found by name through the ``kvconn.backends`` entry points.

Names are imported on first use: only the connector and its data movement need torch,
and a backend, a lookup-only process or ``kvconn --help`` should not pay seconds for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Backend": "kvconn.backend",
    "Capabilities": "kvconn.backend",
    "ConnectorConfig": "kvconn.config",
    "Connector": "kvconn.connector",
    "LoadResult": "kvconn.results",
    "LookupResult": "kvconn.results",
    "Outcome": "kvconn.results",
    "SaveResult": "kvconn.results",
    "DeadlineLookup": "kvconn.lookup",
    "Lookup": "kvconn.lookup",
    "PageKeys": "kvconn.lookup",
    "SaveRequest": "kvconn.transfer",
    "Transfer": "kvconn.transfer",
    "TransferService": "kvconn.transfer",
    "parse_key": "kvconn.keys",
    "ArgumentError": "kvconn.errors",
    "BackendDependencyMissing": "kvconn.errors",
    "BackendError": "kvconn.errors",
    "BackendNotFound": "kvconn.errors",
    "BackendUnavailable": "kvconn.errors",
    "ConfigError": "kvconn.errors",
    "ConnectorClosed": "kvconn.errors",
    "InvalidKeyError": "kvconn.errors",
    "KvconnError": "kvconn.errors",
    "LayoutError": "kvconn.errors",
    "ReuseScope": "kvconn.hashing",
    "adopt_hashes": "kvconn.hashing",
    "block_hashes": "kvconn.hashing",
    "Chunked": "kvconn.layout",
    "KvLayout": "kvconn.layout",
    "LayerGroup": "kvconn.layout",
    "NO_SLOT": "kvconn.layout",
    "Region": "kvconn.layout",
    "Role": "kvconn.layout",
    "UnitLayout": "kvconn.layout",
    "shard_position": "kvconn.layout",
    "WriterPolicy": "kvconn.plan",
    "installed_backends": "kvconn.registry",
    "load_backend": "kvconn.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvconn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and IDEs see; nothing is imported at run time
    from kvconn.backend import Backend as Backend
    from kvconn.backend import Capabilities as Capabilities
    from kvconn.config import ConnectorConfig as ConnectorConfig
    from kvconn.connector import Connector as Connector
    from kvconn.errors import ArgumentError as ArgumentError
    from kvconn.errors import BackendDependencyMissing as BackendDependencyMissing
    from kvconn.errors import BackendError as BackendError
    from kvconn.errors import BackendNotFound as BackendNotFound
    from kvconn.errors import BackendUnavailable as BackendUnavailable
    from kvconn.errors import ConfigError as ConfigError
    from kvconn.errors import ConnectorClosed as ConnectorClosed
    from kvconn.errors import InvalidKeyError as InvalidKeyError
    from kvconn.errors import KvconnError as KvconnError
    from kvconn.errors import LayoutError as LayoutError
    from kvconn.hashing import ReuseScope as ReuseScope
    from kvconn.hashing import adopt_hashes as adopt_hashes
    from kvconn.hashing import block_hashes as block_hashes
    from kvconn.keys import parse_key as parse_key
    from kvconn.layout import NO_SLOT as NO_SLOT
    from kvconn.layout import Chunked as Chunked
    from kvconn.layout import KvLayout as KvLayout
    from kvconn.layout import LayerGroup as LayerGroup
    from kvconn.layout import Region as Region
    from kvconn.layout import Role as Role
    from kvconn.layout import UnitLayout as UnitLayout
    from kvconn.layout import shard_position as shard_position
    from kvconn.lookup import DeadlineLookup as DeadlineLookup
    from kvconn.lookup import Lookup as Lookup
    from kvconn.lookup import PageKeys as PageKeys
    from kvconn.plan import WriterPolicy as WriterPolicy
    from kvconn.registry import installed_backends as installed_backends
    from kvconn.registry import load_backend as load_backend
    from kvconn.results import LoadResult as LoadResult
    from kvconn.results import LookupResult as LookupResult
    from kvconn.results import Outcome as Outcome
    from kvconn.results import SaveResult as SaveResult
    from kvconn.transfer import SaveRequest as SaveRequest
    from kvconn.transfer import Transfer as Transfer
    from kvconn.transfer import TransferService as TransferService
