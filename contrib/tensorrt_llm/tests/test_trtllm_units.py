"""The TensorRT-LLM adapter's configuration, pool description and refusals."""

from __future__ import annotations

import pytest
import torch
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import RequestData, SchedulerOutput
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, TorchLlmArgs

from kvconn.errors import ConfigError, LayoutError
from kvconn.plan import plan_pages
from kvconn_trtllm import connector
from kvconn_trtllm.layout import describe_pool
from kvconn_trtllm.settings import TrtllmSettings


def write(tmp_path, text):
    path = tmp_path / "kvconn.toml"
    path.write_text(text)
    return {"KVCONN_CONFIG": str(path)}


def test_the_model_defaults_to_the_weights_the_engine_loads_as_in_every_adapter(tmp_path):
    """``<model>@<revision>[+<quantization>]`` (kvconn.engine_settings)."""
    env = write(tmp_path, 'backend = "redis"\n')
    settings = TrtllmSettings.load(TorchLlmArgs(model="org/model"), environ=env)
    assert settings.connector.model == "org/model@default"
    assert settings.connector.backend == "redis"
    assert settings.kv_heads is None
    assert TrtllmSettings.load("org/model", environ=env).connector.model == "org/model@default"


def test_the_adapter_table_is_read_apart_from_kvconns_keys(tmp_path):
    env = write(tmp_path, 'model = "m"\n[tensorrt_llm]\nkv_heads = 4\n')
    assert TrtllmSettings.load(None, environ=env).kv_heads == 4


def test_an_unknown_key_in_the_adapter_table_is_refused_by_name(tmp_path):
    env = write(tmp_path, 'model = "m"\n[tensorrt_llm]\nkv_head = 4\n')
    with pytest.raises(ConfigError, match="kv_head"):
        TrtllmSettings.load(None, environ=env)


@pytest.mark.parametrize("bad", ["0", "-2", "true", '"4"'])
def test_kv_heads_must_be_a_positive_int(tmp_path, bad):
    env = write(tmp_path, f'model = "m"\n[tensorrt_llm]\nkv_heads = {bad}\n')
    with pytest.raises(ConfigError, match="kv_heads"):
        TrtllmSettings.load(None, environ=env)


def test_unknown_kvconn_keys_stay_errors(tmp_path):
    with pytest.raises(ConfigError, match="writer_polcy"):
        TrtllmSettings.load("m", environ=write(tmp_path, 'writer_polcy = "first"\n'))


def test_a_blocks_pages_are_one_contiguous_run_in_memory_order():
    pool = torch.zeros(8, 3, 2, 4 * 16, dtype=torch.float16)
    plan = plan_pages(describe_pool(pool, tp_size=2, tokens_per_block=4, kv_heads=None))[0]
    assert plan.page_size == 3 * 2 * 4 * 16 * 2
    assert [(r.role, r.layer) for r in plan.regions][:3] == [("k", 0), ("v", 0), ("k", 1)]


def test_an_mla_pool_is_one_replicated_latent_page():
    pool = torch.zeros(8, 3, 1, 4 * 16, dtype=torch.bfloat16)
    plan = plan_pages(describe_pool(pool, tp_size=4, tokens_per_block=4, kv_heads=None))[0]
    assert plan.shard_class.replicated


@pytest.mark.parametrize(
    ("shape", "match"),
    [((8, 3, 2), "blocks, layers"), ((8, 3, 3, 64), "kv_factor"), ((8, 3, 2, 10), "multiple")],
)
def test_a_pool_of_another_shape_is_refused_naming_what_is_wrong(shape, match):
    with pytest.raises(LayoutError, match=match):
        describe_pool(torch.zeros(shape), tp_size=2, tokens_per_block=4, kv_heads=None)


def test_kv_heads_that_do_not_fit_the_tp_width_are_refused():
    with pytest.raises(LayoutError, match="units=3"):
        describe_pool(torch.zeros(8, 1, 2, 16), tp_size=2, tokens_per_block=4, kv_heads=3)


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [("pipeline_parallel_size", 2, "pipeline"), ("enable_attention_dp", True, "attention DP")],
)
def test_parallel_shapes_the_adapter_would_key_wrongly_are_refused(tmp_path, field, value, what):
    args = TorchLlmArgs(model="m", tensor_parallel_size=2, **{field: value})
    with pytest.raises(ConfigError, match=what):
        connector.KvconnWorker(args)


def test_a_scheduler_without_a_worker_in_its_process_says_where_it_must_run(monkeypatch):
    monkeypatch.setattr(connector, "_published_layout", None)
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    scheduler = connector.KvconnScheduler(args)

    class Request:
        request_id = 7

        def get_tokens(self, beam):
            return list(range(9))

    with pytest.raises(ConfigError, match="rank 0"):
        scheduler.get_num_new_matched_tokens(Request(), 0)


def test_a_request_with_multimodal_inputs_is_neither_looked_up_nor_saved(monkeypatch):
    monkeypatch.setattr(connector, "_published_layout", None)  # a lookup would raise
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    scheduler = connector.KvconnScheduler(args)

    class Request:
        request_id = 3
        multimodal_hashes = [[1, 2, 3]]

        def get_tokens(self, beam):
            return list(range(40))

    assert scheduler.get_num_new_matched_tokens(Request(), 0) == (0, False)
    output = SchedulerOutput(new_requests=[RequestData(3, list(range(40)), list(range(10)), 0, 40)])
    assert scheduler.build_connector_meta(output).saves == []
