"""The settings every engine adapter reads the same way (kvconn.engine_settings).

The SGLang and TensorRT-LLM adapters' settings modules import no engine, so they are
checked here against each other; the vLLM adapter's ``connector_config`` is checked in
its own environment (contrib/vllm/tests/test_vllm_settings.py).
"""

from __future__ import annotations

import enum
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvconn.config import ConnectorConfig
from kvconn.engine_settings import EngineModel, adapter_config, check_kv_heads
from kvconn.errors import ConfigError
from kvconn.registry import load_backend
from kvconn.tools.models import preset_from_dict
from kvconn_sglang.settings import AdapterSettings, engine_model
from kvconn_trtllm.settings import TrtllmSettings
from kvconn_trtllm.settings import engine_model as trtllm_engine_model


class _QuantAlgo(str, enum.Enum):  # as TensorRT-LLM's QuantAlgo (a StrEnum)
    FP8 = "FP8"
    NO_QUANT = "NO_QUANT"


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (EngineModel.of("org/m"), "org/m@default"),
        (EngineModel.of(Path("/models/m"), "r1"), "/models/m@r1"),
        (EngineModel.of("org/m", None, "fp8"), "org/m@default+fp8"),
        (EngineModel.of("org/m", "", _QuantAlgo.FP8), "org/m@default+FP8"),
    ],
)
def test_the_default_model_is_the_weights_at_their_revision_with_their_quantization(model, name):
    assert model.key_name == name


def test_sglang_and_tensorrt_llm_name_the_same_weights_the_same_way(tmp_path):
    """Issue 15: vLLM said ``model@revision+quant``, TensorRT-LLM ``str(model)`` and
    SGLang the name it serves under, so one model had three names in the keys."""
    weights = {"model": "org/m", "revision": "r1", "quantization": "fp8"}
    sglang = AdapterSettings.from_extra_config(
        {"interface_v1": 1},
        engine_model(SimpleNamespace(model_path="org/m", revision="r1", quantization="fp8"), "gpt"),
        environ={},
    )
    llm_args = SimpleNamespace(
        model=Path(weights["model"]),
        revision="r1",
        quant_config=SimpleNamespace(quant_algo=_QuantAlgo("FP8")),
    )
    trtllm = TrtllmSettings.load(llm_args, environ={})
    assert sglang.connector.model == "org/m@r1+fp8"
    assert trtllm.connector.model == "org/m@r1+FP8"  # TensorRT-LLM spells its algorithms so
    # a served alias is no name for weights: only without published server arguments
    assert engine_model(None, "gpt") == EngineModel("gpt")
    assert trtllm_engine_model(
        SimpleNamespace(model="org/m", quant_config=SimpleNamespace(quant_algo=_QuantAlgo.NO_QUANT))
    ) == EngineModel("org/m")


def test_kvconn_variables_and_file_overlay_the_engines_table_in_every_adapter(tmp_path):
    config = tmp_path / "kvconn.toml"
    config.write_text('backend = "redis"\nnamespace = "from-file"\n')
    environ = {"KVCONN_CONFIG": str(config), "KVCONN_NAMESPACE": "from-env"}
    table = {"backend": "lmdb", "namespace": "from-table", "writer_policy": "first"}
    shared = adapter_config(table, engine_model=EngineModel("org/m"), environ=environ)
    assert (shared.backend, shared.namespace, shared.writer_policy.value, shared.model) == (
        "redis",
        "from-env",
        "first",
        "org/m@default",
    )
    sglang = AdapterSettings.from_extra_config(
        {"interface_v1": 1, "kvconn": table}, "org/m", environ=environ
    )
    assert sglang.connector == shared
    assert TrtllmSettings.load("org/m", environ=environ).connector.namespace == "from-env"
    named = adapter_config({"model": "mine"}, engine_model=EngineModel("org/m"), environ={})
    assert named.model == "mine"  # a stated model wins over the default
    with_env = adapter_config({}, engine_model=None, environ={"KVCONN_MODEL": "env"})
    assert with_env.model == "env"


