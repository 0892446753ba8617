"""``connector_config`` reads kvconn's configuration as every adapter does.

Only the two parts of a ``VllmConfig`` that it reads are given (no model on disk), so
these tests hold whatever fixtures the end-to-end tests use.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvconn.errors import ConfigError
from kvconn_vllm.connector import connector_config


def vllm_config(extra: Any, *, revision: str | None = None, quantization: str | None = None) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="org/m", revision=revision, quantization=quantization),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
    )


def test_kvconn_variables_and_config_file_overlay_the_extra_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: the vLLM adapter read the extra config only, unlike the README and the
    other adapters, so ``KVCONN_*`` variables were silently ignored."""
    path = tmp_path / "kvconn.toml"
    path.write_text('namespace = "from-file"\n[options]\npath = "/tmp/kv"\n')
    monkeypatch.setenv("KVCONN_CONFIG", str(path))
    monkeypatch.setenv("KVCONN_BACKEND", "redis")
    config = connector_config(vllm_config({"backend": "lmdb", "writer_policy": "first"}))
    assert (config.backend, config.namespace, config.writer_policy.value) == (
        "redis",
        "from-file",
        "first",
    )
    assert config.options == {"path": "/tmp/kv"}
    monkeypatch.setenv("KVCONN_WRITER_POLCY", "first")
    with pytest.raises(ConfigError, match=r"environment variable\(s\): KVCONN_WRITER_POLCY"):
        connector_config(vllm_config({}))


def test_the_default_model_is_the_weights_at_their_revision_with_their_quantization(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("KVCONN_CONFIG", "KVCONN_MODEL"):
        monkeypatch.delenv(var, raising=False)
    assert connector_config(vllm_config(None)).model == "org/m@default"
    config = connector_config(vllm_config({}, revision="r1", quantization="fp8"))
    assert config.model == "org/m@r1+fp8"
    monkeypatch.setenv("KVCONN_MODEL", "pinned")
    assert connector_config(vllm_config({})).model == "pinned"
