"""The TensorRT-LLM adapter's configuration, pool description and refusals."""

from __future__ import annotations

import dataclasses
import inspect
import time
import types
from unittest import mock

import pytest
import torch
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import RequestData, SchedulerOutput
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, TorchLlmArgs

from kvconn.errors import ConfigError, LayoutError
from kvconn.hashing import block_hashes
from kvconn.plan import plan_pages
from kvconn_trtllm import connector, hashes
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


def test_striped_reads_are_off_unless_kvconns_stripe_reads_turns_them_on(tmp_path):
    assert not TrtllmSettings.load(None, environ=write(tmp_path, 'model = "m"\n')).stripe_reads
    env = write(tmp_path, 'model = "m"\nstripe_reads = true\n')
    assert TrtllmSettings.load(None, environ=env).stripe_reads
    env = write(tmp_path, 'model = "m"\nstripe_reads = "yes"\n')
    with pytest.raises(ConfigError, match="stripe_reads must be true or false"):
        TrtllmSettings.load(None, environ=env)
    env = write(tmp_path, 'model = "m"\n[tensorrt_llm]\nstripe_reads = true\n')
    with pytest.raises(ConfigError, match="stripe_reads"):  # kvconn's, not the adapter's
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
    monkeypatch.setattr(connector, "_published", None)
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    scheduler = connector.KvconnScheduler(args)

    class Request:
        request_id = 7

        def get_tokens(self, beam):
            return list(range(9))

    with pytest.raises(ConfigError, match="rank 0"):
        scheduler.get_num_new_matched_tokens(Request(), 0)


def test_a_request_with_multimodal_inputs_it_cannot_key_is_neither_looked_up_nor_saved(
    monkeypatch,
):
    monkeypatch.setattr(connector, "_published", None)  # a lookup would raise
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    scheduler = connector.KvconnScheduler(args)

    class Request:
        request_id = 3
        multimodal_hashes = [[1, 2, 3]]  # 3 words, and no positions

        def get_tokens(self, beam):
            return list(range(40))

    assert scheduler.get_num_new_matched_tokens(Request(), 0) == (0, False)
    output = SchedulerOutput(new_requests=[RequestData(3, list(range(40)), list(range(10)), 0, 40)])
    assert scheduler.build_connector_meta(output).saves == []


def request(**fields):
    """A TensorRT-LLM request as the hashes read it: None for every absent input."""
    base = dict.fromkeys(
        (
            "cache_salt_id",
            "lora_task_id",
            "multimodal_hashes",
            "multimodal_positions",
            "multimodal_lengths",
            "multimodal_embedding",
            "prompt_embedding_table",
        )
    )
    return types.SimpleNamespace(request_id=1, **(base | fields))


TOKENS = list(range(100, 124))  # 6 blocks of 4
A = [1, 2, 3, 4, 5, 6, 7, -8]


def test_the_cache_salt_and_the_lora_task_seed_the_chain_as_in_the_engines_block_keys():
    plain = hashes.request_hashes(request(), TOKENS, 4)
    assert plain == block_hashes(TOKENS, 4)
    salted = hashes.request_hashes(request(cache_salt_id=2**64 - 1), TOKENS, 4)
    assert len(salted) == 6 and not set(salted) & set(plain)
    assert salted != hashes.request_hashes(request(cache_salt_id=2**64 - 2), TOKENS, 4)
    lora = hashes.request_hashes(request(lora_task_id=3), TOKENS, 4)
    assert not set(lora) & set(plain) and not set(lora) & set(salted)


def test_a_block_names_each_image_it_overlaps_and_where_in_the_image_it_starts():
    # an image over tokens 6-13: blocks 1 (from its start), 2 (4 tokens in), 3 (8 in)
    extras = hashes.mm_extras(
        request(multimodal_hashes=[A], multimodal_positions=[6], multimodal_lengths=[8]), 4, 6
    )
    digest = b"".join((w & 0xFFFFFFFF).to_bytes(4, "big") for w in A)
    assert extras == [
        b"",
        digest + (0).to_bytes(8, "little"),
        digest + (2).to_bytes(8, "little"),
        digest + (6).to_bytes(8, "little"),
        b"",
        b"",
    ]
    assert hashes.mm_extras(request(), 4, 6) == []


