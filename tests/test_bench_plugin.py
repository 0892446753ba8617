"""The vLLM benchmark's plugin, on kvconn's real load path: what a load's record says.

The plugin (``benchmarks/plugins/kvconn_bench_vllm.py``) times each kvconn load inside the
engine and splits its time into the lent load's checksum and scatter passes, wall and
CPU. A split that missed a pass, or counted one outside a load,
would point the search for a fresh engine's slow first load at the wrong place.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.plugins import kvconn_bench_vllm as plugin
from kvconn import lent_load
from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.integrity import PageChecksum
from kvconn.movement import scatter_host_pages
from kvconn.tools.models import get_preset, minimax_m3
from kvconn.transfer import TransferService

from .fakes import DictBackend
from .helpers import fill_pool, tp_group


def records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in directory.glob("*.jsonl") for line in f.open()]


def test_a_load_records_its_passes_and_cpu_and_nothing_outside_a_load_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = tmp_path / "timings"
    timings.mkdir()
    monkeypatch.setenv("BENCH_KVCONN_TIMINGS", str(timings))
    monkeypatch.setattr(plugin, "_fd", None)
    # undone after the test: the plugin patches these where the engine's code finds them
    monkeypatch.setattr(Connector, "load_into", Connector.load_into)
    monkeypatch.setattr(lent_load, "scatter_host_pages", scatter_host_pages)
    monkeypatch.setattr(PageChecksum, "verify", PageChecksum.verify)
    plugin._time_load_work()
    plugin._time_load_work()  # a second import of the plugin wraps nothing twice

    layout = get_preset("llama-3.1-70b").layout(1, 4, 16, 32)
    pools = [torch.zeros(size, dtype=torch.uint8) for size in layout.pool_sizes]
    fill_pool(layout, 0, pools)
    settings = {"model": "m", "backend": "lmdb", "options": {"path": str(tmp_path / "db")}}
    conn = Connector(ConnectorConfig.from_dict(settings), layout, rank=0, pools=pools)
    try:
        hashes = [bytes([i]) * 16 for i in range(8)]
        assert conn.save(hashes, list(range(8))).ok  # verifies nothing: no record
        assert not records(timings)
        assert conn.load(hashes, list(range(8, 16))).loaded == 8
    finally:
        conn.close()

    (work,) = records(timings)
    assert work["m"] == "load_work" and work["blocks"] == 8
    for part in ("checksum", "scatter"):
        assert 0 < work[f"{part}_s"] < work["dt"]
        assert 0 <= work[f"{part}_cpu"] <= work["cpu"]
    assert work["checksum_s"] + work["scatter_s"] <= work["dt"]
    assert work["on_step"] == 1.0  # loaded on the main thread: the step's own cores


def test_a_load_says_whether_it_ran_on_the_steps_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step runs on the process's main thread; a load thread pinned elsewhere is not
    on its cores, one left where it started is."""
    own = os.sched_getaffinity(0)
    seen: list[bool] = []

    def on(cpus: set[int] | None) -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        seen.append(plugin._on_step_cores())

    for cpus in (None, {min(own)} if len(own) > 1 else None):
        thread = threading.Thread(target=on, args=(cpus,))
        thread.start()
        thread.join()
    assert seen == [True, len(own) == 1]


def test_each_garbage_collection_is_one_record_even_inside_another_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_KVCONN_TIMINGS", str(tmp_path))
    monkeypatch.setattr(plugin, "_fd", None)
    before = list(gc.callbacks)  # the collector's own list: restored, not replaced
    try:
        plugin._time_collections()
        plugin._time_collections()  # a second import of the plugin registers nothing twice
        assert len(gc.callbacks) == len(before) + 1
        gc.collect(1)
        # a collection that starts while a record is being written (its JSON allocates)
        # records itself on the same thread instead of waiting on the writer's lock
        with plugin._lock:
            gc.collect(2)
    finally:
        gc.callbacks[:] = before
    found = [r for r in records(tmp_path) if r["m"] == "gc"]
    assert [r["gen"] for r in found] == [1, 2]
    assert all(r["dt"] >= 0 and r["tid"] == threading.get_native_id() for r in found)


def test_the_split_variant_moves_idle_loads_over_a_client_with_io_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvconn-mooncake-split measures idle loads on the step's core over Mooncake, which
    ``Capabilities.io_threads`` otherwise keeps on the kept core."""
    from kvconn_mooncake import MooncakeBackend

    declared = MooncakeBackend.capabilities
    monkeypatch.setattr(MooncakeBackend, "capabilities", declared)
    kept = {max(os.sched_getaffinity(0))}

    def service() -> TransferService:
        flag = MooncakeBackend.capabilities.io_threads

        class LikeMooncake(DictBackend):
            capabilities = replace(DictBackend.capabilities, io_threads=flag)

        (conn,) = tp_group(minimax_m3(tp_size=1), LikeMooncake())
        return TransferService(conn, cpus=kept)

    before = service()
    plugin._idle_loads_move()
    after = service()
    try:
        assert not before._idle_moves and after._idle_moves
        assert replace(MooncakeBackend.capabilities, io_threads=True) == declared
    finally:
        before.close()
        after.close()
