"""What every engine adapter reads the same way: kvconn's configuration, the model, KV heads.

The vLLM, SGLang and TensorRT-LLM adapters each find kvconn's configuration in their
engine's own settings. Read three ways, the same deployment moved to another engine
(or two engines sharing one store) would get other keys for the same weights, or
ignore the ``KVCONN_*`` variables that the README promises. So each adapter hands its
engine's pieces to this module (torch-free, engine-free) and gets one answer:

* :func:`adapter_config` — the engine's table of kvconn settings, overlaid by
  ``$KVCONN_CONFIG`` and ``KVCONN_*`` variables (``ConnectorConfig.from_env``);
* :class:`EngineModel` — the default ``model``, ``<weights>@<revision>[+<quantization>]``
  from what the engine *loads*, never a served alias (two different models served as
  ``default`` must not share keys);
* :func:`check_kv_heads` — an operator's statement of the model's global KV head count.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvconn.config import ConnectorConfig
from kvconn.errors import ConfigError

__all__ = ["EngineModel", "adapter_config", "check_kv_heads"]

#: The revision part of the default model name when the engine names none.
DEFAULT_REVISION = "default"


@dataclass(frozen=True)
class EngineModel:
    """The weights an engine loads, as its own configuration names them.

    ``name`` is the path or hub id the engine loads the weights from; ``revision`` the
    hub revision it asked for (``None``: whatever the name resolves to); ``quantization``
    the weight quantization it applies (``None``: none), which changes the KV values
    as surely as other weights do.
    """

    name: str
    revision: str | None = None
    quantization: str | None = None

    @classmethod
    def of(cls, name: object, revision: object = None, quantization: object = None) -> EngineModel:
        """From an engine's values as they come: a ``Path``, an enum, ``""`` for none."""
        if isinstance(name, os.PathLike):
            name = os.fspath(name)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"the engine's model must be a non-empty name, got {name!r}")
        return cls(name, _optional_text(revision), _optional_text(quantization))

    @property
    def key_name(self) -> str:
        """kvconn's default ``model``: ``<name>@<revision or 'default'>[+<quantization>]``."""
        text = f"{self.name}@{self.revision or DEFAULT_REVISION}"
        return f"{text}+{self.quantization}" if self.quantization else text

    @property
    def tag(self) -> str:
        """:attr:`key_name` as a role dtype may hold it (no ``/``): 64 bits of blake2b,
        hex. Adapters name a speculative draft model's weights so in its roles."""
        return hashlib.blake2b(self.key_name.encode(), digest_size=8).hexdigest()


def _optional_text(value: object) -> str | None:
    """An engine's optional setting as text; an enum gives its value (``QuantAlgo.FP8``)."""
    value = getattr(value, "value", value)
    if value is None or value == "":
        return None
    return str(value)


def adapter_config(
    table: object,
    *,
    engine_model: EngineModel | None,
    environ: Mapping[str, str] | None = None,
    where: str = "the engine's kvconn settings",
) -> ConnectorConfig:
    """kvconn's configuration for an engine adapter, the same in every adapter.

    ``table`` (the kvconn settings found in the engine's configuration, or ``None``) is
    overlaid by ``$KVCONN_CONFIG`` and then ``KVCONN_*`` variables; ``model`` defaults,
    below all of them, to ``engine_model.key_name``. Unknown keys are errors, wherever
    they come from.
    """
    if table is None:
        table = {}
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table of kvconn settings, got {type(table).__name__}")
    base = dict(table)
    if engine_model is not None:
        base.setdefault("model", engine_model.key_name)
    return ConnectorConfig.from_env(environ, base=base)


def check_kv_heads(value: object, where: str) -> int | None:
    """An operator's KV head count (``None``: not stated), refused unless a positive int.

    The count decides which ranks share K/V pages; a float, a string or ``True`` would
    otherwise reach the layout as a count nobody meant.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{where}: kv_heads must be a positive int, got {value!r}")
    return value