def test_another_image_changes_the_blocks_from_its_first_one_on_and_no_block_before():
    def with_image(words, position=8):
        r = request(
            multimodal_hashes=[words], multimodal_positions=[position], multimodal_lengths=[4]
        )
        return hashes.request_hashes(r, TOKENS, 4)

    a, b = with_image(A), with_image(list(range(8)))
    assert a[:2] == b[:2] == block_hashes(TOKENS, 4)[:2]  # text before the image: shared
    assert not set(a[2:]) & set(b[2:])
    assert with_image(A, position=9)[2:] != a[2:]  # the same image at another place


@pytest.mark.parametrize(
    "fields",
    [
        {"multimodal_hashes": [A]},  # no positions nor lengths
        {"multimodal_hashes": [A], "multimodal_positions": [0, 4], "multimodal_lengths": [4]},
        {"multimodal_hashes": [A[:7]], "multimodal_positions": [0], "multimodal_lengths": [4]},
        {"multimodal_hashes": [A], "multimodal_positions": [0], "multimodal_lengths": [0]},
        {"multimodal_embedding": object()},  # an image with no hash
        {"prompt_embedding_table": object()},  # prompt tuning: virtual tokens
    ],
)
def test_inputs_the_token_ids_do_not_name_keep_a_request_out_of_the_store(fields):
    assert hashes.request_hashes(request(**fields), TOKENS, 4) is None


# ------------------------------------------------------------ the 1.2 interface
def test_the_standin_has_the_abstract_methods_and_parameters_of_tensorrt_llm_1_2():
    # kv_cache_connector.py at 3277953654b9b2863dae4f1cb81856b172837db4, lines 84-235
    from tensorrt_llm._torch.pyexecutor import kv_cache_connector as api

    assert api.KvCacheConnectorWorker.__abstractmethods__ == {
        "register_kv_caches",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
    }
    assert api.KvCacheConnectorScheduler.__abstractmethods__ == {
        "build_connector_meta",
        "get_num_new_matched_tokens",
        "request_finished",
        "update_state_after_alloc",
    }
    expected = {
        "register_forward_pass_callable": ["self"],
        "register_kv_caches": ["self", "kv_cache_tensor"],
        "start_load_kv": ["self", "stream"],
        "wait_for_layer_load": ["self", "layer_idx", "stream"],
        "save_kv_layer": ["self", "layer_idx", "stream"],
        "wait_for_save": ["self", "stream"],
        "get_finished": ["self", "finished_gen_req_ids", "started_loading_req_ids"],
        "build_connector_meta": ["self", "scheduler_output"],
        "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
        "request_finished": ["self", "request", "cache_block_ids"],
        "update_state_after_alloc": ["self", "request", "block_ids"],
    }
    for name, params in expected.items():
        cls = (
            api.KvCacheConnectorWorker
            if hasattr(api.KvCacheConnectorWorker, name)
            else (api.KvCacheConnectorScheduler)
        )
        assert list(inspect.signature(getattr(cls, name)).parameters) == params, name
    assert [f.name for f in dataclasses.fields(api.RequestData)] == [
        "request_id",
        "new_tokens",
        "new_block_ids",
        "computed_position",
        "num_scheduled_tokens",
    ]


def test_the_standin_reports_a_first_chunk_without_the_tokens_the_connector_loads():
    # as TensorRT-LLM's own test: a 4-token match, context position 4, reported as 0
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import KvCacheConnectorManager
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests

    scheduler = mock.Mock()
    scheduler.get_num_new_matched_tokens.return_value = (4, False)
    manager = KvCacheConnectorManager(mock.Mock(), scheduler)
    request = mock.Mock(request_id=5, is_generation_only_request=False)
    request.get_tokens.return_value = list(range(10))
    assert manager.get_num_new_matched_tokens(request, 0) == 4
    request.context_current_position, request.context_chunk_size = 4, 6
    request.context_remaining_length = 6
    blocks = mock.Mock()
    blocks.get_cache_indices.return_value = [7, 8, 9]
    manager.build_scheduler_output(ScheduledRequests(context_requests=[request]), blocks)
    manager.handle_metadata()
    (output,) = scheduler.build_connector_meta.call_args.args
    (data,) = output.new_requests
    assert (data.computed_position, data.num_scheduled_tokens) == (0, 6)
    assert data.new_block_ids == [7, 8, 9]