def test_an_engine_table_that_is_not_a_table_is_refused_naming_where_it_came_from():
    with pytest.raises(ConfigError, match="kv_connector_extra_config must be a table"):
        adapter_config("redis", engine_model=None, environ={}, where="kv_connector_extra_config")


@pytest.mark.parametrize("bad", [0, -1, True, "4", 2.0])
def test_kv_heads_are_checked_by_one_rule_in_every_adapter(tmp_path, bad):
    with pytest.raises(ConfigError, match=f"here: kv_heads must be a positive int, got {bad!r}"):
        check_kv_heads(bad, "here")
    with pytest.raises(ConfigError, match="the HiCache extra config: kv_heads must be"):
        AdapterSettings.from_extra_config({"interface_v1": 1, "kv_heads": bad}, "m", environ={})
    path = tmp_path / "kvconn.toml"
    path.write_text(f'model = "m"\n[tensorrt_llm]\nkv_heads = {bad!r}\n'.replace("True", "true"))
    with pytest.raises(ConfigError, match=r"\[tensorrt_llm\]: kv_heads must be a positive int"):
        TrtllmSettings.load(None, environ={"KVCONN_CONFIG": str(path)})
    assert check_kv_heads(None, "here") is None and check_kv_heads(8, "here") == 8


def _message(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


def test_an_unknown_name_is_reported_in_one_form_wherever_it_comes_from(tmp_path):
    """Issue 15: the "unknown key(s) …; known: …" message had four wordings."""
    path = tmp_path / "kvconn.toml"
    path.write_text('model = "m"\n[tensorrt_llm]\nkv_head = 4\n')
    messages = [
        _message(lambda: ConnectorConfig.from_dict({"model": "m", "writer_polcy": 1})),
        _message(lambda: ConnectorConfig.from_env({"KVCONN_MODLE": "m"})),
        _message(lambda: AdapterSettings.from_extra_config({"interface_v1": 1, "kv_head": 1}, "m")),
        _message(lambda: TrtllmSettings.load(None, environ={"KVCONN_CONFIG": str(path)})),
        _message(lambda: preset_from_dict({"nmae": "x"}, where="my.toml")),
        _message(lambda: load_backend("lmdb", {"mapsize": 1})),
    ]
    assert messages == [
        "unknown configuration key(s): writer_polcy; known: backend, checksum, "
        "idle_wait_s, inflight_bytes, load_timeout_s, lookup_inline, lookup_timeout_s, "
        "lookup_wait_s, model, "
        "namespace, options, retry_interval_s, shard_heads, staging_bytes, stripe_reads, "
        "transfer_cpus, verify_replicas_every, writer_policy",
        "unknown environment variable(s): KVCONN_MODLE; known: KVCONN_BACKEND, "
        "KVCONN_CHECKSUM, KVCONN_CONFIG, KVCONN_IDLE_WAIT_S, KVCONN_INFLIGHT_BYTES, "
        "KVCONN_LOAD_TIMEOUT_S, "
        "KVCONN_LOOKUP_INLINE, KVCONN_LOOKUP_TIMEOUT_S, KVCONN_LOOKUP_WAIT_S, KVCONN_MODEL, "
        "KVCONN_NAMESPACE, "
        "KVCONN_OPTION_<NAME>, KVCONN_RETRY_INTERVAL_S, KVCONN_SHARD_HEADS, "
        "KVCONN_STAGING_BYTES, KVCONN_STRIPE_READS, KVCONN_TRANSFER_CPUS, "
        "KVCONN_VERIFY_REPLICAS_EVERY, KVCONN_WRITER_POLICY",
        "the HiCache extra config: unknown key(s): kv_head; known: kv_heads, kvconn "
        "(SGLang's own: backend_name, class_name, hicache_storage_pass_prefix_keys, "
        "interface_v1, module_path, prefetch_threshold, prefetch_timeout_base, "
        "prefetch_timeout_per_ki_token, tp_lcm_size)",
        f"{path}: unknown [tensorrt_llm] key(s): kv_head; known: kv_heads",
        "my.toml: unknown key(s): nmae; known: layers, name, roles, sources, summary",
        "backend 'lmdb': unknown option(s): mapsize; known: map_size, max_map_size, "
        "max_readers, path, readonly, sync",
    ]
