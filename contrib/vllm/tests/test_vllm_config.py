"""The adapter's configuration, read from a real ``VllmConfig`` (no engine started)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvconn.errors import ConfigError
from kvconn.plan import WriterPolicy
from kvconn_vllm.connector import connector_config, hash_scheme


def vllm_config(model: Path, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvconnConnector",
            kv_connector_module_path="kvconn_vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )


def test_the_extra_config_is_kvconns_configuration(tiny_model: Callable[[str], Path]) -> None:
    extra = {"model": "org/m@rev", "backend": "redis", "writer_policy": "first"}
    config = connector_config(vllm_config(tiny_model("llama-1kv"), extra))
    assert (config.model, config.backend, config.writer_policy) == (
        "org/m@rev",
        "redis",
        WriterPolicy.FIRST,
    )


def test_without_a_model_the_key_names_vllms_model_and_revision(
    tiny_model: Callable[[str], Path],
) -> None:
    config = connector_config(vllm_config(tiny_model("llama-1kv"), {"backend": "lmdb"}))
    assert config.model == f"{tiny_model('llama-1kv')}@default"


def test_an_unknown_key_fails_at_start_up_naming_it(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match=r"unknown configuration key\(s\): backnd"):
        connector_config(vllm_config(tiny_model("llama-1kv"), {"backnd": "redis"}))


def test_the_hash_scheme_names_vllms_algorithm(tiny_model: Callable[[str], Path]) -> None:
    assert hash_scheme(vllm_config(tiny_model("llama-1kv"), {})) == "vllm:sha256"