# ------------------------------------------------------------ the adapter under 1.2
class _Hit:
    """A lookup that finds the first ``blocks`` blocks of any prompt."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    def ask(self, tag, hashes):
        return types.SimpleNamespace(blocks=min(self.blocks, len(hashes)))

    def forget(self, tag):
        pass


def _prompt_request(request_id: int, tokens: int):
    return types.SimpleNamespace(
        request_id=request_id, get_tokens=lambda beam: list(range(100, 100 + tokens))
    )


def test_a_hit_is_an_asynchronous_load_in_the_step_that_matched_it():
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    scheduler = connector.KvconnScheduler(args)
    scheduler._lookup = _Hit(4)  # type: ignore[assignment]
    request = _prompt_request(3, 22)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (16, True)
    scheduler.update_state_after_alloc(request, [10, 11, 12, 13, 14, 15])
    # the request is out of this step: no report of it, but its load is in the metadata
    meta = scheduler.build_connector_meta(SchedulerOutput())
    assert [t.block_ids for t in meta.loads] == [[10, 11, 12, 13]]
    assert meta.saves == []
    # back after the load: its first report's position includes the loaded tokens
    back = RequestData(3, list(range(100, 122)), [10, 11, 12, 13, 14, 15], 16, 6)
    meta = scheduler.build_connector_meta(SchedulerOutput(new_requests=[back]))
    assert meta.loads == [] and [t.block_ids for t in meta.saves] == [[14]]
    later = RequestData(3, [9], [], 22, 1)
    assert scheduler.build_connector_meta(SchedulerOutput(cached_requests=[later])).saves == []
    # it had saves: the engine keeps its blocks until the workers report them captured
    assert scheduler.request_finished(request, [10, 11, 12, 13, 14, 15]) is True


def test_a_request_without_saves_frees_its_blocks_at_once():
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    scheduler = connector.KvconnScheduler(args)
    scheduler._lookup = _Hit(0)  # type: ignore[assignment]
    request = _prompt_request(4, 3)  # no full block
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.request_finished(request, [1]) is False


def _worker(monkeypatch, tmp_path, hit_blocks: int = 3):
    """A worker over a real LMDB store holding the first ``hit_blocks`` of a prompt."""
    import torch

    from kvconn.hashing import block_hashes

    monkeypatch.delenv("KVCONN_CONFIG", raising=False)
    monkeypatch.setenv("KVCONN_BACKEND", "lmdb")
    monkeypatch.setenv("KVCONN_OPTION_PATH", str(tmp_path / "store"))
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    worker = connector.KvconnWorker(args)
    pool = torch.randint(0, 100, (16, 2, 2, 4 * 2 * 8), dtype=torch.int16).to(torch.bfloat16)
    worker.register_kv_caches(pool)
    hashes = block_hashes(list(range(12)), 4)
    assert worker.connector is not None
    worker.connector.save(hashes[:hit_blocks], list(range(hit_blocks)))
    return worker, hashes


def test_a_failed_load_is_reported_loaded_then_raised_inside_the_forward_of_its_request(
    monkeypatch, tmp_path
):
    # an exception from start_load_kv ends TensorRT-LLM's executor loop; one from a
    # layer hook fails the active requests and the engine serves on
    worker, hashes = _worker(monkeypatch, tmp_path, hit_blocks=2)
    load = connector.Transfer(9, hashes, [4, 5, 6])  # block 2 is not stored
    worker.bind_connector_meta(connector.KvconnMetadata(loads=[load]))
    worker.start_load_kv(None)  # submits, never raises
    done: list[int] = []
    for _ in range(500):
        _, done = worker.get_finished([], [9] if not done else [])
        if done:
            break
        time.sleep(0.01)
    assert done == [9]
    assert connector._failed_loads == {9}  # rank 0 tells its scheduler
    # the request's next step: the scheduler names it, every rank fails that forward
    worker.bind_connector_meta(connector.KvconnMetadata(failed=[9]))
    worker.start_load_kv(None)
    with pytest.raises(connector.KvconnLoadError, match=r"request\(s\) \[9\]"):
        worker.wait_for_layer_load(0, None)
    worker.save_kv_layer(0, None)
    worker.wait_for_layer_load(1, None)  # raised once per step
    connector._failed_loads.clear()
    worker.close()


def test_a_forward_without_layer_hooks_saves_nothing_after_a_failed_load(monkeypatch, tmp_path):
    worker, hashes = _worker(monkeypatch, tmp_path)
    save = connector.Transfer(9, hashes[2:], [7])
    worker.bind_connector_meta(connector.KvconnMetadata(saves=[save], failed=[9]))
    worker.start_load_kv(None)
    with pytest.raises(connector.KvconnLoadError):
        worker.wait_for_save(None)
    assert worker.transfers is not None and worker.transfers.in_flight == 0
    worker.close()


def test_a_finished_requests_saves_are_reported_once_captured(monkeypatch, tmp_path):
    worker, hashes = _worker(monkeypatch, tmp_path, hit_blocks=0)
    save = connector.Transfer(5, hashes, [1, 2, 3])
    worker.bind_connector_meta(connector.KvconnMetadata(saves=[save]))
    worker.start_load_kv(None)
    worker.wait_for_save(None)
    assert worker.get_finished([5], []) == ([5], [])  # captured at hand-over on a CPU pool
    assert worker.get_finished([], []) == ([], [])  # reported once
    worker.close()


def test_the_worker_asks_for_no_forward_pass_callable(monkeypatch):
    monkeypatch.delenv("KVCONN_CONFIG", raising=False)
    assert connector.KvconnWorker(TorchLlmArgs(model="m")).register_forward_pass_callable() is None


@pytest.mark.parametrize("cls", ["KvconnWorker", "KvconnScheduler"])
def test_without_block_reuse_the_connector_is_refused_at_start_up(cls):
    # TensorRT-LLM never calls a connector when block reuse is off
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    with pytest.raises(ConfigError, match="enable_block_reuse"):
        getattr(connector, cls)(args)


@pytest.mark.parametrize("cls", ["KvconnWorker", "KvconnScheduler"])
@pytest.mark.parametrize(
    "args",
    [
        {"kv_cache_config": KvCacheConfig(dtype="nvfp4")},
        # QuantConfig(kv_cache_quant_algo=QuantAlgo.NVFP4): an enum whose value is its name
        {
            "quant_config": types.SimpleNamespace(
                kv_cache_quant_algo=types.SimpleNamespace(value="NVFP4")
            )
        },
    ],
)
def test_an_nvfp4_kv_cache_whose_scales_the_connector_never_sees_is_refused(cls, args):
    with pytest.raises(ConfigError, match="NVFP4 KV cache"):
        getattr(connector, cls)(TorchLlmArgs(model="m", **args))


@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_an_fp8_or_16_bit_kv_cache_is_stored(dtype):
    scheduler = connector.KvconnScheduler(
        TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(dtype=dtype))
    )
    assert scheduler.tokens_per_block == 32


def test_on_a_store_that_never_answers_only_the_first_new_request_waits(monkeypatch, tmp_path):
    """TensorRT-LLM 1.2 cannot be asked again later, so the scheduler waits for a
    lookup up to ``lookup_timeout_s``; on a silent store (a real Redis client against a
    server that accepts and never answers) the requests after it are misses at once,
    also once that lookup ends in the client's timeout (the store is then asked in the
    background), and the scheduler never connects to the store itself: it asks through
    the worker's client, whose start-up probe ran when the engine started."""
    import socket

    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes connections; nothing ever answers
    port = silent.getsockname()[1]
    monkeypatch.delenv("KVCONN_CONFIG", raising=False)
    monkeypatch.setenv("KVCONN_BACKEND", "redis")
    monkeypatch.setenv("KVCONN_OPTION_URL", f"redis://127.0.0.1:{port}/0")
    monkeypatch.setenv("KVCONN_OPTION_TIMEOUT_S", "1.0")  # the start-up probe's wait
    monkeypatch.setenv("KVCONN_LOOKUP_TIMEOUT_S", "0.2")
    monkeypatch.setenv("KVCONN_RETRY_INTERVAL_S", "0")  # no back-off hides the stall
    args = TorchLlmArgs(model="m", kv_cache_config=KvCacheConfig(tokens_per_block=4))
    worker = connector.KvconnWorker(args)
    worker.register_kv_caches(torch.zeros((16, 2, 2, 4 * 2 * 8), dtype=torch.bfloat16))
    scheduler = connector.KvconnScheduler(args)
    try:
        start = time.monotonic()
        assert scheduler.get_num_new_matched_tokens(_prompt_request(0, 22), 0) == (0, False)
        first = time.monotonic() - start
        took: list[float] = []
        end = time.monotonic() + 2.5  # past two of the client's 1 s timeouts
        while time.monotonic() < end:
            start = time.monotonic()
            answer = scheduler.get_num_new_matched_tokens(_prompt_request(len(took) + 1, 22), 0)
            took.append(time.monotonic() - start)
            assert answer == (0, False)
            time.sleep(0.02)
        assert 0.2 <= first < 0.5  # the lookup timeout: no probe, no redis timeout
        assert len(took) > 20
        # no request after the first waits for the store, nor after a client timeout
        assert max(took) < 0.05, took
    finally:
        scheduler.close()
        worker.close()
        silent.close()
